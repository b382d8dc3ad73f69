"""GPT-2 / NanoGPT decoder with the arborspec engine contract.

Role in one decoding step: the same as models/llama.py (target or draft forward over the T
new tokens with a tree mask and the cached K/V), for the learned-position-embedding family of
the seed write-up. Position ids index the learned table, so siblings share a position.
Parameter names follow nanoGPT (transformer.wte, transformer.h.{i}.attn.c_attn, ...), with
nn.Linear weights ([out, in]); the Hugging Face loader transposes GPT-2's Conv1D weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from arborspec.runtime.errors import InputError

from .config import ModelConfig
from .llama import additive_mask, attend, merge_past


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.hd = cfg.n_heads, cfg.head_dim
        c = cfg.hidden_size
        self.c_attn = nn.Linear(c, 3 * c, bias=cfg.bias)
        self.c_proj = nn.Linear(c, c, bias=cfg.bias)

    def forward(self, x, bias, past_k, past_v):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, self.hd).transpose(1, 2)
        k = k.view(b, t, self.n_head, self.hd).transpose(1, 2)
        v = v.view(b, t, self.n_head, self.hd).transpose(1, 2)
        y = attend(q, merge_past(past_k, k), merge_past(past_v, v), bias)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y), k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x):
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, bias, past_k, past_v):
        a, k, v = self.attn(self.ln_1(x), bias, past_k, past_v)
        x = x + a
        return x + self.mlp(self.ln_2(x)), k, v


class GPT2Decoder(nn.Module):
    """Contract forward, see models/llama.py; n_kv_heads == n_heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.n_kv_heads != cfg.n_heads:
            raise InputError("GPT-2 has no grouped-query attention: n_kv_heads must equal n_heads")
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                wpe=nn.Embedding(cfg.max_position, cfg.hidden_size),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)),
                ln_f=nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids, position_ids, attention_mask, *past):
        x = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)
        bias = additive_mask(attention_mask)
        new = []
        for i, block in enumerate(self.transformer.h):
            x, k, v = block(x, bias, past[2 * i], past[2 * i + 1])
            new += [k, v]
        logits = self.lm_head(self.transformer.ln_f(x)).float()
        return (logits, *new)
