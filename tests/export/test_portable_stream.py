"""The portable graph written a layer at a time (export/portable_graph.py, export/portable_export.py):
the same inputs, outputs and numbers as torch.onnx.export of the loaded module (within float
rounding: the RoPE tables are PyTorch's cos/sin where the traced graph runs ONNX's Cos/Sin), only
standard ONNX ops, external data, bf16, GGUF K-quant sources, the bounded prefix self-check, and a
TensorRT-RTX engine built from it ahead of time."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from test_stream_export import hf_folder, write_kquant_gguf  # noqa: E402

from arborspec.export import gqa_export, portable_graph  # noqa: E402
from arborspec.export.export_folder import export_folder  # noqa: E402
from arborspec.export.gqa_export import GQAExport  # noqa: E402
from arborspec.export.onnx_export import example_inputs, input_names  # noqa: E402
from arborspec.export.portable_export import export_portable  # noqa: E402
from arborspec.export.weights import GGUFWeights, SafetensorsWeights  # noqa: E402

KW = dict(draft=None, attention="onnx", max_context=128, progress=False, force=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def loaded(folder, tmp_path_factory):
    """torch.onnx.export of the loaded module (today's portable path), fp32 and fp16."""
    out = tmp_path_factory.mktemp("loaded")
    return {dt: export_folder(str(folder), out / dt, dtype=dt, stream="off", **KW) for dt in ("fp32", "fp16")}


def outputs(path, cfg, dtype, cases=((2, 3, 5), (1, 4, 0), (1, 1, 6), (3, 7, 20))):
    from arborspec.runtime.backends.ort_loader import qdq_exact_matmul

    so = ort.SessionOptions()
    so.log_severity_level = 3
    qdq_exact_matmul(so)  # QDQ weights: float MatMuls, as the runtime runs them
    sess = ort.InferenceSession(str(path), so)
    res = []
    for j, (b, t, p) in enumerate(cases):
        ids, pos, mask, past = example_inputs(cfg, dtype, b, t, p, seed=j, fully_masked_row=j == 0)
        res.append(sess.run(None, {n: x.numpy() for n, x in zip(input_names(cfg.n_layers), (ids, pos, mask, *past))}))
    return res


def io_of(path):
    m = onnx.load(str(path), load_external_data=False)
    desc = lambda vs: [(v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in vs]  # noqa: E731
    return desc(m.graph.input), desc(m.graph.output), m


@pytest.mark.parametrize("dtype,tol", [("fp32", 2e-5), ("fp16", 1e-2)])
def test_streamed_portable_graph_equals_the_loaded_module_export(folder, loaded, tmp_path, dtype, tol):
    s = export_folder(str(folder), tmp_path / "s", dtype=dtype, stream="on", **KW)
    assert s.manifest["target"]["exporter"] == "portable" and s.manifest["target"]["dtype"] == dtype
    a, b = tmp_path / "s" / "target.onnx", loaded[dtype].out / "target.onnx"
    ins_a, outs_a, model = io_of(a)
    assert (ins_a, outs_a) == io_of(b)[:2]  # the same contract: names, dtypes, ranks
    assert {o.domain for o in model.opset_import} == {""}  # standard ONNX only (TensorRT parses it)
    assert {n.domain for n in model.graph.node} == {""}
    cfg = SafetensorsWeights(folder).config
    tdtype = torch.float16 if dtype == "fp16" else torch.float32
    for oa, ob in zip(outputs(a, cfg, tdtype), outputs(b, cfg, tdtype)):
        for x, y in zip(oa, ob):
            scale = max(float(np.abs(y.astype(np.float32)).max()), 1.0)
            assert np.abs(x.astype(np.float32) - y.astype(np.float32)).max() <= tol * scale


@pytest.mark.parametrize("bits", [4, 8])
def test_streamed_qdq_weights_equal_the_loaded_module_export_s(folder, tmp_path, bits):
    """--quantize int4|int8 --format qdq a layer at a time: the same blocks (DequantizeLinear
    inputs bit for bit, the untied head included) and outputs within fp16 rounding."""
    from onnx import numpy_helper

    kw = dict(KW, dtype="fp16", quantize=f"int{bits}", qformat="qdq")
    s = export_folder(str(folder), tmp_path / "s", stream="on", **kw)
    ref = export_folder(str(folder), tmp_path / "l", stream="off", **kw)
    qs, ql = s.manifest["target"]["quantization"], ref.manifest["target"]["quantization"]
    assert qs["layers_by_type"] == ql["layers_by_type"] == {f"int{bits}": 15}
    columns, n_dq = {}, {}
    for name in ("s", "l"):
        m = onnx.load(str(tmp_path / name / "target.onnx"))
        inits = {t.name: t for t in m.graph.initializer}
        dqs = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
        n_dq[name] = len(dqs)
        cols = []  # one output column of one weight: its blocks' values and scales
        for n in dqs:
            q, scale = (numpy_helper.to_array(inits[i]) for i in n.input[:2])
            cols += [q[:, j].tobytes() + scale[:, j].tobytes() for j in range(q.shape[1])]
        columns[name] = sorted(cols)
    # q/k/v o gate/up down and the head: gate and up are one product here (concatenated along N)
    assert (n_dq["l"], n_dq["s"]) == (15, 2 * 6 + 1)
    assert columns["s"] == columns["l"]  # the same blocks, bit for bit
    cfg = SafetensorsWeights(folder).config
    for oa, ob in zip(outputs(tmp_path / "s" / "target.onnx", cfg, torch.float16), outputs(tmp_path / "l" / "target.onnx", cfg, torch.float16)):
        for x, y in zip(oa, ob):
            assert np.abs(x.astype(np.float32) - y.astype(np.float32)).max() <= 1e-2 * max(float(np.abs(y).max()), 1.0)


def test_external_data_gives_the_same_outputs_bit_for_bit(folder, tmp_path, monkeypatch):
    src = lambda: SafetensorsWeights(folder)  # noqa: E731
    export_portable(src(), tmp_path / "in" / "t.onnx", GQAExport(max_context=128))
    monkeypatch.setattr(gqa_export, "STREAM_BYTES", 0)
    export_portable(src(), tmp_path / "ext" / "t.onnx", GQAExport(max_context=128))
    assert (tmp_path / "ext" / "t.onnx.data").is_file() and not (tmp_path / "in" / "t.onnx.data").exists()
    cfg = src().config
    for oa, ob in zip(outputs(tmp_path / "in" / "t.onnx", cfg, torch.float32), outputs(tmp_path / "ext" / "t.onnx", cfg, torch.float32)):
        assert all(np.array_equal(x, y) for x, y in zip(oa, ob))


def test_bf16_graph_holds_bf16_weights_and_cache(folder, tmp_path):
    from onnx import TensorProto as TP

    r = export_portable(SafetensorsWeights(folder), tmp_path / "b.onnx", GQAExport(dtype="bf16", max_context=128))
    ins, outs, m = io_of(r.path)
    assert dict((n, t) for n, t, _ in ins)["past_key.0"] == TP.BFLOAT16
    assert dict((n, t) for n, t, _ in outs)["logits"] == TP.FLOAT
    w = {t.name: t for t in m.graph.initializer}["l0.q"]
    assert w.data_type == TP.BFLOAT16
    # a bf16 checkpoint's weights are carried exactly
    ref = SafetensorsWeights(folder).get("model.layers.0.self_attn.q_proj.weight").T
    import ml_dtypes

    got = np.frombuffer(w.raw_data, ml_dtypes.bfloat16).reshape(ref.shape).astype(np.float32)
    assert np.array_equal(got, ref)


def test_prefix_self_check_runs_and_catches_a_wrong_graph(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(gqa_export, "FULL_CHECK_BYTES", 0)  # as for a large model: the first layers only
    r = export_portable(SafetensorsWeights(folder), tmp_path / "a.onnx", GQAExport(max_context=128))
    assert r.max_abs_diff < 1e-4
    real = portable_graph.PortableGraph.rope
    monkeypatch.setattr(portable_graph.PortableGraph, "rope", lambda self, x, cos, sin, name: real(self, x, sin, cos, name))
    with pytest.raises(RuntimeError, match="differs from PyTorch"):
        export_portable(SafetensorsWeights(folder), tmp_path / "b.onnx", GQAExport(max_context=128))


def test_kquant_gguf_streams_into_the_portable_graph(tmp_path):
    path = write_kquant_gguf(tmp_path / "q4_k_m.gguf")
    r = export_portable(GGUFWeights(path), tmp_path / "g.onnx", GQAExport(max_context=128, tolerance=0.05))
    assert r.exporter == "portable" and r.max_abs_diff < 0.05  # the dequantised weights, fp32 rounding


def test_streamed_portable_refuses_in_one_line_before_work(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_EXPORT_MEMORY_GB", "0.01")
    with pytest.raises(Exception, match="needs about .* GB is available"):
        export_folder(str(folder), tmp_path / "x", dtype="fp16", stream="on", **KW)
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx not installed")
def test_tensorrt_rtx_builds_the_streamed_graph_from_mapped_weights(folder, tmp_path, monkeypatch):
    """The streamed graph with external data builds, its weights handed to the parser from our own
    mappings whose pages are given back while the builder runs; the engine is the size of the one
    TensorRT's own parse_from_file gives."""
    from arborspec.export import trt_build, trt_weights

    monkeypatch.setattr(gqa_export, "STREAM_BYTES", 0)  # the weights in target.onnx.data
    export_folder(str(folder), tmp_path / "s", dtype="fp16", stream="on", **KW)
    onnx_path = tmp_path / "s" / "target.onnx"
    assert (tmp_path / "s" / "target.onnx.data").is_file()
    released = []
    real = trt_weights.MappedWeights.release
    monkeypatch.setattr(trt_weights, "RELEASE_EVERY_S", 0.01)
    monkeypatch.setattr(trt_weights.MappedWeights, "release", lambda self: released.append(1) or real(self))
    kw = dict(compute_capability="8.9", flavour="tensorrt_rtx", max_tree_nodes=8, max_context=64)
    mapped = trt_build.build_engine(onnx_path, tmp_path / "m" / "t.engine", **kw)
    assert mapped.entry["n_layers"] == 2 and released  # the pages were given back during the build
    monkeypatch.setattr(trt_weights, "mapped_weights", lambda path, parser: None)
    own = trt_build.build_engine(onnx_path, tmp_path / "o" / "t.engine", **kw)
    assert mapped.entry["bytes"] == own.entry["bytes"] and mapped.entry["inputs"] == own.entry["inputs"]


def test_mapped_weights_point_at_the_external_data(folder, tmp_path, monkeypatch):
    from onnx import numpy_helper

    from arborspec.export.trt_weights import MappedWeights

    monkeypatch.setattr(gqa_export, "STREAM_BYTES", 0)
    export_portable(SafetensorsWeights(folder), tmp_path / "t.onnx", GQAExport(max_context=128, verify=False))
    m = MappedWeights(tmp_path / "t.onnx")
    whole = {t.name: numpy_helper.to_array(t, base_dir=str(tmp_path)) for t in onnx.load(str(tmp_path / "t.onnx")).graph.initializer}
    data = (tmp_path / "t.onnx.data").read_bytes()
    assert m.places and all(loc == "t.onnx.data" for _, loc, _, _ in m.places)
    for name, _, offset, length in m.places:
        assert data[offset : offset + length] == whole[name].tobytes()
