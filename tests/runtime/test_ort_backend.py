"""ONNX Runtime backend vs the PyTorch reference on the calls of one decoding step: prefill
(P = 0), a one-token decode, a random tree verify (siblings share positions, each node sees
its ancestors), fully masked padding rows; bad inputs; runtime import isolation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from arborspec.models import ModelConfig, build_model  # noqa: E402
from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.errors import ArborspecError  # noqa: E402
from arborspec.runtime.kvcache import KVCache  # noqa: E402

TOL = 1e-4


def tiny(family: str) -> ModelConfig:
    if family == "llama":  # GQA: 4 heads, 2 KV heads
        return ModelConfig("llama", 97, 48, 2, 4, 2, 12, 96, max_position=128, name="tiny-llama")
    return ModelConfig("gpt2", 97, 32, 2, 2, 2, 16, 64, max_position=128, name="tiny-gpt2")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, tmp_path_factory):
    """(TorchEngine, OrtEngine) for the target and for its layers:1 draft."""
    from arborspec.export.export_folder import truncated_draft
    from arborspec.export.onnx_export import export_contract_onnx

    torch.manual_seed(0)
    target = build_model(tiny(request.param)).eval()
    draft = truncated_draft(target, 1)
    d = tmp_path_factory.mktemp(request.param)
    out = {}
    for role, m in (("target", target), ("draft", draft)):
        export_contract_onnx(m, d / f"{role}.onnx", verify=False)
        out[role] = (TorchEngine(m), OrtEngine(d / f"{role}.onnx"))
    return out


def random_tree(n: int, g: torch.Generator):
    """Parents (node 0 is the root), depths and the ancestor-or-self mask [n, n]."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    depth, anc = [0] * n, torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
        anc[i] = anc[parent[i]]
        anc[i, i] = True
    return torch.tensor(depth), anc


def both(te, oe, ids, pos, mask, ct, co):
    lt = te.forward(ids, pos, mask, ct)
    lo = oe.forward(ids, pos, mask, co)
    p, t = ct.length, ids.shape[1]
    assert not torch.isnan(lo).any()
    assert (lo - lt).abs().max().item() < TOL
    assert (co.k[:, p : p + t] - ct.k[:, p : p + t]).abs().max().item() < TOL
    assert (co.v[:, p : p + t] - ct.v[:, p : p + t]).abs().max().item() < TOL
    return lt, lo


@pytest.mark.parametrize("role", ["target", "draft"])
def test_prefill_decode_tree_match_torch(pair, role):
    te, oe = pair[role]
    assert oe.info == te.info or (oe.info.vocab_size, oe.info.cache) == (te.info.vocab_size, te.info.cache)
    g = torch.Generator().manual_seed(1)
    v = oe.info.vocab_size
    for b in (1, 2):
        ct, co = KVCache(te.info.cache, 64, b), KVCache(oe.info.cache, 64, b)
        # prefill, P = 0
        t = 7
        ids = torch.randint(0, v, (b, t), generator=g)
        pos = torch.arange(t).expand(b, t).contiguous()
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t).contiguous()
        both(te, oe, ids, pos, mask, ct, co)
        ct.commit(None, t)
        co.commit(None, t)
        # one-token decode
        p = ct.length
        ids = torch.randint(0, v, (b, 1), generator=g)
        both(te, oe, ids, torch.full((b, 1), p), torch.ones(b, 1, p + 1, dtype=torch.bool), ct, co)
        ct.commit(None, 1)
        co.commit(None, 1)
        # a random tree per batch row (same node count), siblings share positions
        p, n = ct.length, 9
        pos, mask = [], []
        for _ in range(b):
            depth, anc = random_tree(n, g)
            pos.append(p + depth)
            mask.append(torch.cat([torch.ones(n, p, dtype=torch.bool), anc], 1))
        ids = torch.randint(0, v, (b, n), generator=g)
        both(te, oe, ids, torch.stack(pos), torch.stack(mask), ct, co)


def test_fully_masked_row_no_nan(pair):
    te, oe = pair["target"]
    ct, co = KVCache(te.info.cache, 32, 2), KVCache(oe.info.cache, 32, 2)
    ids = torch.randint(0, oe.info.vocab_size, (2, 4))
    pos = torch.arange(4).expand(2, 4).contiguous()
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(2, 4, 4).clone()
    mask[1, 2:] = False  # padding rows that see nothing at all
    lt, lo = both(te, oe, ids, pos, mask, ct, co)
    assert torch.isfinite(lo).all()


def test_bad_inputs_raise_clear_errors(pair):
    _, oe = pair["target"]
    cache = KVCache(oe.info.cache, 16, 1)
    ids = torch.zeros(1, 2, dtype=torch.long)
    pos = torch.arange(2)[None]
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="int64"):
        oe.forward(ids.int(), pos, mask, cache)
    with pytest.raises(ValueError, match="bool"):
        oe.forward(ids, pos, mask.to(torch.uint8), cache)
    with pytest.raises(ValueError, match="P\\+T"):
        oe.forward(ids, pos, torch.ones(1, 2, 3, dtype=torch.bool), cache)
    with pytest.raises(ValueError, match="dtype"):
        spec = oe.info.cache
        oe.forward(
            ids, pos, mask, KVCache(type(spec)(spec.n_layers, spec.n_kv_heads, spec.head_dim, torch.float64), 16, 1)
        )
    with pytest.raises(ValueError, match="does not fit"):
        spec = oe.info.cache
        oe.forward(ids, pos, mask, KVCache(type(spec)(spec.n_layers + 1, spec.n_kv_heads, spec.head_dim), 16, 1))
    with pytest.raises(ValueError, match="cache full"):
        oe.forward(
            torch.zeros(1, 20, dtype=torch.long), torch.arange(20)[None], torch.ones(1, 20, 20, dtype=torch.bool), cache
        )


def test_cuda_requested_without_cuda_fails_loudly(pair):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available():
        pytest.skip("a CUDA machine: the fallback check cannot trigger")
    with pytest.raises((RuntimeError, ValueError)):
        OrtEngine(pair["target"][1].path, device="cuda")


def test_foreign_onnx_rejected(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    m = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    m.ir_version = 8
    onnx.save(m, tmp_path / "foreign.onnx")
    with pytest.raises(ValueError, match="not an arborspec export"):
        OrtEngine(tmp_path / "foreign.onnx")


def test_runtime_imports_stay_light():
    code = (
        "import sys, arborspec.runtime.backends.onnxruntime, arborspec.runtime.export_dir\n"
        "bad = [m for m in ('onnx', 'transformers', 'polygraphy', 'arborspec.models', "
        "'arborspec.export') if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_fused_draft_topk_equals_topk_of_logits(tmp_path):
    """A draft graph exported with topk=K returns its own top-K (log-probs, ids) equal to the
    top-K of its logits; ModelDraft uses it, and decoding stays equal to vanilla."""
    from arborspec.export.onnx_export import export_contract_onnx
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.drafts.base import topk_of
    from arborspec.runtime.drafts.model import ModelDraft
    from arborspec.runtime.kvcache import KVCache

    torch.manual_seed(3)
    m = build_model(tiny("llama")).eval()
    export_contract_onnx(m, tmp_path / "d.onnx", verify=True, topk=5)
    e = OrtEngine(tmp_path / "d.onnx")
    assert e.caps.max_topk == 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, e.info.vocab_size, (1, 6), generator=g)
    pos = torch.arange(6)[None]
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None]
    c1, c2 = (KVCache(e.info.cache, 16, 1) for _ in range(2))
    logits = e.forward(ids, pos, mask, c1)
    vals, idx = e.forward_topk(ids, pos, mask, c2, 3)
    ref = topk_of(logits[0], 3, True)
    assert torch.allclose(vals[0], ref.values, atol=1e-5) and torch.equal(idx[0], ref.indices)
    assert torch.equal(c1.k[:, :6], c2.k[:, :6])  # the K/V are written either way
    with pytest.raises(ArborspecError, match="top-5"):
        e.forward_topk(ids, pos, mask, c2, 8)
    assert ModelDraft(e)._fused(4) and not ModelDraft(e)._fused(6)
    target = OrtEngine(tmp_path / "d.onnx")  # a self-draft: every candidate accepted
    ref_toks = SpeculativeDecoder(target, mode="vanilla").generate([1, 2, 3], 12).tokens
    for spec in ("full:2,3", "beam:2,4", "dynamic:2,2,4"):
        assert SpeculativeDecoder(target, e, tree=spec).generate([1, 2, 3], 12).tokens == ref_toks, spec


def test_target_threads_spin_only_where_no_draft_model_runs_between_calls(tmp_path, monkeypatch):
    """In-process (no shared pool: it is process-wide, the embedding API leaves it to the
    application) each session has its own pool: the target's spin-waits with a model-free draft
    (lookup, none: faster vanilla) and not with a draft model (its session needs the cores);
    ARBORSPEC_ORT_SPINNING overrides both. A bad ARBORSPEC_ORT_SHARED_POOL is one line."""
    from conftest import tiny_text_export

    from arborspec.runtime.errors import InputError
    from arborspec.runtime.export_dir import open_export

    out = tiny_text_export(tmp_path / "exp")
    key = "session.intra_op.allow_spinning"
    monkeypatch.delenv("ARBORSPEC_ORT_SPINNING", raising=False)
    monkeypatch.delenv("ARBORSPEC_ORT_SHARED_POOL", raising=False)

    def spin(draft):
        with open_export(out, draft=draft) as ex:
            assert ex.target.thread_pool == "session"
            return ex.target.session.get_session_options().get_session_config_entry(key)

    assert spin("lookup") == "1" and spin("none") == "1"
    assert spin("export") == "0"  # the export's layers:1 draft model
    monkeypatch.setenv("ARBORSPEC_ORT_SPINNING", "0")
    assert spin("lookup") == "0"
    monkeypatch.setenv("ARBORSPEC_ORT_SHARED_POOL", "yes")
    with pytest.raises(InputError, match="ARBORSPEC_ORT_SHARED_POOL must be 0 or 1"):
        open_export(out, draft="lookup")


_POOL_PROBE = """
import json, sys
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.export_dir import open_export
with open_export(sys.argv[1], draft="export") as ex:
    sessions = [ex.target.session, ex.draft.engine.session]
    toks = SpeculativeDecoder(ex.target, ex.draft, tree="full:2,2").generate([1, 2, 3], 10).tokens
    print(json.dumps([ex.target.thread_pool, [s.get_session_options().use_per_session_threads for s in sessions], toks]))
"""


def test_shared_pool_in_the_cli_and_on_request(tmp_path):
    """The `arborspec` command runs a decoding command's sessions on ONNX Runtime's one shared
    pool (bench records it); ARBORSPEC_ORT_SHARED_POOL=0 keeps a pool per session; an
    application opts in with ARBORSPEC_ORT_SHARED_POOL=1 (or enable_shared_pool()): target and
    draft then share it, and the tokens do not change. Subprocesses: the pool is process-wide."""
    import json
    import os

    from conftest import tiny_text_export

    out = tiny_text_export(tmp_path / "exp")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"id": "a", "category": "chat", "text": "the cat sat"}]))

    def run(args, **env):
        e = {k: v for k, v in os.environ.items() if not k.startswith("ARBORSPEC_ORT_")} | env
        return subprocess.run([sys.executable, *args], env=e, capture_output=True, text=True, timeout=300)

    def bench(name, **env):
        j = tmp_path / f"{name}.json"
        args = ["-m", "arborspec.tools.commands.cli", "bench", "--export-dir", str(out), "--tree", "full:2,2"]
        args += ["--prompts", str(prompts), "--max-new-tokens", "8", "--warmup", "0", "--no-progress"]
        r = run(args + ["--json-out", str(j)], **env)
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads(j.read_text())
        return res["meta"]["ort_thread_pool"], res["per_prompt"][0]["runs"]["full:2,2"]["greedy_match"]

    assert bench("shared") == ("shared", True)
    assert bench("own", ARBORSPEC_ORT_SHARED_POOL="0") == ("session", True)
    probe = tmp_path / "probe.py"
    probe.write_text(_POOL_PROBE)
    outs = {}
    for flag in ("1", "0"):
        r = run([str(probe), str(out)], ARBORSPEC_ORT_SHARED_POOL=flag)
        assert r.returncode == 0, r.stderr[-2000:]
        outs[flag] = json.loads(r.stdout.strip().splitlines()[-1])
    assert outs["1"][:2] == ["shared", [False, False]]
    assert outs["0"][:2] == ["session", [True, True]]
    assert outs["1"][2] == outs["0"][2]
