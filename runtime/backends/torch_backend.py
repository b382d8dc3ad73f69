"""PyTorch backend: the reference modules themselves, on CPU or CUDA.

Role in one decoding step: runs a contract nn.Module for a draft level, a verify or a
prefill; past K/V are views of the cache prefix, and the returned new K/V are copied onto
the cache tail.
"""
from __future__ import annotations

import torch

from ..kvcache import CacheSpec, KVCache
from .base import EngineBase, EngineInfo, check_call


class TorchEngine(EngineBase):
    def __init__(self, module: torch.nn.Module, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        cfg = module.config
        self.module = module.to(device=device, dtype=dtype).eval()
        self.device = torch.device(device)
        self.info = EngineInfo(
            vocab_size=cfg.vocab_size, max_position=cfg.max_position,
            cache=CacheSpec(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype), name=cfg.name,
            n_features=len(getattr(module, "feature_layers", None) or ()) * getattr(cfg, "hidden_size", 0))
        self.max_topk = cfg.vocab_size  # forward_topk: any k, on the module's device

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, mask, cache: KVCache) -> torch.Tensor:
        return self.forward_features(input_ids, position_ids, mask, cache)[0]

    @torch.inference_mode()
    def forward_features(self, input_ids, position_ids, mask, cache: KVCache):
        """-> (logits [B, T, V], target features [B, T, F] or None): the features are the
        hidden states entering the module's `feature_layers` (an EAGLE-3 draft reads them)."""
        self._check_open()
        check_call(self.info, input_ids, position_ids, mask, cache)
        n = self.info.cache.n_layers
        past = []
        for i in range(n):
            past += list(cache.past(i))
        out = self.module(input_ids, position_ids, mask, *past)
        kv = out[1:1 + 2 * n]
        cache.write_tail(torch.stack(kv[0::2]), torch.stack(kv[1::2]))  # [L, T, B, H, D]
        return out[0], (out[1 + 2 * n] if len(out) > 1 + 2 * n else None)

    @torch.inference_mode()
    def forward_topk(self, input_ids, position_ids, mask, cache: KVCache, k: int, logprobs: bool = False):
        """forward + the top-k of every row, on the module's device (a CUDA draft never copies
        a vocabulary-wide row to the host): (values [B, T, k], indices [B, T, k])."""
        from ..drafts import topk_of

        logits = self.forward(input_ids, position_ids, mask, cache)
        b, t, v = logits.shape
        top = topk_of(logits.view(b * t, v), k, logprobs)
        return top.values.view(b, t, -1), top.indices.view(b, t, -1)
