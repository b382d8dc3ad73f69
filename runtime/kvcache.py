"""The KV cache the runtime owns: one preallocated slab per kind for all layers.

Role in one decoding step: engines read the committed prefix [0, P) of every layer and write
the new T tokens' K/V onto [P, P+T) (the contract's sequence-major layout makes both dense);
after acceptance, `commit` moves the accepted path's entries to P..P+n-1 with one gather
over all layers, so the cache keeps exactly the committed tokens.

Layout: keys and values are each [L, S_max, B, Hkv, D].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError


@dataclass(frozen=True)
class CacheSpec:
    """What an engine needs from a cache: shapes and dtype (read from a config or manifest)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32


class KVCache:
    def __init__(self, spec: CacheSpec, max_len: int, batch: int = 1, device: str | torch.device = "cpu"):
        if max_len < 1:
            raise InputError("max_len must be >= 1")
        self.spec, self.max_len, self.batch = spec, max_len, batch
        shape = (spec.n_layers, max_len, batch, spec.n_kv_heads, spec.head_dim)
        # uninitialised: engines read only the committed prefix, which was written first
        self.k = torch.empty(shape, dtype=spec.dtype, device=device)
        self.v = torch.empty(shape, dtype=spec.dtype, device=device)
        self.length = 0  # committed positions [0, length)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def reset(self) -> None:
        self.length = 0

    def fits(self, spec: CacheSpec, max_len: int, batch: int, device) -> bool:
        """Whether this cache can serve a sequence of max_len (reuse instead of reallocating)."""
        return (self.spec == spec and self.max_len >= max_len and self.batch == batch
                and self.device == torch.device(device))

    def room(self, t: int) -> None:
        """Raise if T new tokens do not fit after the committed prefix."""
        if self.length + t > self.max_len:
            raise InputError(f"KV cache full: {self.length} committed + {t} new > capacity {self.max_len}")

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's committed K/V [P, B, Hkv, D] (views, no copy)."""
        return self.k[layer, : self.length], self.v[layer, : self.length]

    def tail(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [T, B, Hkv, D] where an engine writes the new tokens' K/V."""
        p = self.length
        return self.k[layer, p : p + t], self.v[layer, p : p + t]

    def commit(self, src, n_written: int) -> None:
        """Keep the new entries at offsets `src` (a list or tensor of offsets relative to the
        committed length, in order) and drop the rest of the n_written scratch entries. One
        gather over all layers for keys and one for values; none when `src` is 0..n-1 (a chain
        accepted from its start). `src=None` keeps all n_written entries (a prefill)."""
        p = self.length
        if src is None:
            self.length = p + n_written
            return
        if isinstance(src, torch.Tensor):
            src = src.tolist()
        n = len(src)
        if n == 0:
            return
        if src[-1] == n - 1 and src == list(range(n)):
            self.length = p + n
            return
        idx = torch.tensor(src, dtype=torch.long, device=self.device) + p
        self.k[:, p : p + n] = self.k.index_select(1, idx)
        self.v[:, p : p + n] = self.v.index_select(1, idx)
        self.length = p + n
