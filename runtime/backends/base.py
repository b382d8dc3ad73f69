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


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond the plain contract call, declared by its backend (the
    defaults are the plain contract's): the decoders read these, never probe for attributes.

    batched_trees: B > 1 with T > 1 over a past works (ONNX Runtime's GroupQueryAttention CPU
      kernel: no, so batched decoding verifies roots only while several sequences are active);
    row_views: runs n rows of a larger batch cache (KVCache.rows), else every call is max_batch rows;
    ragged_rows: a batch of one-token rows may each attend over their own length (no gap read);
    max_topk: `forward_topk` returns up to this many candidates per row where the logits are
      (0: none; the draft then takes its top-k from full logits rows on the host);
    max_batch: the largest B the engine accepts (TensorRT's optimisation profiles), None: any;
    host_threads: torch threads for the decoder's host work while this engine runs
      (step.host_threads; ONNX Runtime on CPU: 1), None: leave torch alone;
    row_invariant: a row's logits and K/V do not depend on the call that carries it (ONNX
      Runtime's row layout, runtime/backends/row_layout.py), so speculation is exact by
      construction even where the kernels' sums depend on a row's place."""

    batched_trees: bool = True
    row_views: bool = False
    ragged_rows: bool = False
    max_topk: int = 0
    max_batch: int | None = None
    host_threads: int | None = None
    row_invariant: bool = False


class EngineBase:
    """What every backend class shares (Polygraphy's BaseRunner shape): `forward`,
    `forward_features` and `forward_topk` validate the call (`check_inputs`) and then run the
    backend's `*_impl`; an engine is usable once constructed, `close()` releases it
    (idempotent), and it is a context manager. `caps` declares its optional abilities."""

    closed = False
    caps = EngineCapabilities()

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """See Engine.forward."""
        self.check_inputs(input_ids, position_ids, mask, cache)
        return self.forward_impl(input_ids, position_ids, mask, cache)

    def forward_features(self, input_ids, position_ids, mask, cache: KVCache):
        """-> (logits [B, T, V], the target features [B, T, F], or None without a feature output)."""
        self.check_inputs(input_ids, position_ids, mask, cache)
        return self.forward_features_impl(input_ids, position_ids, mask, cache)

    def forward_topk(self, input_ids, position_ids, mask, cache: KVCache, k: int, logprobs: bool = False):
        """forward + each row's top-k where the logits are: (values [B, T, k], ids [B, T, k]);
        only for k <= caps.max_topk."""
        if k > self.caps.max_topk:
            raise EngineError(
                f"{self.info.name or type(self).__name__} returns its top-{self.caps.max_topk} only, {k} were asked for"
            )
        self.check_inputs(input_ids, position_ids, mask, cache)
        return self.forward_topk_impl(input_ids, position_ids, mask, cache, k, logprobs)

    def check_inputs(self, input_ids, position_ids, mask, cache: KVCache) -> None:
        """Open, and shapes that fit the contract (backends add their own checks)."""
        self._check_open()
        check_call(self.info, input_ids, position_ids, mask, cache)

    def forward_impl(self, input_ids, position_ids, mask, cache: KVCache) -> torch.Tensor:
        raise NotImplementedError

    def forward_features_impl(self, input_ids, position_ids, mask, cache: KVCache):
        return self.forward_impl(input_ids, position_ids, mask, cache), None

    def forward_topk_impl(self, input_ids, position_ids, mask, cache: KVCache, k: int, logprobs: bool):
        raise NotImplementedError

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
    """What the decoders call (EngineBase implements it; a wrapper may too)."""

    info: EngineInfo
    device: torch.device
    caps: EngineCapabilities

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
