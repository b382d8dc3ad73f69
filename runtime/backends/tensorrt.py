"""TensorRT backend, the runner: a serialized engine (from `arborspec build`) behind the Engine
protocol.

Role in one decoding step: runs every model call of the step on the GPU (a draft level, the
target's verify over root + tree, a prefill). The KV cache never leaves the device and is
never copied: each layer's `past_key.i` is bound by address to the dense prefix
`cache.k[i, :P]`, its `new_key.i` output onto the tail `cache.k[i, P:P+T]`, and the logits go
into a preallocated CUDA buffer; the call is enqueued with `execute_async_v3` on torch's
current stream, so it orders with the surrounding torch work without a host sync.

Graphs with more than the contract's I/O are bound too: a target's `hidden_states` output
(the features an EAGLE-3 head reads: `forward_features`), an EAGLE-3 head's `hidden_in` input
and `hidden_states` output (`forward_hidden`), a draft's fused top-k outputs (scratch buffers);
`TrtProjection` runs an EAGLE-3 head's projection engine (`draft_fc.engine`,
target_features [N, F] -> hidden_states [N, H]).

The loader half (the module import, deserialisation, compatibility checks, the execution
context, the engine's I/O read against the contract) is backends/trt_loader.py. Importing this
file needs no TensorRT; constructing a TrtEngine needs `tensorrt` or `tensorrt_rtx` and a CUDA GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import contract as C
from ..errors import DeviceError, EngineError, InputError, MissingFileError
from ..fileio import atomic_write_bytes
from ..kvcache import CacheSpec, KVCache, resolve_device
from .base import EngineBase, EngineCapabilities, EngineInfo, check_call
from .trt_loader import TrtGraph, load_engine, make_context, read_io, read_projection_io, trt_errors


class TrtEngine(EngineBase):
    """Engine protocol over a TensorRT engine file.

    engine_path: a `.engine` written by `arborspec build` (engines.json beside it is read for
      the TensorRT module, compute capability and model limits; optional).
    device: the CUDA device the engine runs on; the KVCache must live there too.
    Keywords: flavour ("tensorrt" / "tensorrt_rtx"; None: the recorded one); clone_logits:
      return a fresh logits tensor (default), False a view of the preallocated buffer, valid
      until this engine's next call. The same signature as OrtEngine's: (path, device, *, options).
    """

    def __init__(
        self,
        engine_path: str | os.PathLike,
        device: str | torch.device = "cuda",
        *,
        flavour: str | None = None,
        clone_logits: bool = True,
    ):
        self.path = Path(engine_path)
        if not self.path.is_file():
            raise MissingFileError(f"TensorRT engine not found: {self.path}")
        self.device = resolve_device(device)
        if self.device.type != "cuda":
            raise InputError(f"TrtEngine runs on a CUDA device, not {self.device}")
        if not torch.cuda.is_available():
            raise DeviceError("TrtEngine needs a CUDA GPU and none is visible to torch")
        self.clone_logits = clone_logits
        with torch.cuda.device(self.device):
            loaded = self._loaded = load_engine(self.path, self.device, flavour)
            self.trt, self.flavour, self.entry = loaded.trt, loaded.flavour, loaded.entry
            self.runtime, self.engine = loaded.runtime, loaded.engine
            self._read_io()
            make_context(self.path, loaded)
            self.context = loaded.context
        self._active_profile = 0
        self._logits_buf: torch.Tensor | None = None

    # ------------------------------------------------------------------ set-up

    def _read_io(self) -> None:
        """The engine's I/O (trt_loader.read_io) as this engine's attributes."""
        self._take_io(read_io(self.path, self._loaded))

    def _take_io(self, g: TrtGraph) -> None:
        self.inputs, self.outputs, self.dtypes = g.inputs, g.outputs, g.dtypes
        self.has_hidden_in, self.extra_outputs = g.has_hidden_in, g.extra_outputs
        self.profiles, self.info, self.config = g.profiles, g.info, g.config
        self.max_batch = max(p["B"][1] for p in self.profiles)
        self.caps = EngineCapabilities(max_batch=self.max_batch)  # the profiles fix the largest B
        self.max_tokens = g.info.max_tokens

    def save_runtime_cache(self) -> Path | None:
        """TensorRT-RTX: write the JIT kernel cache beside the engine (next load starts warm)."""
        loaded = self._loaded
        if loaded.runtime_cache is None or loaded.runtime_cache_path is None:
            return None
        blob = loaded.runtime_cache.serialize()
        if blob is None:
            return None
        return atomic_write_bytes(loaded.runtime_cache_path, bytes(memoryview(blob)))

    def close(self) -> None:
        """Save the RTX runtime cache and release the context and engine."""
        if self.closed:
            return
        try:
            self.save_runtime_cache()
        finally:
            self.context = None
            self.engine = None
            self._loaded.context = self._loaded.engine = None
            super().close()

    # ------------------------------------------------------------------ calls

    def profile_for(self, b: int, t: int, p: int) -> int:
        """Index of the first profile covering (B, T, P) (build order: decode, then prefill)."""
        for k, r in enumerate(self.profiles):
            if (
                r["B"][0] <= b <= r["B"][1]
                and r["T"][0] <= t <= r["T"][1]
                and r["P"][0] <= p <= r["P"][1]
                and r["S"][0] <= p + t <= r["S"][1]
            ):
                return k
        ranges = "; ".join(
            f"#{k}: B {r['B'][0]}..{r['B'][1]}, T {r['T'][0]}..{r['T'][1]}, P {r['P'][0]}..{r['P'][1]}"
            for k, r in enumerate(self.profiles)
        )
        raise EngineError(
            f"no optimisation profile of {self.path.name} covers B={b}, T={t}, P={p} "
            f"({ranges}); rebuild with larger --max-batch/--max-tree-nodes/"
            f"--max-context"
        )

    def _logits_out(self, b: int, t: int) -> torch.Tensor:
        n = b * t * self.info.vocab_size
        if self._logits_buf is None or self._logits_buf.numel() < n:
            # sized for the largest call any profile accepts, grown lazily for smaller engines
            cap = max(n, self.max_batch * min(self.max_tokens, 512) * self.info.vocab_size)
            self._logits_buf = torch.empty(cap, dtype=self.dtypes["logits"], device=self.device)
        return self._logits_buf[:n].view(b, t, self.info.vocab_size)

    def forward_impl(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """See Engine.forward (a graph with a hidden input needs forward_hidden)."""
        return self._run(input_ids, position_ids, mask, cache)[0]

    def forward_features_impl(self, input_ids, position_ids, mask, cache: KVCache):
        """-> (logits [B, T, V], target features [B, T, F]) from an engine with the contract's
        `hidden_states` output (an EAGLE-3 draft's target); (logits, None) without one."""
        logits, extra = self._run(input_ids, position_ids, mask, cache)
        return logits, extra.get(C.HIDDEN_STATES)

    def forward_hidden(self, input_ids, hidden, position_ids, mask, cache: KVCache):
        """An EAGLE-3 head engine: rows pair tokens with hidden states [B, T, H] -> (logits over
        the draft vocabulary [B, T, Vd], the layer's output hidden states [B, T, H])."""
        if not self.has_hidden_in:
            raise EngineError(f"{self.path.name} is not an EAGLE-3 head engine (no {C.HIDDEN_IN} input)")
        self.check_inputs(input_ids, position_ids, mask, cache)
        logits, extra = self._run(input_ids, position_ids, mask, cache, hidden)
        return logits, extra[C.HIDDEN_STATES]

    def check_inputs(self, input_ids, position_ids, mask, cache: KVCache) -> None:
        """The contract's checks plus this engine's: the cache's device, dtype, shape, layout."""
        self._check_open()
        check_call(self.info, input_ids, position_ids, mask, cache)
        if cache.device != self.device:
            raise InputError(f"KV cache is on {cache.device}, the engine on {self.device}")
        if cache.k.dtype != self.dtypes["past_key.0"]:
            raise InputError(f"KV cache dtype {cache.k.dtype} != engine's {self.dtypes['past_key.0']}")
        spec = self.info.cache
        if tuple(cache.k.shape[3:]) != (spec.n_kv_heads, spec.head_dim) or cache.k.shape[0] != spec.n_layers:
            raise InputError(
                f"KV cache shape {tuple(cache.k.shape)} does not match the engine "
                f"({spec.n_layers} layers, {spec.n_kv_heads} KV heads, "
                f"head dim {spec.head_dim})"
            )
        if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
            raise InputError("KV cache slabs must be contiguous to be bound by address")

    def _run(self, input_ids, position_ids, mask, cache: KVCache, hidden: torch.Tensor | None = None):
        if self.has_hidden_in and hidden is None:
            raise EngineError(f"{self.path.name} is an EAGLE-3 head engine: call forward_hidden")
        b, t = input_ids.shape
        p = cache.length
        spec = self.info.cache
        ctx = self.context
        stream = torch.cuda.current_stream(self.device)
        k = self.profile_for(b, t, p)

        with torch.cuda.device(self.device):
            if k != self._active_profile:
                if not ctx.set_optimization_profile_async(k, stream.cuda_stream):
                    raise EngineError(
                        f"cannot switch {self.path.name} to profile {k}: " + trt_errors(self.trt)
                    )
                self._active_profile = k
            # inputs on the device, in the engine's dtypes, contiguous (kept alive below)
            ids = input_ids.to(self.device, torch.int64).contiguous()
            pos = position_ids.to(self.device, torch.int64).contiguous()
            msk = mask.to(self.device, torch.bool).contiguous()
            keep = [ids, pos, msk]
            binds: list[tuple[str, tuple[int, ...] | None, int]] = [
                (C.INPUT_IDS, (b, t), ids.data_ptr()),
                (C.POSITION_IDS, (b, t), pos.data_ptr()),
                (C.ATTENTION_MASK, (b, t, p + t), msk.data_ptr()),
            ]
            binds += self._kv_binds(cache, b, t, p)
            if self.has_hidden_in:
                hid = hidden.to(self.device, self.dtypes[C.HIDDEN_IN]).contiguous()
                if tuple(hid.shape[:2]) != (b, t):
                    raise InputError(f"hidden states {tuple(hid.shape)} do not match input_ids {(b, t)}")
                keep.append(hid)
                binds.append((C.HIDDEN_IN, tuple(hid.shape), hid.data_ptr()))
            logits = self._logits_out(b, t)
            binds.append((C.LOGITS, None, logits.data_ptr()))

            self._set_bindings(binds)
            # output shapes follow from the inputs; check them against the buffers once bound
            kv_tail = (spec.n_kv_heads, spec.head_dim)
            for name, want in (("logits", (b, t, self.info.vocab_size)), ("new_key.0", (t, b) + kv_tail)):
                got = tuple(ctx.get_tensor_shape(name))
                if got != want:
                    raise EngineError(f"{self.path.name}: {name} would be {got}, expected {want}")
            extra = self._extra_outputs()
            if not ctx.execute_async_v3(stream.cuda_stream):
                raise EngineError(f"{self.path.name}: execute_async_v3 failed: " + trt_errors(self.trt))
            # the temporaries were allocated on this stream: the caching allocator will not
            # hand their memory out to other streams before this work is done
            del keep
        out = logits.float() if logits.dtype != torch.float32 else logits
        out = out.clone() if (self.clone_logits and out is logits) else out
        if C.HIDDEN_STATES in extra:
            extra[C.HIDDEN_STATES] = extra[C.HIDDEN_STATES].float()
        return out, extra

    def _kv_binds(self, cache: KVCache, b: int, t: int, p: int) -> list:
        """(name, input shape or None, address) of every layer's past [0, P) and new tail [P, P+T)."""
        spec = self.info.cache
        kv_tail = (spec.n_kv_heads, spec.head_dim)
        binds = []
        for i in range(spec.n_layers):
            for past_name, new_name, slab in (
                (C.past_key(i), C.new_key(i), cache.k),
                (C.past_value(i), C.new_value(i), cache.v),
            ):
                layer = slab[i]  # [S_max, B, Hkv, D], contiguous
                # P = 0: a zero-size input still needs a valid, non-null address
                past_ptr = layer.data_ptr() if p == 0 else layer[:p].data_ptr()
                binds.append((past_name, (p, b) + kv_tail, past_ptr))
                binds.append((new_name, None, layer[p : p + t].data_ptr()))
        return binds

    def _set_bindings(self, binds: list) -> None:
        """Input shapes and tensor addresses on the execution context (one line on a refusal)."""
        ctx = self.context
        for name, shape, ptr in binds:
            if shape is not None and not ctx.set_input_shape(name, shape):
                raise EngineError(
                    f"{self.path.name}: shape {shape} rejected for {name}: " + trt_errors(self.trt)
                )
            if not ctx.set_tensor_address(name, ptr):
                raise EngineError(f"{self.path.name}: cannot bind {name}: " + trt_errors(self.trt))

    def _extra_outputs(self) -> dict:
        """Every output needs an address: the extra ones get fresh buffers of their shapes."""
        ctx = self.context
        extra = {}
        for name in self.extra_outputs:
            buf = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=self.dtypes[name], device=self.device)
            if not ctx.set_tensor_address(name, buf.data_ptr()):
                raise EngineError(f"{self.path.name}: cannot bind {name}: " + trt_errors(self.trt))
            extra[name] = buf
        return extra


class TrtProjection(TrtEngine):
    """An EAGLE-3 head's projection engine (`draft_fc.engine` from `draft_fc.onnx`):
    target features [N, F] -> the head's hidden input [N, H], on the engine's CUDA device."""

    def _read_io(self) -> None:
        self.dtypes, self.feature_size, self.hidden_size, self.max_rows = read_projection_io(self.path, self._loaded)
        self.profiles = []
        self.info = EngineInfo(0, 0, CacheSpec(0, 0, 0), name=self.path.stem)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        self._check_open()
        n = int(features.shape[0])
        if features.dim() != 2 or features.shape[1] != self.feature_size:
            raise InputError(f"target features {tuple(features.shape)}: expected [N, {self.feature_size}]")
        if not 1 <= n <= self.max_rows:
            raise EngineError(
                f"{self.path.name} projects 1..{self.max_rows} rows per call, not {n}: rebuild with a "
                "larger --max-context"
            )
        ctx = self.context
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            x = features.to(self.device, self.dtypes[C.TARGET_FEATURES]).contiguous()
            out = torch.empty((n, self.hidden_size), dtype=self.dtypes[C.HIDDEN_STATES], device=self.device)
            ok = (
                ctx.set_input_shape(C.TARGET_FEATURES, tuple(x.shape))
                and ctx.set_tensor_address(C.TARGET_FEATURES, x.data_ptr())
                and ctx.set_tensor_address(C.HIDDEN_STATES, out.data_ptr())
                and ctx.execute_async_v3(stream.cuda_stream)
            )
            if not ok:
                raise EngineError(
                    f"{self.path.name}: the projection call failed: " + trt_errors(self.trt)
                )
            del x
        return out.float()

    def forward(self, *args, **kwargs):
        raise EngineError(f"{self.path.name} is a projection engine: call it with the target features")
