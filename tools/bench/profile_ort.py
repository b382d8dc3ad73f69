"""Profile one exported graph with ONNX Runtime's profiler: time per op type at (T, P).

Role in one decode step: none; measures what one model call of a step (T new tokens over P
cached ones) spends in each operator, the way the README's base-engine profile was taken.

    python -m arborspec.tools.bench.profile_ort EXPORT_DIR/target.onnx --tokens 1 --past 256 --reps 20
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from arborspec.runtime.backends.ort_loader import qdq_exact_matmul
from arborspec.runtime.errors import ArborspecError
from arborspec.tools.errors import reports_mistakes
from arborspec.tools.options import tool_parser


def _profiling_options(threads: int, prefix: str):
    """Session options for a profiled run: the runtime's settings (no spin-waiting), a thread count."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = tempfile.mkdtemp() + "/" + prefix
    return so


def _measure(run, session, reps: int) -> dict:
    """3 warm-up calls of `run`, `reps` timed ones, then the session's profile by op type:
    {"median_ms", "min_ms", "ops": [(op type, share, ms per call)]}."""
    for _ in range(3):
        run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    by: collections.Counter = collections.Counter()
    for x in json.load(open(session.end_profiling())):
        if x.get("cat") == "Node" and x["name"].endswith("_kernel_time"):
            by[x["args"]["op_name"]] += x["dur"]
    total = sum(by.values()) or 1
    calls = reps + 3
    return {
        "median_ms": 1e3 * ts[len(ts) // 2],
        "min_ms": 1e3 * ts[0],
        "ops": [(op, d / total, d / calls / 1e3) for op, d in by.most_common()],
    }


def profile(path: str, tokens: int = 1, past: int = 256, reps: int = 20, threads: int = 2) -> dict:
    """{"median_ms", "min_ms", "ops": [(op type, share, ms per call)]} for one call shape."""
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.kvcache import KVCache

    so = _profiling_options(threads, "ort")
    qdq_exact_matmul(so)  # as OrtEngine does (QDQ MatMuls in float32 unless the env says otherwise)
    e = OrtEngine(path, session_options=so)
    c = KVCache(e.info.cache, past + tokens + 1, 1)
    c.k.normal_()
    c.v.normal_()
    c.length = past
    ids = torch.randint(0, e.info.vocab_size, (1, tokens))
    pos = (past + torch.arange(tokens))[None]
    mask = torch.ones(1, tokens, past + tokens, dtype=torch.bool)
    return _measure(lambda: e.forward(ids, pos, mask, c), e.session, reps)


def profile_genai(path: str, tokens: int = 1, past: int = 256, reps: int = 20, threads: int = 2) -> dict:
    """The same measurement on an ONNX Runtime GenAI model (its builder's `model.onnx`: inputs
    input_ids, attention_mask, past_key_values.{i}.key/value [B, Hkv, P, D]), for comparison."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(path, _profiling_options(threads, "genai"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    cfg_file = Path(path).with_name("genai_config.json")
    dec = json.loads(cfg_file.read_text())["model"]["decoder"] if cfg_file.is_file() else {}
    feed = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feed[i.name] = rng.integers(0, 1000, (1, tokens), dtype=np.int64)
        elif i.name == "attention_mask":
            feed[i.name] = np.ones((1, past + tokens), np.int64)
        elif i.name == "position_ids":
            feed[i.name] = (past + np.arange(tokens, dtype=np.int64))[None]
        elif i.name.startswith("past_key_values"):
            d = i.shape[3] if isinstance(i.shape[3], int) else int(dec.get("head_size", 64))
            feed[i.name] = rng.standard_normal((1, i.shape[1], past, d), dtype=np.float32)
        else:
            raise ArborspecError(f"{path}: unexpected input {i.name!r} for a GenAI model")
    return _measure(lambda: sess.run(None, feed), sess, reps)


@reports_mistakes("profile_ort")
def main(argv=None) -> int:
    p = tool_parser(__doc__)
    p.add_argument("onnx")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--past", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--genai", action="store_true", help="the file is an ONNX Runtime GenAI model.onnx")
    a = p.parse_args(argv)
    r = (profile_genai if a.genai else profile)(a.onnx, a.tokens, a.past, a.reps, a.threads)
    print(f"T={a.tokens} P={a.past}: median {r['median_ms']:.2f} ms, min {r['min_ms']:.2f} ms")
    for op, share, ms in r["ops"][:15]:
        print(f"  {op:34s} {100 * share:5.1f}%  {ms:.3f} ms/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
