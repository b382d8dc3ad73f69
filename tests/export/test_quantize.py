"""Quantised exports (weight-only MatMulNBits on ONNX Runtime's graph): a GGUF's Q4_0 / Q4_1 /
Q8_0 blocks carried into the export compute with exactly the GGUF's weights; tree == vanilla on
a quantised export for every policy; the float path (ONNX Runtime's round-to-nearest) loads and
stays close; the manifest records the scheme; bad options are one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("onnxruntime")

from conftest import random_model, tiny_config, truncated  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from arborspec.export.onnx_export import export_gqa_onnx  # noqa: E402
from arborspec.export.quantize import GGUFBlocks, nbits_from_gguf  # noqa: E402
from arborspec.models.gguf_loader import llamacpp_permute, reverse_permute  # noqa: E402
from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402
from arborspec.runtime.errors import ArborspecError  # noqa: E402

POLICIES = ["chain:3", "full:2,2", "beam:2,3,3", "dynamic:3,3,8"]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_blocks_dequantise_to_the_gguf_weights_exactly(qtype):
    w = np.random.default_rng(int(qtype)).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, qtype)
    nb = nbits_from_gguf(raw, qtype.name, 48, 96)
    assert np.array_equal(nb.dequantize(), dequantize(raw, qtype).reshape(48, 96))
    assert nb.bits == (8 if qtype == Q.Q8_0 else 4)


LINEAR = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """A tiny Llama written as a GGUF with Q4_1 / Q4_0 layers (q/k rows permuted the llama.cpp
    way) and a Q8_0 embedding; the module's weights are the GGUF's dequantised weights."""
    cfg = dataclasses.replace(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), tie_embeddings=True)
    m = random_model(cfg, seed=21, scale=1.0)
    sd = m.state_dict()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for i in range(cfg.n_layers):
            for hf, gname in LINEAR.items():
                t = sd[f"model.layers.{i}.{hf}"].numpy()
                heads = cfg.n_heads if "q_proj" in hf else cfg.n_kv_heads if "k_proj" in hf else None
                stored = llamacpp_permute(t, heads) if heads else t
                qt = Q.Q4_0 if (i, hf) == (1, "mlp.up_proj.weight") else Q.Q4_1
                raw = quantize(stored.astype(np.float32), qt)
                w.add_tensor(f"blk.{i}.{gname}", raw, raw_shape=raw.shape, raw_dtype=qt)
                back = dequantize(raw, qt).reshape(stored.shape)
                sd[f"model.layers.{i}.{hf}"].copy_(torch.from_numpy(reverse_permute(back, heads) if heads else back))
        raw = quantize(sd["model.embed_tokens.weight"].numpy(), Q.Q8_0)
        w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=Q.Q8_0)
        sd["model.embed_tokens.weight"].copy_(torch.from_numpy(dequantize(raw, Q.Q8_0).reshape(64, 64)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m.load_state_dict(sd)
    return m, path


def test_gguf_blocks_carried_into_the_export_are_the_gguf_weights(gguf_model, tmp_path):
    m, path = gguf_model
    blocks = GGUFBlocks(path, 4, 2)
    sd = m.state_dict()
    for i in range(2):
        for hf in LINEAR:
            q = blocks.linear(f"model.layers.{i}.{hf}")
            assert np.array_equal(q.dequantize(), sd[f"model.layers.{i}.{hf}"].numpy()), hf
    r = export_gqa_onnx(m, tmp_path / "q.onnx", max_context=128, quantize="int4", gguf_path=str(path))
    assert r.quantization["source"] == "gguf-blocks" and r.quantization["layers_by_source"]["gguf-q4_0"] == 1
    assert r.max_abs_diff < 1e-4  # the same weights as the fp32 module


@pytest.fixture(scope="module")
def quantised_pair(gguf_model, tmp_path_factory):
    m, path = gguf_model
    d = tmp_path_factory.mktemp("qexp")
    export_gqa_onnx(m, d / "t.onnx", max_context=128, quantize="int4", gguf_path=str(path), verify=False)
    export_gqa_onnx(
        truncated(m, 1), d / "d.onnx", max_context=128, quantize="int4", gguf_path=str(path), verify=False, topk=8
    )
    return m, OrtEngine(d / "t.onnx"), OrtEngine(d / "d.onnx")


def test_tree_equals_vanilla_on_a_quantised_export(quantised_pair):
    m, target, draft = quantised_pair
    prompt = [5, 9, 2, 7]
    ref = SpeculativeDecoder(target, mode="vanilla").generate(prompt, 24).tokens
    assert ref == SpeculativeDecoder(TorchEngine(m), mode="vanilla").generate(prompt, 24).tokens
    for spec in POLICIES:
        mode = "chain" if spec.startswith("chain") else "tree"
        assert SpeculativeDecoder(target, draft, mode=mode, tree=spec).generate(prompt, 24).tokens == ref, spec


def test_float_weights_round_to_nearest(tmp_path):
    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=4, scale=1.0)
    r = export_gqa_onnx(m, tmp_path / "f.onnx", max_context=128, quantize="int4", block_size=32)
    assert r.quantization["source"] == "onnxruntime-rtn" and r.max_abs_diff < 5.0
    e = OrtEngine(tmp_path / "f.onnx")
    ref = SpeculativeDecoder(e, mode="vanilla").generate([1, 2, 3], 16).tokens
    got = SpeculativeDecoder(e, TorchEngine(truncated(m, 1)), tree="full:2,2").generate([1, 2, 3], 16).tokens
    assert got == ref
    for bad in (dict(quantize="int3"), dict(quantize="int4", block_size=48), dict(quantize="int4", accuracy_level=9)):
        with pytest.raises(ArborspecError):
            export_gqa_onnx(m, tmp_path / "bad.onnx", max_context=128, verify=False, **bad)


def test_export_folder_records_the_scheme_and_refuses_the_portable_graph(tmp_path):
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.export_dir import open_export

    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=6, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    s = export_folder(lm, tmp_path / "q", draft="layers:1", progress=False, quantize="int4")
    q = s.manifest["target"]["quantization"]
    assert q["scheme"] == "int4" and q["format"] == "matmulnbits" and s.manifest["draft"]["quantization"]
    with open_export(tmp_path / "q") as ex:
        assert ex.target.kv_layout == "bhsd" and ex.draft.engine.caps.max_topk == 16
    with pytest.raises(ArborspecError, match="--attention gqa"):
        export_folder(lm, tmp_path / "p", draft="none", progress=False, quantize="int4", attention="onnx")
    assert not (tmp_path / "p").exists()


def test_int8_activation_exports_warn_only_without_the_row_layout(tmp_path, capsys, monkeypatch):
    """--accuracy-level 4 (int8 activations): exact on ONNX Runtime through the engine's
    row-invariant layout, so opening it with a draft is silent; with the layout off
    (ARBORSPEC_ORT_ROW_LAYOUT=0) a row's logits depend on the call that carries it, so opening
    it with a draft warns (one line on the CLI); level 0 and a draft-less open stay silent."""
    import warnings
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.errors import InexactSpeculationWarning, ThreadPoolWarning
    from arborspec.runtime.export_dir import open_export
    from arborspec.tools.commands.cli import main

    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=6, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    for level in (0, 4):
        export_folder(
            lm, tmp_path / f"a{level}", draft="layers:1", progress=False, quantize="int4", accuracy_level=level
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails these, but the thread-pool one (its own test)
        warnings.filterwarnings("ignore", category=ThreadPoolWarning)
        for level in (0, 4):
            with open_export(tmp_path / f"a{level}") as ex:
                assert ex.exact_speculation
        monkeypatch.setenv("ARBORSPEC_ORT_ROW_LAYOUT", "0")
        with open_export(tmp_path / "a4", draft="none") as ex:
            assert not ex.exact_speculation
        with open_export(tmp_path / "a0") as ex:
            assert ex.exact_speculation
    with pytest.warns(InexactSpeculationWarning, match="--accuracy-level 4"):
        open_export(tmp_path / "a4").close()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc = main(["generate", "--export-dir", str(tmp_path / "a4"), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"])
    assert rc == 0 and "arborspec: warning: " in capsys.readouterr().err


def test_cli_prints_the_inexact_speculation_warning_as_one_line(tmp_path, capsys):
    from arborspec.runtime.errors import InexactSpeculationWarning
    from arborspec.tools.commands import cli

    cli._show_warning(InexactSpeculationWarning("X: int8 activations\nmore"), InexactSpeculationWarning, "f.py", 1)
    assert capsys.readouterr().err == "arborspec: warning: X: int8 activations\n"
    cli._show_warning(UserWarning("other"), UserWarning, "f.py", 7)
    assert "f.py:7" in capsys.readouterr().err


def test_q4_1_blocks_are_centred_so_int8_activations_round_less():
    """Q4_1 (w = d q + m) is carried as zero point 8 and offset m + 8d: the same weights, but
    MatMulNBits' int8 rounding of x then meets a centred q-part. With zero point 0 the rounding
    error meets the q-part's per-block mean (7.5 d) uncancelled (SmolLM2: 2.2x the output error,
    perplexity +2.9 % instead of +0.4 %)."""
    from arborspec.tools.bench.nbits_error import level4_output, relative_error, zero_point_0

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 512)) * 0.05).astype(np.float32)
    raw = quantize(w, Q.Q4_1)
    nb = nbits_from_gguf(raw, "Q4_1", 96, 512)
    assert nb.zero_points is None and (nb.zero_point_values() == 8).all()  # the default: nothing stored or read
    assert np.array_equal(nb.dequantize(), dequantize(raw, Q.Q4_1).reshape(96, 512))
    zp0 = zero_point_0(nb)
    assert (zp0.zero_point_values() == 0).all()
    assert np.array_equal(zp0.dequantize(), nb.dequantize())  # the same weights both ways
    x = rng.standard_normal((32, 512)).astype(np.float32)
    x[:, 7] *= 30  # an outlier channel, as real activations have
    exact = x.astype(np.float64) @ nb.dequantize().T.astype(np.float64)

    assert relative_error(level4_output(nb, x), exact) < 0.6 * relative_error(level4_output(zp0, x), exact)
    # float activations: both forms are the GGUF's weights to float32 rounding
    assert relative_error(level4_output(nb, x, 0), exact) < 1e-5


def test_q4_1_offsets_fall_back_to_zero_point_0_where_float32_cannot_hold_m_plus_8d():
    from arborspec.export.quantize import q4_1_offsets

    d = np.array([2.0**-24, 0.01], np.float32)  # 1024 + 8 * 2^-24 needs 35 significant bits
    m = np.array([1024.0, -0.08], np.float32)
    offsets, zp = q4_1_offsets(d, m)
    assert zp == 0 and np.array_equal(offsets, m)
    offsets, zp = q4_1_offsets(d[1:], m[1:])
    assert zp == 8 and offsets[0] == np.float32(np.float64(m[1]) + 8 * np.float64(d[1]))
