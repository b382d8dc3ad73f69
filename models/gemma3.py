"""Gemma 3 text decoder (gemma3_text: the 270M and 1B checkpoints, and the text part of the larger
ones) with the arborspec engine contract.

Role in one decoding step: the same as models/llama.py (target or draft forward over the T new
tokens with a tree mask and each layer's cached K/V, returning the logits and the new K/V); the
contract, cache layout and parameter names (Hugging Face's) are the same. What Gemma 3 does
differently, all visible below:

* embeddings scaled by sqrt(hidden_size);
* RMSNorm multiplies by (1 + w) (weights stored around 0), computed in float32;
* RMSNorm over each head of q and k before RoPE;
* four norms per block: input, post-attention (on the attention output, before the residual
  add), pre-feed-forward and post-feed-forward (on the MLP output, before the add);
* GeGLU feed-forward with tanh-approximated GELU (gelu_pytorch_tanh);
* attention scale query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5); optional tanh
  softcapping of the final logits (attn_logit_softcapping is not applied: transformers' Gemma 3
  attention does not pass it on, and the published configs set it to null);
* interleaved layers (`layer_types`): sliding-window layers (a query at position p sees keys at
  positions > p - window, models/llama.window_mask) rotate with their own RoPE base
  (rope_local_base_freq, default RoPE); full-attention layers with rope_theta and its scaling.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .llama import (
    AttentionProjections,
    DecoderBody,
    RMSNorm,
    additive_mask,
    apply_rope,
    merge_past,
    repeat_kv,
    rms_normalized,
    run_layers,
    window_mask,
)
from .rope import Rotary


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm multiplies by 1 + w (w starts at zero)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap if cap > 0 else x


class Attention(AttentionProjections):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, o_bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(self.hd, cfg.norm_eps)
        self.k_norm = GemmaRMSNorm(self.hd, cfg.norm_eps)
        self.scale = cfg.attn_scale or self.hd**-0.5

    def forward(self, x, cos, sin, bias, past_k, past_v):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k_all = repeat_kv(merge_past(past_k, k), rep)
        v_all = repeat_kv(merge_past(past_v, v), rep)
        scores = torch.matmul(q, k_all.transpose(-1, -2)).float() * self.scale + bias
        y = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v_all)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd)
        return self.o_proj(y), k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, h = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(c, h, bias=False)
        self.up_proj = nn.Linear(c, h, bias=False)
        self.down_proj = nn.Linear(h, c, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = GemmaRMSNorm(c, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = GemmaRMSNorm(c, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(c, eps)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, bias, past_k, past_v)
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, k, v


class Gemma3Decoder(nn.Module):
    """Contract forward, see models/llama.LlamaDecoder (also its `feature_layers` output)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg, Block, GemmaRMSNorm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_buffers()
        self.feature_layers: list[int] | None = None

    def init_buffers(self) -> None:
        """The RoPE tables' frequencies (non-persistent buffers: rebuilt after a meta-device build)."""
        cfg = self.config
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self.rotary_local = Rotary(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, None, cfg.max_position)

    def forward(self, input_ids, position_ids, attention_mask, *past):
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the weights' dtype, as HF does; a Python number, so that no
        # host-to-device copy sits in the forward (a CUDA graph cannot capture one)
        x = x * float(torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype))
        full = (*self.rotary(position_ids), additive_mask(attention_mask))
        local = full
        if cfg.sliding_window > 0:
            window = window_mask(attention_mask, position_ids, cfg.sliding_window)
            local = (*self.rotary_local(position_ids), additive_mask(window))
        x, new, features = run_layers(self, x, past, lambda i: local if cfg.is_sliding(i) else full)
        logits = softcap(self.lm_head(self.model.norm(x)).float(), cfg.final_softcap)
        return (logits, *new) if features is None else (logits, *new, features)
