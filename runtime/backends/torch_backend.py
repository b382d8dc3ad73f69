"""PyTorch backend: the reference modules themselves, on CPU or CUDA.

Role in one decoding step: runs a contract nn.Module for a draft level, a verify or a
prefill; past K/V are views of the cache prefix, and the returned new K/V are copied onto
the cache tail.
"""
from __future__ import annotations

import torch

from ..kvcache import CacheSpec, KVCache
from ..errors import EngineError
from .base import EngineInfo, check_call


class TorchEngine:
    def __init__(self, module: torch.nn.Module, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        cfg = module.config
        self.module = module.to(device=device, dtype=dtype).eval()
        self.device = torch.device(device)
        fl = getattr(module, "feature_layers", None)
        self.info = EngineInfo(
            vocab_size=cfg.vocab_size, max_position=cfg.max_position,
            cache=CacheSpec(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype), name=cfg.name,
            n_features=len(fl) * cfg.hidden_size if fl else 0)

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, mask, cache: KVCache) -> torch.Tensor:
        return self._run(input_ids, position_ids, mask, cache)[0]

    @torch.inference_mode()
    def forward_features(self, input_ids, position_ids, mask, cache: KVCache):
        """-> (logits [B, T, V], target features [B, T, F]); needs info.n_features > 0."""
        if not self.info.n_features:
            raise EngineError("this engine has no target-feature output (module.set_feature_layers)")
        return self._run(input_ids, position_ids, mask, cache)

    def _run(self, input_ids, position_ids, mask, cache: KVCache):
        check_call(self.info, input_ids, position_ids, mask, cache)
        n = self.info.cache.n_layers
        past = []
        for i in range(n):
            past += list(cache.past(i))
        out = self.module(input_ids, position_ids, mask, *past)
        t = input_ids.shape[1]
        p = cache.length
        kv = out[1 : 1 + 2 * n]
        cache.k[:, p : p + t] = torch.stack(kv[0::2])  # [L, T, B, H, D]
        cache.v[:, p : p + t] = torch.stack(kv[1::2])
        return out[0], (out[1 + 2 * n] if len(out) > 1 + 2 * n else None)
