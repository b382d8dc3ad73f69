"""Llama-family decoder (Llama 2/3.x, Qwen2/2.5/3, Mistral, Phi-3, SmolLM) with the arborspec engine contract.

Role in one decoding step: this is the target (or draft) forward. It takes the T new tokens
(a prompt, a chain or a flattened tree), their position ids (past_len + depth, so siblings
share a position and RoPE rotates them alike), a boolean attention mask [B, T, P+T] (True =
may attend; the tree mask lives in the last T columns) and each layer's cached K/V for the
first P positions, and returns the logits and only the new T tokens' K/V.

Cache layout (the contract): one tensor per layer and kind, sequence-major
[S, B, Hkv, D], so that a layer's past is the dense prefix [0, P) of one preallocated slab
and the new K/V can be written straight onto [P, P+T).

The variants are a few config switches, nothing more: RoPE scaling (models/rope.py: llama3,
linear, yarn, longrope, partial rotary), biases on q/k/v (Qwen2/2.5), RMSNorm over each head of
q and k before RoPE (Qwen3, `qk_norm`), and a sliding window (Mistral, Phi-3, Qwen with
use_sliding_window: a query at position p sees keys at positions > p - window, per layer as
`layer_types` says). Phi-3's fused qkv_proj / gate_up_proj are split by the loader.

Written for export: no Python control flow on tensor values, no data-dependent shapes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .rope import Rotary


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, T, S] -> float32 [B, 1, T, S]: 0 where allowed, finfo.min elsewhere.

    finfo.min rather than -inf: a fully masked row then gives a uniform (finite) attention
    instead of NaN that would spread to other rows through the next layer.
    """
    # on the mask's device: a host constant would be a copy to the GPU in every forward (which
    # a CUDA graph cannot capture: measured on an H200)
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    neg = torch.full((), torch.finfo(torch.float32).min, dtype=torch.float32, device=mask.device)
    return torch.where(mask, zero, neg).unsqueeze(1)


def window_mask(mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """The contract mask [B, T, P+T] narrowed to a sliding window: key columns 0..P-1 hold
    positions 0..P-1 (the committed cache), the last T columns the new tokens' position_ids; a
    query at position p keeps keys at positions > p - window (transformers' sliding_window_overlay)."""
    p = mask.shape[-1] - position_ids.shape[-1]
    past = torch.arange(p, device=position_ids.device).expand(position_ids.shape[0], p)
    key_pos = torch.cat([past, position_ids], dim=-1)  # [B, P+T]
    return mask & (position_ids[:, :, None] - key_pos[:, None, :] < window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """q [B,H,T,D], k/v [B,H,S,D], bias [B,1,T,S] float32 -> [B,H,T,D]; softmax in float32."""
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def merge_past(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """past [P,B,Hkv,D] (cache layout) + new [B,Hkv,T,D] -> [B,Hkv,P+T,D]."""
    return torch.cat([past.permute(1, 2, 0, 3), new], dim=2)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B,Hkv,S,D] -> [B,Hkv*n_rep,S,D] for grouped-query attention."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32 (before a norm's weight)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalized(x, self.eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,D], cos/sin [B,T,R] with R <= D: the first R channels rotate (partial rotary)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, keep = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, keep], dim=-1)


class AttentionProjections(nn.Module):
    """An attention layer's q/k/v/o projections and head counts (Llama's and Gemma 3's)."""

    def __init__(self, cfg: ModelConfig, o_bias: bool = False):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        c = cfg.hidden_size
        self.q_proj = nn.Linear(c, self.n_heads * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(c, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(c, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, c, bias=o_bias)


class Attention(AttentionProjections):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, bias, past_k, past_v):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k_all = repeat_kv(merge_past(past_k, k), rep)
        v_all = repeat_kv(merge_past(past_v, v), rep)
        y = attend(q, k_all, v_all, bias).transpose(1, 2).reshape(b, t, self.n_heads * self.hd)
        # new K/V in the cache layout [T, B, Hkv, D]
        return self.o_proj(y), k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): Llama's MLP, and an EAGLE-3 head's (models/eagle3.py)."""

    def __init__(self, c: int, h: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(c, h, bias=bias)
        self.up_proj = nn.Linear(c, h, bias=bias)
        self.down_proj = nn.Linear(h, c, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLP(GatedMLP):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, bias, past_k, past_v)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class DecoderBody(nn.Module):
    """embed_tokens, layers, norm (the Hugging Face names), of Llama's blocks and RMSNorm or of
    another family's (models/gemma3.py)."""

    def __init__(self, cfg: ModelConfig, block=None, norm=None):
        super().__init__()
        block, norm = block or Block, norm or RMSNorm
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(block(cfg) for _ in range(cfg.n_layers))
        self.norm = norm(cfg.hidden_size, cfg.norm_eps)


def run_layers(decoder, x, past, layer_inputs):
    """decoder.model.layers over x, layer i with layer_inputs(i) = (cos, sin, bias) and its cache
    (past[2i], past[2i + 1]). Returns x after the last layer, the new K/V (k0, v0, k1, ...), and
    the hidden states entering decoder.feature_layers concatenated [B, T, len * H] (the EAGLE-3
    features; None where it names none)."""
    new, feats = [], {}
    wanted = set(decoder.feature_layers or ())
    for i, layer in enumerate(decoder.model.layers):
        if i in wanted:
            feats[i] = x
        x, k, v = layer(x, *layer_inputs(i), past[2 * i], past[2 * i + 1])
        new += [k, v]
    features = torch.cat([feats[i] for i in decoder.feature_layers], dim=-1) if decoder.feature_layers else None
    return x, new, features


class LlamaDecoder(nn.Module):
    """Contract forward: (input_ids, position_ids, attention_mask, k0, v0, k1, v1, ...)
    -> (logits, new_k0, new_v0, new_k1, new_v1, ...). Parameter names follow Hugging Face."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.init_buffers()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # target features for an EAGLE-3 draft: the hidden states entering these layers,
        # concatenated [B, T, len * H], returned as one more output (None: no such output)
        self.feature_layers: list[int] | None = None

    def init_buffers(self) -> None:
        """The RoPE frequencies (non-persistent buffers: rebuilt after a meta-device build)."""
        cfg = self.config
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)

    def forward(self, input_ids, position_ids, attention_mask, *past):
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        cfg = self.config
        bias = additive_mask(attention_mask)
        if cfg.sliding_window > 0:
            local = additive_mask(window_mask(attention_mask, position_ids, cfg.sliding_window))
        x, new, features = run_layers(self, x, past, lambda i: (cos, sin, local if cfg.is_sliding(i) else bias))
        logits = self.lm_head(self.model.norm(x)).float()
        return (logits, *new) if features is None else (logits, *new, features)
