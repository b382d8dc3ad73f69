"""PyTorch backend: the reference modules themselves, on CPU or CUDA.

Role in one decoding step: runs a contract nn.Module for a draft level, a verify or a
prefill; past K/V are views of the cache prefix, and the returned new K/V are copied onto
the cache tail.
"""

from __future__ import annotations

import torch

from ..kvcache import CacheSpec, KVCache, torch_device
from ..topk import topk_of
from .base import EngineBase, EngineCapabilities, EngineInfo


def _static_calls(module, n_layers: int, device: torch.device, cuda_graphs: bool | str, kv_first: int = 1):
    """The module's static calls (cuda_graphs.py): replayed as CUDA graphs (True; a CUDA device
    only), run eagerly ("static": what the CPU tests check), or None (False: eager calls)."""
    if not cuda_graphs:
        return None
    from ..errors import DeviceError
    from .cuda_graphs import StaticCalls

    if cuda_graphs is True and device.type != "cuda":
        raise DeviceError(f"CUDA graphs need a CUDA device, not {device}")
    return StaticCalls(module, n_layers, capture=cuda_graphs is True, kv_first=kv_first)


class TorchEngine(EngineBase):
    """`cuda_graphs`: run calls of up to 128 tokens as static-shape CUDA graphs (cuda_graphs.py;
    a CUDA device only); "static": the same static calls eagerly (any device: what tests check)."""

    def __init__(
        self,
        module: torch.nn.Module,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        cuda_graphs: bool | str = False,
    ):
        cfg = module.config
        self.device = torch_device(device)  # first: a device that is not there is one line
        self.module = module.to(device=self.device, dtype=dtype).eval()
        self.info = EngineInfo(
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position,
            cache=CacheSpec(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype),
            name=cfg.name,
            n_features=len(getattr(module, "feature_layers", None) or ()) * getattr(cfg, "hidden_size", 0),
        )
        # forward_topk: any k, on the module's device; runs n rows of a larger batch cache
        self.caps = EngineCapabilities(row_views=True, max_topk=cfg.vocab_size)
        self.static = _static_calls(self.module, cfg.n_layers, self.device, cuda_graphs)

    @torch.inference_mode()
    def forward_impl(self, input_ids, position_ids, mask, cache: KVCache) -> torch.Tensor:
        return self.forward_features_impl(input_ids, position_ids, mask, cache)[0]

    @torch.inference_mode()
    def forward_features_impl(self, input_ids, position_ids, mask, cache: KVCache):
        """-> (logits [B, T, V], target features [B, T, F] or None): the features are the
        hidden states entering the module's `feature_layers` (an EAGLE-3 draft reads them)."""
        n = self.info.cache.n_layers
        if self.static is not None:
            got = self.static.run((input_ids,), position_ids, mask, cache)
            if got is not None:
                outs, new_k, new_v = got
                cache.write_tail(new_k, new_v)
                return outs[0], (outs[1] if len(outs) > 1 else None)
        past = []
        for i in range(n):
            past += list(cache.past(i))
        out = self.module(input_ids, position_ids, mask, *past)
        kv = out[1 : 1 + 2 * n]
        cache.write_tail(torch.stack(kv[0::2]), torch.stack(kv[1::2]))  # [L, T, B, H, D]
        return out[0], (out[1 + 2 * n] if len(out) > 1 + 2 * n else None)

    @torch.inference_mode()
    def forward_topk_impl(self, input_ids, position_ids, mask, cache: KVCache, k: int, logprobs: bool = False):
        """forward + the top-k of every row, on the module's device (a CUDA draft never copies
        a vocabulary-wide row to the host): (values [B, T, k], indices [B, T, k])."""
        logits = self.forward_impl(input_ids, position_ids, mask, cache)
        b, t, v = logits.shape
        top = topk_of(logits.view(b * t, v), k, logprobs)
        return top.values.view(b, t, -1), top.indices.view(b, t, -1)


class TorchEagle3Head(EngineBase):
    """An EAGLE-3 head module (models/eagle3.Eagle3Head, or anything with its contract forward,
    `project`, `token_map` and `config`) behind the head-engine interface the eagle3 draft source
    uses on every backend: forward_hidden / project / token_map. `embed` is the target's token
    embedding table [V, H]. `cuda_graphs` as TorchEngine's: the head's calls of up to 128 rows
    replayed as CUDA graphs (its eager calls were 17-30 % of a graph-replayed step on the H100)."""

    def __init__(
        self,
        head: torch.nn.Module,
        embed: torch.Tensor,
        device: str | torch.device = "cpu",
        cuda_graphs: bool | str = False,
    ):
        c = head.config
        self.device = torch_device(device)
        self.head = head.to(self.device).eval()
        self.embed = embed.to(self.device)
        self.feature_size = c.feature_size
        self.hidden_size = c.hidden_size
        self.token_map = head.token_map().cpu()
        self.info = EngineInfo(
            vocab_size=c.draft_vocab_size,
            max_position=c.max_position,
            cache=CacheSpec(1, c.n_kv_heads, c.head_dim, torch.float32),
            name="eagle3",
        )
        self.static = _static_calls(self.head, 1, self.device, cuda_graphs, kv_first=2)

    @torch.inference_mode()
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [N, F] -> the layer's hidden input [N, H]."""
        return self.head.project(features.to(self.device).float())

    @torch.inference_mode()
    def forward_hidden(self, input_ids, hidden, position_ids, mask, cache: KVCache):
        """Rows pair tokens with hidden states [B, T, H] -> (logits over the draft vocabulary,
        output hidden states); the rows' K/V go to the cache at [P, P+T)."""
        self._check_open()
        rows = (self.embed[input_ids.to(self.device)], hidden.to(self.device))
        pos = position_ids.to(self.device)
        if self.static is not None:
            got = self.static.run(rows, pos, mask, cache)
            if got is not None:
                (logits, out), new_k, new_v = got
                cache.write_tail(new_k, new_v)
                return logits, out
        logits, out, k, v = self.head(*rows, pos, mask, *cache.past(0))
        cache.write_tail(k[None], v[None])
        return logits, out
