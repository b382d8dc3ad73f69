"""c(T) and row invariance of our SmolLM2 int4 target graph: ONNX Runtime vs OpenVINO (same file)."""
import json
import os
import statistics
import sys
import time

import numpy as np

E = os.path.expanduser(sys.argv[1] if len(sys.argv) > 1 else "~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24")
P, S, L = 256, 512, 30
rng = np.random.default_rng(0)
past_k = [rng.standard_normal((1, 3, S, 64)).astype(np.float32) * 0.5 for _ in range(L)]
past_v = [rng.standard_normal((1, 3, S, 64)).astype(np.float32) * 0.5 for _ in range(L)]
TOK = rng.integers(100, 40000, 64)

def feed(T, toks=None):
    toks = TOK[:T] if toks is None else toks
    m = np.zeros((1, T, P + T), dtype=bool); m[0, :, :P] = True
    for i in range(T): m[0, i, P:P + i + 1] = True
    f = {"input_ids": np.asarray(toks, np.int64)[None], "position_ids": np.arange(P, P + T, dtype=np.int64)[None], "attention_mask": m}
    for i in range(L):
        f[f"past_key.{i}"] = past_k[i].copy(); f[f"past_value.{i}"] = past_v[i].copy()
    return f

engines = {}
if "ort" in os.environ.get("ENGINES", "ort,ov"):
    import onnxruntime as ort
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    s = ort.InferenceSession(E + "/target.onnx", so, providers=["CPUExecutionProvider"])
    engines["ort"] = lambda f: s.run(["logits"], f)[0]
if "ov" in os.environ.get("ENGINES", "ort,ov"):
    import openvino as ov
    core = ov.Core()
    cfg = {"INFERENCE_NUM_THREADS": "2", "PERFORMANCE_HINT": "LATENCY"}
    cfg.update(json.loads(os.environ.get("OVCFG", "{}")))
    c = core.compile_model(core.read_model(E + "/target.onnx"), "CPU", cfg)
    req = c.create_infer_request()
    def ovrun(f):
        req.infer(f)
        return req.get_tensor("logits").data.copy()
    engines["ov"] = ovrun

Ts = [1, 2, 4, 8, 16]
feeds = {T: feed(T) for T in Ts + [64]}
res = {n: {T: [] for T in Ts} for n in engines}
for n, run in engines.items():
    for T in Ts: run(feeds[T])
for rep in range(int(os.environ.get("REPS", 9))):
    for n, run in engines.items():
        for T in Ts:
            t0 = time.perf_counter(); run(feeds[T]); res[n][T].append(time.perf_counter() - t0)
for n in engines:
    med = {T: statistics.median(res[n][T]) * 1e3 for T in Ts}
    print(n, "c(T) ms", {T: round(v, 2) for T, v in med.items()}, "ratios", {T: round(med[T] / med[1], 2) for T in Ts})
# row invariance: row k of a T-row call == the same row of a 64-row call (same tokens, causal)
for n, run in engines.items():
    big = run(feeds[64])[0]
    diffs = {T: float(np.abs(run(feeds[T])[0] - big[:T]).max()) for T in Ts}
    print(n, "max |row of T-call - row of 64-call|", diffs)
if len(engines) == 2:
    a = engines["ort"](feeds[8])[0]; b = engines["ov"](feeds[8])[0]
    print("ort vs ov max diff T=8", float(np.abs(a - b).max()), "argmax equal", bool((a.argmax(-1) == b.argmax(-1)).all()))
