"""The model families users deploy, each against transformers itself on a tiny random checkpoint
that transformers writes here (config + save_pretrained, no hub), loaded by our HF loader:

* logits: a prompt longer than the sliding window / past original_max_position_embeddings
  (one forward) within fp32 tolerance; then a random tree on top of our cache, each node's
  logits against transformers' forward of prompt + that node's path (no cache, no custom mask:
  transformers builds its own causal / sliding-window mask);
* greedy: our vanilla decoding on torch == transformers' `generate`, token for token;
* ONNX: the GroupQueryAttention graph and the portable graph, tree decoding with a 1-layer
  self-draft == those same tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import truncated  # noqa: E402
from test_models import random_tree, tree_mask_and_depth  # noqa: E402

from arborspec.models.hf_loader import config_from_hf, load_hf_folder  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402

TOL = 1e-4
COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,  # peaked distributions: greedy far from ties
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)


def _hf_model(kind: str):
    T = transformers
    if kind == "llama3":
        return T.LlamaForCausalLM(T.LlamaConfig(**COMMON, rope_parameters=LLAMA3))
    if kind == "llama-linear":
        return T.LlamaForCausalLM(
            T.LlamaConfig(**COMMON, rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=3.0))
        )
    if kind == "llama-yarn":
        return T.LlamaForCausalLM(T.LlamaConfig(**COMMON, rope_parameters=YARN))
    if kind == "qwen2.5":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=1e6)))
    if kind == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=32, rope_parameters=YARN))
    if kind == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=8))
    if kind == "qwen2-sliding":  # Qwen's use_sliding_window: layers from max_window_layers on slide
        return T.Qwen2ForCausalLM(
            T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1)
        )
    if kind.startswith(("phi3", "phi4")):  # fused projections, longrope; Phi-4-mini: partial rotary, tied
        rot = 16  # of 16 (phi4-mini: 48 of 64, 0.75 as Phi-4-mini's 96 of 128)
        long = [1.5 + 0.7 * i for i in range(rot // 2)]
        rope = dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=long if kind == "phi3-long" else [1.0 + 0.1 * i for i in range(rot // 2)],
            long_factor=long,
            partial_rotary_factor=1.0,
        )
        c = {**COMMON, "tie_word_embeddings": False, "pad_token_id": 0}
        if kind == "phi4-mini":
            c.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
            rot = 48
            rope.update(
                short_factor=[1.0 + 0.05 * i for i in range(rot // 2)],
                long_factor=[1.5 + 0.2 * i for i in range(rot // 2)],
                partial_rotary_factor=0.75,
            )
        return T.Phi3ForCausalLM(
            T.Phi3Config(**c, rope_parameters=rope, original_max_position_embeddings=32, sliding_window=12)
        )
    if kind == "gemma3":  # interleaved sliding (own RoPE base) / full layers (linear scaling), logit softcap
        c = {k: v for k, v in COMMON.items() if k not in ("tie_word_embeddings",)}
        rope = {
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=1e4),
        }
        return T.Gemma3ForCausalLM(
            T.Gemma3TextConfig(
                **c,
                head_dim=16,
                tie_word_embeddings=True,
                rope_parameters=rope,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=24,
                final_logit_softcapping=30.0,
            )
        )
    raise KeyError(kind)


# prompt length (past the sliding window, 8 or 12, or the original context, 32), new tokens.
# longrope (phi3, phi4-mini) stays below the original context: once a sequence passes it,
# transformers' Phi-3 `generate` drops the cache and re-rotates every earlier token with the long
# factors, where we rotate each position by its own factor set (models/rope.py); phi3-long has
# short == long factors, so both rules agree and the long set is checked past 32.
FAMILIES = {
    "llama3": (44, 24),
    "llama-linear": (20, 24),
    "llama-yarn": (44, 24),
    "qwen2.5": (20, 24),
    "qwen3": (44, 24),
    "mistral": (20, 24),
    "qwen2-sliding": (20, 24),
    "phi3": (20, 12),
    "phi4-mini": (20, 12),
    "phi3-long": (44, 24),
    "gemma3": (20, 24),
}


def make_family(kind: str, tmp_path):
    torch.manual_seed(0)
    hf = _hf_model(kind).eval()
    with torch.no_grad():  # random init leaves biases at zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    path = tmp_path / kind
    hf.save_pretrained(path, safe_serialization=True)
    ours, cfg = load_hf_folder(path)
    return hf, ours, cfg


@torch.no_grad()
def check_logits(hf, ours, cfg, length: int, t: int = 7, seed: int = 0):
    """One long prefill, then a tree whose every node is checked against its own path."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (1, length), generator=g)
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None]
    empty = [torch.zeros(0, 1, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers)
    out = ours(ids, torch.arange(length)[None], mask, *empty)
    ref = hf(input_ids=ids).logits
    assert (out[0] - ref).abs().max() < TOL
    parents = random_tree(t, g)
    anc, depth = tree_mask_and_depth(parents)
    tids = torch.randint(3, cfg.vocab_size, (1, t), generator=g)
    tmask = torch.cat([torch.ones(t, length, dtype=torch.bool), anc], 1)[None]
    tree = ours(tids, (length + depth)[None], tmask, *out[1:])[0]
    for i in range(t):
        path = tids[0, anc[i]]  # the node's ancestors and itself, in depth order
        seq = torch.cat([ids[0], path])[None]
        assert (tree[0, i] - hf(input_ids=seq).logits[0, -1]).abs().max() < TOL, f"tree node {i}"


def greedy_tokens(hf, ours, n: int = 24, prompt_len: int = 20):
    prompt = [int(x) for x in torch.randint(3, ours.config.vocab_size, (prompt_len,), generator=torch.Generator())]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, prompt_len:].tolist()
    mine = SpeculativeDecoder(TorchEngine(ours), mode="vanilla").generate(prompt, n).tokens
    return prompt, mine, theirs


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_family_matches_transformers(kind, tmp_path):
    hf, ours, cfg = make_family(kind, tmp_path)
    prompt_len, n_new = FAMILIES[kind]
    check_logits(hf, ours, cfg, prompt_len)
    prompt, mine, theirs = greedy_tokens(hf, ours, n_new, prompt_len)
    assert mine == theirs


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "mistral", "qwen2-sliding", "phi3", "phi4-mini", "gemma3"])
def test_family_onnx_tree_equals_vanilla(kind, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from arborspec.export.onnx_export import export_contract_onnx, export_gqa_onnx
    from arborspec.runtime.backends.onnxruntime import OrtEngine

    hf, ours, cfg = make_family(kind, tmp_path)
    prompt_len = FAMILIES[kind][0]
    prompt = [int(x) for x in torch.randint(3, cfg.vocab_size, (prompt_len,), generator=torch.Generator())]
    ref = SpeculativeDecoder(TorchEngine(ours), mode="vanilla").generate(prompt, 20).tokens
    draft = TorchEngine(truncated(ours, 1))
    export_gqa_onnx(ours, tmp_path / "gqa.onnx", max_context=128)
    export_contract_onnx(ours, tmp_path / "portable.onnx", max_context=128)
    for graph in ("gqa.onnx", "portable.onnx"):
        engine = OrtEngine(tmp_path / graph)
        for spec in ("full:2,3", "dynamic:3,3,8"):
            assert SpeculativeDecoder(engine, draft, tree=spec).generate(prompt, 20).tokens == ref, (graph, spec)
        engine.close()


def llamacpp_rope_freqs(head_dim: int, s: dict):
    """The rope_freqs tensor llama.cpp's convert_hf_to_gguf writes for rope_type llama3: one divisor
    per frequency (1 for high frequencies, factor for low ones, smoothed in between)."""
    import math

    freqs = 1.0 / (s["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old, factor, lo, hi = (
        s["original_max_position_embeddings"],
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
    )
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def test_llama31_gguf_with_rope_freqs_matches_transformers(tmp_path):
    from test_loaders import write_tiny_gguf

    from arborspec.models.gguf_loader import load_gguf

    hf, _, cfg = make_family("llama3", tmp_path)
    extra = {"rope_freqs.weight": llamacpp_rope_freqs(cfg.head_dim, LLAMA3)}
    ours, gcfg, _ = load_gguf(write_tiny_gguf(hf, tmp_path / "l31.gguf", tied=False, extra=extra))
    assert gcfg.rope_scaling["rope_type"] == "freq_factors"
    check_logits(hf, ours, gcfg, FAMILIES["llama3"][0])  # past the original context (32)


def test_gemma3_gguf_matches_transformers(tmp_path):
    """A gemma3 GGUF written as llama.cpp's converter writes one (norms stored as 1 + w, ffn_norm =
    the pre-feed-forward norm, rope_local_base_freq / the 1-in-6 layer pattern / the attention
    scale left to llama.cpp's hard-coded values, linear scaling as rope.scaling.*)."""
    import gguf

    from arborspec.models.gguf_loader import load_gguf

    T = transformers
    torch.manual_seed(0)
    c = {k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}
    c["num_hidden_layers"] = 6  # llama.cpp's pattern: layers 0-4 slide, layer 5 is full
    rope = {
        "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4),
    }
    hf = T.Gemma3ForCausalLM(
        T.Gemma3TextConfig(
            **c,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            rope_parameters=rope,
            final_logit_softcapping=30.0,
        )
    ).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    hc = hf.config
    w = gguf.GGUFWriter(str(tmp_path / "g3.gguf"), arch="gemma3")
    w.add_block_count(hc.num_hidden_layers)
    w.add_context_length(hc.max_position_embeddings)
    w.add_embedding_length(hc.hidden_size)
    w.add_feed_forward_length(hc.intermediate_size)
    w.add_head_count(hc.num_attention_heads)
    w.add_head_count_kv(hc.num_key_value_heads)
    w.add_layer_norm_rms_eps(hc.rms_norm_eps)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_freq_base(1e6)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_final_logit_softcapping(30.0)
    w.add_sliding_window(8)
    w.add_vocab_size(hc.vocab_size)
    from test_loaders import GGUF_LAYER_NAMES

    names = {  # Gemma 3's norms around both sublayers (llama.cpp's gemma3 tensor names)
        **GGUF_LAYER_NAMES,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    for k, v in hf.state_dict().items():
        a = v.detach().float().numpy().copy() + (1.0 if k.endswith("norm.weight") else 0.0)
        if k == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif k == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            w.add_tensor(f"blk.{i}.{names[mod]}.{kind}", a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ours, cfg, _ = load_gguf(tmp_path / "g3.gguf")
    assert cfg.family == "gemma3" and cfg.layer_types[5] == "full_attention" and cfg.tie_embeddings
    check_logits(hf, ours, cfg, 20)  # past the window


@pytest.mark.parametrize("kind", ["phi3", "phi4-mini"])
def test_phi3_gguf_matches_transformers(kind, tmp_path):
    """A phi3 GGUF laid out as llama.cpp's converter writes it: fused attn_qkv / ffn_up, longrope
    as rope_factors_short / rope_factors_long + attn_factor + original_context_length, partial
    rotary as rope.dimension_count."""
    import gguf

    from arborspec.models.gguf_loader import load_gguf

    hf, _, cfg = make_family(kind, tmp_path)
    hc, rp = hf.config, hf.config.rope_parameters
    rot = int(cfg.head_dim * rp.get("partial_rotary_factor", 1.0))
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), arch="phi3")
    w.add_block_count(hc.num_hidden_layers)
    w.add_context_length(hc.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(32)
    w.add_embedding_length(hc.hidden_size)
    w.add_feed_forward_length(hc.intermediate_size)
    w.add_head_count(hc.num_attention_heads)
    w.add_head_count_kv(hc.num_key_value_heads)
    w.add_layer_norm_rms_eps(hc.rms_norm_eps)
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_sliding_window(hc.sliding_window)
    w.add_vocab_size(hc.vocab_size)
    w.add_rope_scaling_attn_factors(float(hf.model.rotary_emb.attention_scaling))
    w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], np.float32))
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.qkv_proj": "attn_qkv",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for k, v in hf.state_dict().items():
        a = v.detach().float().numpy().copy()
        if k in names:
            if not (k == "lm_head.weight" and cfg.tie_embeddings):
                w.add_tensor(names[k], a)
            continue
        _, _, i, rest = k.split(".", 3)
        mod, kind_ = rest.rsplit(".", 1)
        w.add_tensor(f"blk.{i}.{layer[mod]}.{kind_}", a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ours, gcfg, _ = load_gguf(tmp_path / "phi.gguf")
    assert gcfg.rope_scaling["rope_type"] == "longrope" and gcfg.sliding_window == 12
    assert gcfg.tie_embeddings == cfg.tie_embeddings
    check_logits(hf, ours, gcfg, FAMILIES[kind][0])


def test_rope_and_family_config_errors():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    with pytest.raises(ValueError, match="'dynamic'"):
        config_from_hf({**base, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="model_type 'mixtral'.*mixture-of-experts"):
        config_from_hf({**base, "model_type": "mixtral"})
    cfg = config_from_hf({**base, "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    cfg = config_from_hf({**base, "model_type": "qwen3", "use_sliding_window": False, "sliding_window": 4})
    assert cfg.qk_norm and cfg.sliding_window == 0
    trunc = dataclasses.replace(cfg, sliding_window=4, layer_types=["full_attention"]).truncated(1)
    assert not trunc.is_sliding(0)


# ------------------------------------------------------------- public EAGLE-3 head layouts
def public_eagle3_head(folder, target_cfg, layout: str, draft_vocab: int = 40, seed: int = 0) -> None:
    """A random head with the key names, shapes, dtypes and config fields of a public checkpoint,
    at tiny sizes: "llama3.1" = yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (pytorch_model.bin in float16,
    the target's llama3 rope_scaling, no aux-layer ids: EAGLE-3's default layers); "qwen3" =
    SpecForge / AngelSlim Qwen3 heads (model.safetensors in bfloat16, head_dim, target_hidden_size,
    Qwen fields, an embed_tokens.weight the runtime ignores)."""
    h, heads, kv = target_cfg.hidden_size, target_cfg.n_heads, target_cfg.n_kv_heads
    hd, inter, v = target_cfg.head_dim, 2 * h, target_cfg.vocab_size
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    chosen = torch.randperm(v, generator=g)[:draft_vocab].sort().values
    sd = {
        "fc.weight": r(h, 3 * h),
        "midlayer.hidden_norm.weight": 1 + 0.1 * r(h),
        "midlayer.input_layernorm.weight": 1 + 0.1 * r(h),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * r(h),
        "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "norm.weight": 1 + 0.1 * r(h),
        "lm_head.weight": 8 * r(draft_vocab, h),
        "d2t": chosen - torch.arange(draft_vocab),
        "t2d": torch.zeros(v, dtype=torch.bool).index_fill_(0, chosen, True),
    }
    common = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_act": "silu",
        "hidden_size": h,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "use_cache": True,
        "vocab_size": v,
        "draft_vocab_size": draft_vocab,
    }
    folder.mkdir(parents=True)
    if layout == "llama3.1":
        cfg = {
            **common,
            "bos_token_id": 1,
            "eos_token_id": [2],
            "max_position_embeddings": target_cfg.max_position,
            "pad_token_id": 0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {**target_cfg.rope_scaling, "rope_type": "llama3"},
            "rope_theta": target_cfg.rope_theta,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "transformers_version": "4.28.1",
        }
        torch.save({k: (x.half() if x.is_floating_point() else x) for k, x in sd.items()}, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        cfg = {
            **common,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": hd,
            "max_position_embeddings": 4 * target_cfg.max_position,
            "max_window_layers": 1,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "target_hidden_size": h,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
        }
        sd["embed_tokens.weight"] = r(v, h)
        save_file(
            {k: (x.bfloat16() if x.is_floating_point() else x) for k, x in sd.items()},
            str(folder / "model.safetensors"),
        )
    (folder / "config.json").write_text(__import__("json").dumps(cfg))


@pytest.mark.parametrize("layout,kind", [("llama3.1", "llama3"), ("qwen3", "qwen3")])
def test_public_eagle3_layouts_load_and_decode_like_vanilla(layout, kind, tmp_path):
    from arborspec.models.eagle3 import load_eagle3
    from arborspec.runtime.drafts.eagle3 import Eagle3Draft

    _, target, cfg = make_family(kind, tmp_path)
    public_eagle3_head(tmp_path / "head", cfg, layout)
    head = load_eagle3(tmp_path / "head", cfg)
    if layout == "llama3.1":  # the head rotates as its target does (llama3 scaling)
        assert head.config.rope_scaling["rope_type"] == "llama3" and head.config.aux_layers == [1, 1, 0]
        assert torch.equal(head.rotary.inv_freq, target.rotary.inv_freq)
    else:
        assert head.config.head_dim == cfg.head_dim and head.config.rope_scaling is None
    target.feature_layers = head.config.aux_layers
    eng = TorchEngine(target)
    prompt = [int(x) for x in torch.randint(3, cfg.vocab_size, (FAMILIES[kind][0],), generator=torch.Generator())]
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 20).tokens
    draft = Eagle3Draft(head, target.model.embed_tokens.weight.detach())
    for spec in ("full:2,3", "dynamic:3,3,8"):
        res = SpeculativeDecoder(eng, draft, tree=spec).generate(prompt, 20)
        assert res.tokens == ref and res.stats.draft_calls > 0, spec
    if layout != "llama3.1":
        return
    pytest.importorskip("onnxruntime")
    from arborspec.export.eagle3_graph import export_eagle3_head
    from arborspec.export.onnx_export import export_gqa_onnx
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.drafts.eagle3 import OrtEagle3Head

    export_gqa_onnx(target, tmp_path / "target.onnx", max_context=128, feature_layers=head.config.aux_layers)
    entry = export_eagle3_head(head, target.model.embed_tokens.weight.detach(), tmp_path, 128 + 32)
    assert entry["max_abs_diff"] < 1e-3
    ort_draft = Eagle3Draft(OrtEagle3Head(tmp_path / entry["file"], tmp_path / entry["fc_file"]))
    res = SpeculativeDecoder(OrtEngine(tmp_path / "target.onnx"), ort_draft, tree="full:2,3").generate(prompt, 20)
    assert res.tokens == ref
