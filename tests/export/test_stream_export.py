"""The streamed exporter (export/weights.py, export/gqa_export.py): a checkpoint read a tensor at
a time gives the same graph outputs as the model loaded whole; sharded Hugging Face folders; the
K-quant GGUFs carried exactly; the bounded self-check; the refusal line before any work."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from arborspec.export import gqa_export, gqa_graph  # noqa: E402
from arborspec.export.export_folder import export_folder  # noqa: E402
from arborspec.export.quantize import nbits_from_kquant  # noqa: E402
from arborspec.export.weights import GGUFWeights, SafetensorsWeights  # noqa: E402
from arborspec.models.gguf_loader import llamacpp_permute  # noqa: E402
from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.errors import InputError  # noqa: E402
from arborspec.runtime.kvcache import KVCache  # noqa: E402


def hf_folder(path, hidden=64, layers=2, tied=False, inter=256, shard="60KB"):
    """A tiny Llama written by transformers in bf16, in shards with an index."""
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
        rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.mul_(10)  # peaked distributions, like a trained model's
    m.save_pretrained(path, safe_serialization=True, max_shard_size=shard)
    return path


def run_steps(path, steps=((7, 0), (1, 7), (5, 8))):
    """Logits of a prefill, a one-token step and a tree step through the runtime's OrtEngine."""
    e = OrtEngine(str(path))
    cache = KVCache(e.info.cache, 32, 1)
    g = torch.Generator().manual_seed(1)
    out = []
    for t, p in steps:
        ids = torch.randint(0, 96, (1, t), generator=g)
        block = torch.ones(t, t, dtype=torch.bool).tril()
        if t == 5:
            block[3, 1:3] = False  # a branch
        mask = torch.cat([torch.ones(t, p, dtype=torch.bool), block], 1)[None]
        out.append(e.forward(ids, (p + torch.arange(t))[None], mask, cache).clone())
        cache.commit(None, t)
    e.close()
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = hf_folder(tmp_path_factory.mktemp("hf") / "llama")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    return path


@pytest.mark.parametrize("quantize_as", [None, "int4", "int8"])
def test_streamed_export_equals_the_export_of_the_loaded_model(folder, tmp_path, quantize_as):
    kw = dict(draft=None, quantize=quantize_as, max_context=128, progress=False)
    loaded = export_folder(str(folder), tmp_path / "loaded", stream="off", **kw)
    streamed = export_folder(str(folder), tmp_path / "streamed", stream="on", **kw)
    assert streamed.manifest["target"].get("quantization") == loaded.manifest["target"].get("quantization")
    for a, b in zip(run_steps(tmp_path / "loaded" / "target.onnx"), run_steps(tmp_path / "streamed" / "target.onnx")):
        assert torch.equal(a, b)  # bit for bit


def test_external_data_sink_writes_the_same_graph(folder, tmp_path, monkeypatch):
    export_folder(str(folder), tmp_path / "inline", draft=None, max_context=128, progress=False, stream="on")
    monkeypatch.setattr(gqa_export, "STREAM_BYTES", 0)  # every export "large": weights to target.onnx.data
    export_folder(str(folder), tmp_path / "ext", draft=None, max_context=128, progress=False, stream="on")
    assert (tmp_path / "ext" / "target.onnx.data").is_file() and not (tmp_path / "inline" / "target.onnx.data").exists()
    assert (tmp_path / "ext" / "target.onnx").stat().st_size < 64 * 1024  # the weights are not in the proto
    for a, b in zip(run_steps(tmp_path / "inline" / "target.onnx"), run_steps(tmp_path / "ext" / "target.onnx")):
        assert torch.equal(a, b)


def test_rtn_blocks_equal_onnxruntime_quantizer():
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper

    from arborspec.export.quantize import quantize_float_model

    w = np.random.default_rng(3).standard_normal((96, 64)).astype(np.float32)  # [N, K]
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"])], "g", [h.make_tensor_value_info("x", TP.FLOAT, [1, 64])],
        [h.make_tensor_value_info("y", TP.FLOAT, [1, 96])], [numpy_helper.from_array(w.T.copy(), "w")],
    )  # fmt: skip
    for bits in (4, 8):
        q = quantize_float_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]), bits=bits, block_size=32)
        init = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
        ours = gqa_export.rtn_nbits(w, bits, 32)
        assert np.array_equal(init["w_Q%d" % bits].reshape(-1), ours.blob.reshape(-1))
        assert np.array_equal(init["w_scales"].reshape(-1), ours.scales)
        assert np.array_equal(init["w_zero_points"].reshape(-1), ours.zero_points)
        assert onnx.helper.get_attribute_value(q.graph.node[0].attribute[-1]) is not None


def kquant_raw(qtype, n, k, seed=0):
    """Random K-quant rows (any bytes are valid blocks; d / dmin set to small finite halves)."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for at in [0, 2] if qtype != "Q6_K" else [208]:
        halves = rng.uniform(-0.05, 0.05, (n, k // 256)).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_blocks_are_the_gguf_weights_exactly(qtype):
    raw = kquant_raw(qtype, 6, 512)
    nb = nbits_from_kquant(raw, qtype, 6, 512)
    assert np.array_equal(nb.dequantize(), dequantize(raw, getattr(Q, qtype)).reshape(6, 512))
    assert (nb.bits, nb.block) == ({"Q4_K": 4, "Q5_K": 8, "Q6_K": 8}[qtype], 16 if qtype == "Q6_K" else 32)


def write_kquant_gguf(path, hidden=256, layers=2, vocab=96, heads=4, kv=2):
    """A tiny llama GGUF as llama-quantize lays out Q4_K_M: Q4_K layers, Q6_K for v and down of
    layer 0 (its mix), a Q5_K gate, an F32 norm, a Q8_0 embedding."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers), w.add_context_length(256), w.add_embedding_length(hidden)
    w.add_feed_forward_length(512), w.add_head_count(heads), w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(vocab)
    hd = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv * hd, hidden), "attn_v": (kv * hd, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (512, hidden), "ffn_up": (512, hidden),
              "ffn_down": (hidden, 512)}  # fmt: skip
    rng = np.random.default_rng(5)
    for i in range(layers):
        for name, (n, k) in shapes.items():
            qt = "Q6_K" if i == 0 and name in ("attn_v", "ffn_down") else "Q5_K" if name == "ffn_gate" else "Q4_K"
            if i == 1 and name == "ffn_up":  # a type MatMulNBits cannot hold: requantised
                raw = quantize((0.05 * rng.standard_normal((n, k))).astype(np.float32), Q.Q5_0)
                w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_shape=raw.shape, raw_dtype=Q.Q5_0)
                continue
            raw = kquant_raw(qt, n, k, seed=i * 10 + len(name))
            w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_shape=raw.shape, raw_dtype=getattr(Q, qt))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    emb = quantize((0.5 * rng.standard_normal((vocab, hidden))).astype(np.float32), Q.Q8_0)
    w.add_tensor("token_embd.weight", emb, raw_shape=emb.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_kquant_gguf_exports_with_its_own_weights(tmp_path):
    path = write_kquant_gguf(tmp_path / "q4_k_m.gguf")
    r = gqa_export.export_gqa(
        GGUFWeights(path), tmp_path / "t.onnx",
        gqa_export.GQAExport(quantize="int4", accuracy_level=0, max_context=128, tolerance=0.05),
    )  # fmt: skip
    counts = r.quantization["layers_by_source"]
    assert {"gguf-q4_k", "gguf-q5_k", "gguf-q6_k", "gguf-q8_0"} <= set(counts)
    assert counts["requantised-from-gguf"] == 1  # the Q5_0 layer, with its error stated
    assert 0 < r.quantization["requantised_max_rel_error"]["model.layers.1.mlp.up_proj.weight"] < 0.2
    # the self-check ran against PyTorch on the dequantised GGUF (float activations): fp32 rounding
    # only, on logits in the hundreds (the random K-quant scales are large)
    assert r.max_abs_diff < 0.05


def test_the_permuted_q_rows_of_a_kquant_gguf_are_undone(tmp_path):
    path = write_kquant_gguf(tmp_path / "p.gguf")
    src = GGUFWeights(path)
    q = src.linear("model.layers.1.self_attn.q_proj.weight").dequantize()
    stored = dequantize(src.blocks.tensors["blk.1.attn_q.weight"].data, Q.Q4_K).reshape(256, 256)
    assert np.array_equal(llamacpp_permute(q, 4), stored)
    assert np.array_equal(src.get("model.layers.1.self_attn.q_proj.weight"), q)


def test_safetensors_source_reads_the_shards(folder):
    src = SafetensorsWeights(folder)
    from safetensors.torch import load_file

    from arborspec.models.hf_loader import weight_files

    full = {}
    for f in weight_files(folder):
        full.update(load_file(str(f)))
    for name in ("model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight"):
        assert np.array_equal(src.get(name), full[name].float().numpy())
    with pytest.raises(InputError, match="no tensor"):
        src.get("model.layers.9.mlp.down_proj.weight")


def test_prefix_self_check_runs_and_catches_a_wrong_graph(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(gqa_export, "FULL_CHECK_BYTES", 0)  # as for a large model: the first layers only
    r = gqa_export.export_gqa(SafetensorsWeights(folder), tmp_path / "a.onnx", gqa_export.GQAExport(max_context=128))
    assert r.max_abs_diff < 1e-3
    real = gqa_graph.GQAGraph.gamma
    monkeypatch.setattr(gqa_graph.GQAGraph, "gamma", lambda self, n, out: real(self, n, out) if "post" not in out else self.weight(out, self.w.get(n) * 1.5))
    with pytest.raises(RuntimeError, match="differs from PyTorch"):
        gqa_export.export_gqa(SafetensorsWeights(folder), tmp_path / "b.onnx", gqa_export.GQAExport(max_context=128))


def test_prefix_self_check_with_feature_layers_beyond_the_prefix(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(gqa_export, "FULL_CHECK_BYTES", 0)
    spec = gqa_export.GQAExport(max_context=128, feature_layers=[0, 1])
    r = gqa_export.export_gqa(SafetensorsWeights(folder), tmp_path / "f.onnx", spec)
    assert r.max_abs_diff < 1e-3
    monkeypatch.setattr(gqa_export, "PREFIX_LAYERS", 1)  # layer 1's features lie past the checked prefix
    spec = gqa_export.GQAExport(max_context=128, feature_layers=[0, 1])
    gqa_export.export_gqa(SafetensorsWeights(folder), tmp_path / "g.onnx", spec)
    import onnx

    outs = {o.name: o for o in onnx.load(str(tmp_path / "g.onnx"), load_external_data=False).graph.output}
    assert outs["hidden_states"].type.tensor_type.shape.dim[2].dim_value == 2 * 64  # the exported graph keeps both


def test_fp16_gqa_graph_runs_and_matches(folder, tmp_path):
    s = export_folder(str(folder), tmp_path / "h", draft=None, dtype="fp16", max_context=128, progress=False, stream="on")
    t = s.manifest["target"]
    assert t["dtype"] == "fp16" and t["exporter"] == "gqa"
    e = OrtEngine(str(tmp_path / "h" / "target.onnx"))
    assert e.info.cache.dtype == torch.float16
    e.close()


def test_refusal_line_before_any_work(folder, tmp_path):
    env = {"ARBORSPEC_EXPORT_MEMORY_GB": "0.01", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "arborspec.tools.commands.cli", "export", "--model", str(folder), "--draft", "none",
         "--stream", "on", "--out", str(tmp_path / "x")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "needs about" in lines[0] and "GB is available" in lines[0], p.stderr
    assert not (tmp_path / "x").exists()


def test_stream_on_refuses_what_cannot_stream(folder, tmp_path):
    with pytest.raises(InputError, match="--stream on"):
        export_folder(str(folder), tmp_path / "x", draft="layers:1", progress=False, stream="on")


@pytest.mark.parametrize("bits", [4, 8])
def test_head_blocks_made_weight_by_weight_equal_the_quantizer_s(tmp_path, bits):
    """The EAGLE-3 head's MatMuls quantised one weight at a time (as a large head must be) give the
    outputs ONNX Runtime's MatMulNBitsQuantizer gives on the float graph, bit for bit."""
    import onnxruntime as ort

    from arborspec.export.eagle3_graph import build_head_model
    from arborspec.export.quantize import quantize_float_model
    from arborspec.models.eagle3 import load_eagle3
    from arborspec.tools.bench.scale_shapes import Shape, write_random_eagle3_head

    shape = Shape("tiny", 64, 4, 4, 2, 16, 128, False, 8.0)
    head = load_eagle3(write_random_eagle3_head(shape, tmp_path / "h", vocab=96, draft_vocab=48))
    embed = torch.randn(96, 64)
    ref = quantize_float_model(build_head_model(head, embed, 64), bits=bits, block_size=32, accuracy_level=4)
    ours = build_head_model(head, embed, 64, bits=bits, block_size=32)
    g = np.random.default_rng(0)
    t = 3
    feed = {
        "input_ids": g.integers(0, 96, (1, t)), "position_ids": np.arange(t)[None],
        "attention_mask": np.tril(np.ones((t, t), bool))[None], "hidden_in": g.standard_normal((1, t, 64)).astype(np.float32),
        "past_key.0": np.zeros((1, 2, 16, 16), np.float32), "past_value.0": np.zeros((1, 2, 16, 16), np.float32),
    }  # fmt: skip
    outs = [ort.InferenceSession(m.SerializeToString()).run(None, feed) for m in (ref, ours)]
    assert any(n.op_type == "MatMulNBits" for n in ours.graph.node)
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
