"""`arborspec export --kv-dtype fp16`: ONNX Runtime's GroupQueryAttention graph with fp32 weights
and a float16 KV cache. The export loads with fp16 slabs (metadata, manifest and the graph's input
type agree); its logits are within 1e-2 of the largest logit (relative) of the fp32-KV export's
on a prompt and a tree step; on the same fp16-KV export greedy tree decoding equals vanilla
decoding and the cache after many tree steps equals a fresh prefill; bad combinations are one
line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from conftest import random_model, tiny_config, truncated  # noqa: E402

from arborspec.export.export_folder import export_folder  # noqa: E402
from arborspec.export.onnx_export import export_gqa_onnx  # noqa: E402
from arborspec.runtime import contract as C  # noqa: E402
from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402
from arborspec.runtime.errors import ExportDirError, InputError  # noqa: E402
from arborspec.runtime.kvcache import KVCache  # noqa: E402
from arborspec.runtime.onnx_meta import read_onnx_metadata  # noqa: E402
from arborspec.tools.commands.cli import main  # noqa: E402

# fp16 rounds each cached K/V to 11 significant bits (relative 4.9e-4): through 2 layers the
# logits move by well under 1 % of the largest logit (measured: ~6e-4)
REL_TOL = 1e-2
PROMPT = [3, 1, 4, 1, 5, 9, 2]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random Llama (GQA heads, head dim 16) exported twice: fp32 and fp16 KV."""
    m = random_model(tiny_config("llama", vocab=80, layers=2, hidden=64, heads=4, kv=2), seed=11)
    d = tmp_path_factory.mktemp("kvdtype")
    r32 = export_gqa_onnx(m, d / "kv32.onnx", max_context=512, verify=True)
    r16 = export_gqa_onnx(m, d / "kv16.onnx", max_context=512, verify=True, kv_dtype="fp16")
    assert r32.kv_dtype is None and r16.kv_dtype == "fp16"
    assert r16.max_abs_diff < REL_TOL  # the export's own self-check, relative for an fp16 cache
    return m, OrtEngine(d / "kv32.onnx"), OrtEngine(d / "kv16.onnx")


def test_fp16_export_loads_with_fp16_slabs(pair):
    _, e32, e16 = pair
    assert e32.kv_dtype == torch.float32 and e16.kv_dtype == torch.float16
    assert e16.info.cache.dtype == torch.float16 and e16.info.cache.layout == "bhsd"
    assert e16.metadata[C.META_KV_DTYPE] == "fp16" and e16.metadata[C.META_DTYPE] == "fp32"
    assert e32.metadata[C.META_KV_DTYPE] == "fp32"
    cache = KVCache(e16.info.cache, 32, 1)
    assert cache.k.dtype == torch.float16 and cache.k.element_size() == 2
    import onnx

    g = onnx.load(str(e16.path)).graph
    elem = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.output)}
    assert elem[C.past_key(0)] == elem[C.new_value(1)] == onnx.TensorProto.FLOAT16
    assert elem[C.LOGITS] == onnx.TensorProto.FLOAT  # logits stay float32
    casts = [n for n in g.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT16]
    assert len(casts) == 2  # q/k/v of each layer go to fp16 once


def test_logits_close_to_the_fp32_cache(pair):
    """A 7-token prompt, then a 16-node random tree over it: same logits within REL_TOL, and the
    cached K/V within fp16 rounding of the fp32 cache's."""
    m, e32, e16 = pair
    g = torch.Generator().manual_seed(5)
    caches = [KVCache(e.info.cache, 64, 1) for e in (e32, e16)]
    n = len(PROMPT)
    ids = torch.tensor([PROMPT])
    pos = torch.arange(n)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    l32, l16 = (e.forward(ids, pos, mask, c) for e, c in zip((e32, e16), caches))
    assert l16.dtype == torch.float32 and not torch.isnan(l16).any()
    assert _rel(l16, l32) < REL_TOL
    for c in caches:
        c.commit(None, n)
    t = 16
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, t)]
    anc = torch.zeros(t, t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    ids = torch.randint(0, m.config.vocab_size, (1, t), generator=g)
    pos = (n + anc.sum(1) - 1)[None]
    mask = torch.cat([torch.ones(t, n, dtype=torch.bool), anc], 1)[None]
    l32, l16 = (e.forward(ids, pos, mask, c) for e, c in zip((e32, e16), caches))
    assert _rel(l16, l32) < REL_TOL
    for c in caches:
        c.length = n + t
    for i in range(m.config.n_layers):
        for a, b in zip(caches[1].past(i), caches[0].past(i)):
            assert _rel(a, b) < 2e-3  # one fp16 rounding of each K/V plus what the layers below moved


def test_tree_decoding_equals_vanilla_and_cache_equals_prefill(pair):
    """On the same fp16-KV export: tree decoding (a torch layers:1 draft) reproduces vanilla
    decoding token for token; after those steps the cache equals a fresh prefill."""
    m, _, e16 = pair
    ref = SpeculativeDecoder(e16, mode="vanilla").generate(PROMPT, 40).tokens
    draft = TorchEngine(truncated(m, 1))
    for spec in ("full:2,3", "beam:2,4,4", "chain:4"):
        mode = "chain" if spec.startswith("chain") else "tree"
        dec = SpeculativeDecoder(e16, draft, mode=mode, tree=spec)
        r = dec.generate(PROMPT, 40)
        assert r.tokens == ref, spec
    cache = dec._cache
    seq = PROMPT + r.tokens
    n = cache.length
    assert n == len(seq) - 1 and cache.k.dtype == torch.float16
    fresh = KVCache(e16.info.cache, n + 1, 1)
    e16.forward(torch.tensor([seq[:n]]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], fresh)
    fresh.commit(None, n)
    for i in range(m.config.n_layers):
        for a, b in zip(cache.past(i), fresh.past(i)):
            # fp16 values of the same K/V (measured: bit-identical; allowed: one fp16 rounding step)
            assert _rel(a, b) < 2e-3, i


def test_export_folder_records_the_kv_dtype_and_decodes(tmp_path):
    """export_folder(kv_dtype="fp16"): target and layers:1 draft both fp16-KV; the manifest says so;
    the folder opens and tree decoding from it equals vanilla decoding."""
    from arborspec.runtime.export_dir import open_export
    from arborspec.runtime.generator import Generator

    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=7)
    d = tmp_path / "export"
    export_folder(
        SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"}),
        d,
        draft="layers:1",
        progress=False,
        verify=True,
        kv_dtype="fp16",
    )
    man = json.loads((d / "manifest.json").read_text())
    for role in ("target", "draft"):
        assert man[role]["dtype"] == "fp32" and man[role]["kv_dtype"] == "fp16", role
        past = next(x for x in man[role]["inputs"] if x["name"] == C.past_key(0))
        assert past["dtype"] == "float16"
        assert read_onnx_metadata(d / man[role]["file"])["metadata"][C.META_KV_DTYPE] == "fp16"
    with open_export(d) as ex:
        assert ex.target.kv_dtype == torch.float16
    with Generator.from_export(d, draft="none") as gen:
        ref = gen.generate(PROMPT, 24).tokens
    with Generator.from_export(d, tree="full:2,2") as gen:
        assert gen.generate(PROMPT, 24).tokens == ref


def test_metadata_that_disagrees_with_the_graph_is_one_line(pair, tmp_path):
    import onnx

    _, _, e16 = pair
    model = onnx.load(str(e16.path))
    for p in model.metadata_props:
        if p.key == C.META_KV_DTYPE:
            p.value = "fp32"
    onnx.save(model, str(tmp_path / "bad.onnx"))
    with pytest.raises(ExportDirError, match="declares a fp32 KV cache but past_key.0 is tensor\\(float16\\)"):
        OrtEngine(tmp_path / "bad.onnx")


def test_bad_combinations_are_one_clear_line(tmp_path, capsys):
    m = random_model(tiny_config("llama", vocab=64, layers=1, hidden=64, heads=4, kv=2), seed=3)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    cases = [
        (dict(attention="onnx"), r"needs ONNX Runtime.s graph \(--attention gqa\)"),
        (dict(dtype="fp16"), "is for fp32 weights"),
        (dict(dtype="bf16", attention="onnx"), "is for fp32 weights"),
        (dict(quantize="int4", qformat="qdq"), "not the portable graph"),
        (dict(kv_dtype="int8"), "unknown --kv-dtype"),
    ]
    for kw, msg in cases:
        kw = {"kv_dtype": "fp16", **kw}
        with pytest.raises(InputError, match=msg) as e:
            export_folder(lm, tmp_path / "x", draft="none", progress=False, verify=False, **kw)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "x").exists()
    # auto resolves to the portable graph for a model GroupQueryAttention cannot run (head dim 8)
    m8 = random_model(tiny_config("llama", vocab=64, layers=1, hidden=32, heads=4, kv=2), seed=3)
    lm8 = SimpleNamespace(module=m8, config=m8.config, tokenizer=None, source={"kind": "test"})
    with pytest.raises(InputError, match="--kv-dtype fp16 needs ONNX Runtime's graph.*multiple of 16"):
        export_folder(lm8, tmp_path / "y", draft="none", progress=False, verify=False, kv_dtype="fp16")
    # the CLI: exit 2, one line, no traceback
    for extra in (["--attention", "onnx"], ["--dtype", "fp16"]):
        rc = main(["export", "--model", "nope.gguf", "--out", str(tmp_path / "z"), "-q", "--kv-dtype", "fp16", *extra])
        err = capsys.readouterr().err
        lines = [x for x in err.strip().splitlines() if x]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("arborspec: error: --kv-dtype fp16"), err


def test_compare_runs_on_an_fp16_cache_export(tmp_path, capsys):
    """`arborspec compare` feeds fp16 K/V to both runners and judges with the fp16 tolerances."""
    pytest.importorskip("polygraphy")
    from test_compare import save_hf_llama

    src = save_hf_llama(random_model(tiny_config("llama", max_position=256)), tmp_path / "src")
    out = tmp_path / "export"
    export_folder(str(src), out, draft="layers:1", progress=False, verify=False, kv_dtype="fp16")
    rc = main(["compare", "--export-dir", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "PASSED" in text, text
    assert "fp32 weights with a fp16 KV cache" in text


def test_int4_weights_take_an_fp16_cache_too(pair, tmp_path):
    """--quantize int4 (MatMulNBits, fp32 activations) is the same graph around the attention:
    an fp16 cache works there and decodes the same greedy tokens as its fp32-cache twin."""
    pytest.importorskip("onnxruntime.quantization")
    m = pair[0]
    for kv in ("fp32", "fp16"):
        export_gqa_onnx(m, tmp_path / f"q{kv}.onnx", max_context=512, quantize="int4", verify=False, kv_dtype=kv)
    e32, e16 = OrtEngine(tmp_path / "qfp32.onnx"), OrtEngine(tmp_path / "qfp16.onnx")
    assert e16.kv_dtype == torch.float16
    a, b = (SpeculativeDecoder(e, mode="vanilla").generate(PROMPT, 20).tokens for e in (e32, e16))
    assert a == b
