"""`--quantize int4|int8 --format qdq`: standard blockwise DequantizeLinear + MatMul on the
portable graph. A GGUF's Q4_0 / Q4_1 / Q8_0 blocks are carried exactly (the same weights as the
GGUF and as the MatMulNBits form), float weights are rounded to nearest per block (the rule of
ONNX Runtime's symmetric quantiser); the export loads in ONNX Runtime, greedy tree == vanilla on
it, it builds with tensorrt_rtx ahead of time, and the manifest records the format."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import test_quantize  # noqa: E402
from conftest import random_model, tiny_config  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from test_quantize import LINEAR  # noqa: E402

from arborspec.export.onnx_export import export_contract_onnx  # noqa: E402
from arborspec.export.qdq import qdq_from_nbits, qdq_round_to_nearest  # noqa: E402
from arborspec.export.quantize import GGUFBlocks, nbits_from_gguf  # noqa: E402
from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402
from arborspec.runtime.errors import ArborspecError  # noqa: E402

gguf_model = test_quantize.gguf_model  # the tiny GGUF fixture (Q4_1, one Q4_0 layer, Q8_0 embedding)
HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
POLICIES = ["chain:3", "full:2,2", "beam:2,3,3", "dynamic:3,3,8"]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("bits", [4, 8])
def test_gguf_blocks_as_qdq_are_the_gguf_weights_exactly(qtype, bits):
    w = np.random.default_rng(int(qtype)).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, qtype)
    nb = nbits_from_gguf(raw, qtype.name, 48, 96)
    q = qdq_from_nbits(nb, max(bits, nb.bits))
    assert np.array_equal(q.dequantize(), dequantize(raw, qtype).reshape(48, 96))
    assert np.array_equal(q.dequantize(), nb.dequantize())  # == the MatMulNBits form's weights
    lo = -(2 ** (q.bits - 1))
    assert q.q.min() >= lo and q.q.max() <= -lo - 1
    assert q.bits == (8 if qtype == Q.Q8_0 or bits == 8 else 4)
    assert (q.offsets is not None) == (qtype == Q.Q4_1)


@pytest.mark.parametrize("bits", [4, 8])
def test_q4_1_blocks_as_float16_qdq_keep_the_gguf_d_and_m(bits):
    """An fp16 graph: the scales and offsets are the GGUF's own fp16 d and m (the MatMulNBits form
    carries m + 8d, which fp16 may not hold: then the blocks become int8 with q in 0..15)."""
    w = (np.random.default_rng(3).standard_normal((48, 96)) * 3.0).astype(np.float32)
    raw = quantize(w, Q.Q4_1)
    blocks = raw.reshape(48, 3, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    q = qdq_from_nbits(nbits_from_gguf(raw, "Q4_1", 48, 96), bits, np.float16)
    assert np.array_equal(q.scales, d)
    centred = q.bits == 4
    assert np.array_equal(q.offsets.astype(np.float64), m.astype(np.float64) + 8.0 * d * centred)
    assert q.q.min() >= -8 * centred and q.q.max() <= 15 - 8 * centred
    assert bits == 4 or q.bits == 8


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_matches_onnxruntime_symmetric(bits):
    """Our blockwise RTN is ONNX Runtime's symmetric MLAS rule (scale = signed absmax / -2^(b-1))."""
    qz = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    w = np.random.default_rng(bits).standard_normal((40, 128)).astype(np.float32)
    q = qdq_round_to_nearest(w, bits, 32)
    k, n = w.shape[1], w.shape[0]
    fn = getattr(qz, "quantize_matmul_4bits" if bits == 4 else "quantize_matmul_8bits", None)
    if fn is None:
        pytest.skip(f"this onnxruntime has no quantize_matmul_{bits}bits")
    blob = np.zeros((n, k // 32, 32 * bits // 8), np.uint8)
    scales = np.zeros(n * k // 32, np.float32)
    zp = np.zeros(n * ((k // 32 + 1) // 2) if bits == 4 else n * k // 32, np.uint8)
    fn(blob, np.ascontiguousarray(w.T), scales, zp, 32, n, k, True)
    if bits == 4:
        vals = np.stack([blob & 0x0F, blob >> 4], -1).reshape(n, k // 32, 32).astype(np.float32) - 8
    else:
        vals = blob.reshape(n, k // 32, 32).astype(np.float32) - 128
    ref = (vals * scales.reshape(n, k // 32, 1)).reshape(n, k)
    assert np.array_equal(q.dequantize(), ref)
    assert qdq_round_to_nearest(w[:, :40], bits, 32) is None  # K not a multiple of the block


def _dequantised_matmul_weights(path) -> list[np.ndarray]:
    """Every DequantizeLinear's float weight [K, N] (+ its block offsets), computed with the
    ONNX reference implementation."""
    from onnx.reference import ReferenceEvaluator

    m = onnx.load(str(path))
    inits = {t.name: t for t in m.graph.initializer}
    out = {}
    for nd in m.graph.node:
        if nd.op_type != "DequantizeLinear":
            continue
        g = onnx.helper.make_graph(
            [nd], "dq", [], [onnx.helper.make_tensor_value_info(nd.output[0], 1, None)], [inits[i] for i in nd.input]
        )
        mm = onnx.helper.make_model(g, opset_imports=m.opset_import)
        w = ReferenceEvaluator(mm).run(None, {})[0]
        base = nd.output[0][:-2]
        if base + ".offset" in inits:
            w = w + np.repeat(numpy_helper.to_array(inits[base + ".offset"]), 32, axis=0)
        out[nd.output[0]] = w
    return list(out.values())


def test_gguf_qdq_export_carries_the_blocks(gguf_model, tmp_path):
    m, path = gguf_model
    r = export_contract_onnx(m, tmp_path / "q.onnx", max_context=128, quantize="int4", gguf_path=str(path))
    q = r.quantization
    assert q["format"] == "qdq" and q["source"] == "gguf-blocks" and q["zero_point"] == 0
    assert q["layers_by_source"] == {"gguf-q4_1": 13, "gguf-q4_0": 1, "gguf-q8_0": 1}  # head = Q8_0 embedding
    assert q["layers_by_type"] == {"int4": 14, "int8": 1} and q["kept_float"] == 0
    assert r.max_abs_diff < 1e-4  # the GGUF's own weights = the module's
    # the graph's dequantised weights are exactly the GGUF's blocks (and the MatMulNBits form's)
    blocks = GGUFBlocks(path, 4, 2)
    want = {}
    for name in [f"model.layers.{i}.{hf}" for i in range(2) for hf in LINEAR] + ["lm_head.weight"]:
        w = blocks.linear(name).dequantize()
        want[w.T.tobytes()] = name
    got = _dequantised_matmul_weights(tmp_path / "q.onnx")
    assert len(got) == 15 and all(np.ascontiguousarray(w).tobytes() in want for w in got)
    types = {t.data_type for t in onnx.load(str(tmp_path / "q.onnx")).graph.initializer}
    assert onnx.TensorProto.INT4 in types and onnx.TensorProto.INT8 in types
    ops = {n.op_type for n in onnx.load(str(tmp_path / "q.onnx")).graph.node}
    assert "MatMulNBits" not in ops and "DequantizeLinear" in ops


@pytest.fixture(scope="module")
def qdq_folder(gguf_model, tmp_path_factory):
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder

    m, path = gguf_model
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "gguf", "path": str(path)})
    d = tmp_path_factory.mktemp("qdqexp") / "q"
    s = export_folder(
        lm, d, draft="layers:1", progress=False, quantize="int4", qformat="qdq", max_context=128, max_tree_nodes=16
    )
    return m, d, s


def test_folder_manifest_and_greedy_tree_equals_vanilla(qdq_folder):
    m, d, s = qdq_folder
    for role in ("target", "draft"):
        q = s.manifest[role]["quantization"]
        assert q["format"] == "qdq" and q["scheme"] == "int4" and q["source"] == "gguf-blocks"
    from arborspec.runtime.export_dir import open_export

    with open_export(d) as ex:
        assert ex.target.kv_layout == "sbhd"
        target, draft = ex.target, ex.draft.engine
        prompt = [5, 9, 2, 7]
        ref = SpeculativeDecoder(target, mode="vanilla").generate(prompt, 24).tokens
        assert ref == SpeculativeDecoder(TorchEngine(m), mode="vanilla").generate(prompt, 24).tokens
        for spec in POLICIES:
            mode = "chain" if spec.startswith("chain") else "tree"
            assert SpeculativeDecoder(target, draft, mode=mode, tree=spec).generate(prompt, 24).tokens == ref, spec


def test_float_weights_round_to_nearest_and_bad_options(tmp_path):
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder

    cfg = dataclasses.replace(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), tie_embeddings=False)
    m = random_model(cfg, seed=4)
    r = export_contract_onnx(m, tmp_path / "f.onnx", max_context=128, quantize="int8")
    assert r.quantization["source"] == "rtn-symmetric" and r.quantization["layers_by_type"] == {"int8": 15}
    e = OrtEngine(tmp_path / "f.onnx")
    meta = json.loads(e.metadata["arborspec.quantization"])
    assert meta["format"] == "qdq" and meta["layers_by_type"] == {"int8": 15}
    # the int8 weights are dequantised once at load: the same logits as the module with those weights
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        for name, p in m2.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(torch.from_numpy(qdq_round_to_nearest(p.detach().numpy(), 8, 32).dequantize()))
    ids, pos = torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5)[None]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    from arborspec.runtime.kvcache import KVCache

    lo = e.forward(ids, pos, mask, KVCache(e.info.cache, 16, 1))
    lr = TorchEngine(m2).forward(ids, pos, mask, KVCache(TorchEngine(m2).info.cache, 16, 1))
    assert float((lo - lr).abs().max()) < 1e-3
    ref = SpeculativeDecoder(e, mode="vanilla").generate([1, 2, 3], 16).tokens
    from conftest import truncated

    assert SpeculativeDecoder(e, TorchEngine(truncated(m, 1)), tree="full:2,2").generate([1, 2, 3], 16).tokens == ref
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    for kw, msg in [
        (dict(quantize="int4", qformat="qdq", attention="gqa"), "--attention onnx"),
        (dict(qformat="qdq"), "--quantize"),
        (dict(quantize="int4", qformat="nope"), "--format"),
        (dict(quantize="int4", qformat="qdq", opset=20), "opset >= 21"),
    ]:
        with pytest.raises(ArborspecError, match=msg):
            export_folder(lm, tmp_path / "bad", draft="none", progress=False, **kw)
        assert not (tmp_path / "bad").exists()


@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx not installed (pip install tensorrt-rtx)")
def test_qdq_export_builds_with_tensorrt_rtx_ahead_of_time(qdq_folder, tmp_path):
    """The int4 (with Q4_1 offsets) + int8 QDQ graph parses and builds for SM 8.9 on a CPU."""
    from arborspec.export.trt_build import build_engine

    _, d, _ = qdq_folder
    for name in ("target", "draft"):
        r = build_engine(
            d / f"{name}.onnx",
            tmp_path / f"{name}.engine",
            compute_capability="8.9",
            flavour="tensorrt_rtx",
            max_batch=1,
            max_tree_nodes=8,
            max_context=64,
        )
        assert r.engine_path.stat().st_size > 0
        assert r.entry["onnx_metadata"]["arborspec.kv_layout"] == "sbhd"


def test_tied_head_read_through_a_transpose_is_quantised():
    """A tied LM head (SmolLM2's: MatMul(x, Transpose(embedding)), the embedding also feeds the
    Gather) stays float by default (a quantised copy adds memory; ONNX Runtime runs an 8-bit head
    slowly); asked for, it gets its own blocks, the Gather keeps the float embedding, the
    Transpose goes."""
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx.reference import ReferenceEvaluator

    from arborspec.export.qdq import apply_qdq, rtn_layer_lookup

    emb = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)  # [vocab, hidden]
    g = h.make_graph(
        [
            h.make_node("Gather", ["E", "ids"], ["x"]),
            h.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
            h.make_node("MatMul", ["x", "Et"], ["y"]),
        ],
        "tied",
        [h.make_tensor_value_info("ids", TP.INT64, [3])],
        [h.make_tensor_value_info("y", TP.FLOAT, [3, 48])],
        [numpy_helper.from_array(emb, "E")],
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 23)])
    kept = apply_qdq(m.__deepcopy__(), rtn_layer_lookup(8, 32), 32)
    assert kept["layers_by_type"] == {} and kept["kept_float_shared"] == 1
    counts = apply_qdq(m, rtn_layer_lookup(8, 32), 32, shared_heads=True)
    assert counts["layers_by_type"] == {"int8": 1}
    assert [n.op_type for n in m.graph.node] == ["Gather", "DequantizeLinear", "MatMul"]
    ids = np.array([1, 5, 7])
    y = ReferenceEvaluator(m).run(None, {"ids": ids})[0]
    w = qdq_round_to_nearest(emb, 8, 32).dequantize()  # [vocab, hidden] = the head's [out, in]
    np.testing.assert_allclose(y, emb[ids] @ w.T, rtol=1e-5, atol=1e-5)
