"""The backend protocol: one small class per backend, all behind `Engine`.

Role in one decoding step: every model call of the step (draft levels, the target's verify,
prefills) goes through `Engine.forward`, which reads the cache's committed prefix, writes the
new tokens' K/V onto the cache tail by address and returns float32 logits. The decode loop
never knows which backend runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import EngineError, InputError
from ..kvcache import CacheSpec, KVCache


@dataclass(frozen=True)
class EngineInfo:
    vocab_size: int
    max_position: int
    cache: CacheSpec
    max_tokens: int | None = None  # largest T the engine accepts in one call (None: no limit)
    name: str = ""
    n_features: int = 0  # width of the target-feature output (forward_features), 0: none


class EngineBase:
    """Lifecycle shared by every backend class (Polygraphy spirit): an engine is usable once
    constructed, `close()` releases it (idempotent), and it is a context manager."""

    closed = False

    def close(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineError(f"{type(self).__name__} {getattr(self.info, 'name', '')!s} is closed")


class Engine(Protocol):
    info: EngineInfo
    device: torch.device

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """input_ids/position_ids int64 [B,T], mask bool [B,T,P+T] with P = cache.length.
        Writes new K/V to cache[:, P:P+T] (does not advance cache.length); returns logits
        float32 [B,T,V] on self.device."""
        ...

    def close(self) -> None: ...


def check_call(
    info: EngineInfo, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: KVCache
) -> None:
    """Validate shapes before an engine call (ONNX Runtime does not check symbolic dims)."""
    b, t = input_ids.shape
    p = cache.length
    if position_ids.shape != (b, t):
        raise InputError(f"position_ids shape {tuple(position_ids.shape)} != input_ids {(b, t)}")
    if mask.shape != (b, t, p + t):
        raise InputError(f"attention_mask shape {tuple(mask.shape)} != {(b, t, p + t)} (B, T, P+T)")
    if mask.dtype != torch.bool:
        raise InputError(f"attention_mask must be bool, got {mask.dtype}")
    if cache.batch != b:
        raise InputError(f"cache batch {cache.batch} != input batch {b}")
    cache.room(t)
    if info.max_tokens is not None and t > info.max_tokens:
        raise EngineError(f"{t} tokens in one call exceed this engine's limit of {info.max_tokens}")
