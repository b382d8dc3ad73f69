"""The KV cache the runtime owns: one preallocated slab per kind for all layers.

Role in one decoding step: engines read the committed prefix [0, P) of every layer and write
the new T tokens' K/V onto [P, P+T) (the contract's sequence-major layout makes both dense);
after acceptance, `commit` moves the accepted path's entries to P..P+n-1 with one gather
over all layers, so the cache keeps exactly the committed tokens.

Layouts (runtime/contract.py KV_LAYOUTS): "sbhd", keys and values each [L, S_max, B, Hkv, D]
(a layer's past is the dense prefix [0, P) of its slab); "bhsd", each [L, B, Hkv, S_max, D] (the
engine reads and writes the layer's whole slab in place). Either way the committed tokens are
positions [0, length) and a commit is one gather along the sequence axis.
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
    layout: str = "sbhd"  # or "bhsd"


class KVCache:
    def __init__(self, spec: CacheSpec, max_len: int, batch: int = 1, device: str | torch.device = "cpu"):
        if max_len < 1:
            raise InputError("max_len must be >= 1")
        self.spec, self.max_len, self.batch = spec, max_len, batch
        if spec.layout == "bhsd":
            shape = (spec.n_layers, batch, spec.n_kv_heads, max_len, spec.head_dim)
            self.seq_dim = 3
        else:
            shape = (spec.n_layers, max_len, batch, spec.n_kv_heads, spec.head_dim)
            self.seq_dim = 1
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
        return (
            self.spec == spec
            and self.max_len >= max_len
            and self.batch == batch
            and self.device == torch.device(device)
        )

    def room(self, t: int) -> None:
        """Raise if T new tokens do not fit after the committed prefix."""
        if self.length + t > self.max_len:
            raise InputError(f"KV cache full: {self.length} committed + {t} new > capacity {self.max_len}")

    def _seq(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return x[:, a:b] if self.seq_dim == 1 else x[:, :, :, a:b]

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's committed K/V [P, B, Hkv, D] (views, no copy; strided for "bhsd")."""
        p = self.length
        if self.seq_dim == 1:
            return self.k[layer, :p], self.v[layer, :p]
        return self.k[layer, :, :, :p].permute(2, 0, 1, 3), self.v[layer, :, :, :p].permute(2, 0, 1, 3)

    def tail(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [T, B, Hkv, D] where an engine writes the new tokens' K/V."""
        p = self.length
        if self.seq_dim == 1:
            return self.k[layer, p : p + t], self.v[layer, p : p + t]
        return (self.k[layer, :, :, p : p + t].permute(2, 0, 1, 3), self.v[layer, :, :, p : p + t].permute(2, 0, 1, 3))

    def write_tail(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Write all layers' new K/V [L, T, B, Hkv, D] at [P, P+T)."""
        t, p = new_k.shape[1], self.length
        if self.seq_dim == 1:
            self.k[:, p : p + t] = new_k
            self.v[:, p : p + t] = new_v
        else:
            self.k[:, :, :, p : p + t] = new_k.permute(0, 2, 3, 1, 4)
            self.v[:, :, :, p : p + t] = new_v.permute(0, 2, 3, 1, 4)

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
        d = self.seq_dim
        self._seq(self.k, p, p + n).copy_(self.k.index_select(d, idx))
        self._seq(self.v, p, p + n).copy_(self.v.index_select(d, idx))
        self.length = p + n
