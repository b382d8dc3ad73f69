"""TensorRT backend: a serialized engine (from `arborspec build`) behind the Engine protocol.

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

Works with `tensorrt` (10.x/11.x) or `tensorrt_rtx`: the module recorded in the engine's
`engines.json` is used, else `tensorrt` when importable, else `tensorrt_rtx`
(`ARBORSPEC_TRT_MODULE` forces one). Importing this file needs neither; constructing a
TrtEngine needs one of them and a CUDA GPU.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .. import contract as C
from .. import settings
from ..errors import DeviceError, EngineError, InputError, MissingFileError
from ..fileio import atomic_write_bytes
from ..kvcache import CacheSpec, KVCache, resolve_device
from .base import EngineBase, EngineCapabilities, EngineInfo, check_call

_ENV_MODULE = "ARBORSPEC_TRT_MODULE"
_INSTALL_HINT = (
    "install TensorRT-RTX with `pip install tensorrt-rtx` (or `pip install "
    "'arborspec[trt]'`), or NVIDIA TensorRT (`tensorrt` 10.x/11.x) from NVIDIA's index"
)


FLAVOURS = ("tensorrt", "tensorrt_rtx")


def import_trt(flavour: str | None = None, need: str = "Runtime"):
    """(module, name) of TensorRT: `tensorrt`, else `tensorrt_rtx` (flavour or
    ARBORSPEC_TRT_MODULE forces one). The one place that imports it (build and run); `need`
    is an attribute the module must have (PyPI's stub packages import without bindings)."""
    env = settings.text(_ENV_MODULE)
    flavour = (flavour or env or "auto").replace("-", "_").lower()
    if flavour not in ("auto",) + FLAVOURS:
        raise EngineError(
            f"unknown TensorRT flavour {flavour!r} (expected auto, tensorrt or "
            f"tensorrt_rtx; set by flavour= or ${_ENV_MODULE})"
        )
    names = FLAVOURS if flavour == "auto" else (flavour,)
    errors = []
    for name in names:
        try:
            mod = importlib.import_module(name)
            if hasattr(mod, need):
                return mod, name
            errors.append(f"{name}: ImportError: {name} has no {need} (a stub package?)")
        except Exception as e:  # noqa: BLE001 - a broken install must not stop the fallback
            errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise EngineError(f"no usable TensorRT Python module ({'; '.join(errors)}); {_INSTALL_HINT}")


_import_trt = import_trt
manifest_entry = C.engine_entry  # the engines.json entry of one engine file, or None


def _torch_dtype(trt, dt) -> torch.dtype:
    name = str(dt).split(".")[-1]
    if name not in C.TRT_DTYPES:
        raise EngineError(f"TensorRT dtype {name} has no torch equivalent here")
    return C.TRT_DTYPES[name]


class _Log:
    """One collecting TensorRT logger per module (TensorRT keeps the first logger it is given),
    shared by the engine builder and the runtime: errors are kept so failures can say why;
    `echo` (a callable) also prints errors, and warnings when `verbose`."""

    _by_module: dict[str, Any] = {}

    @classmethod
    def get(cls, trt):
        key = trt.__name__
        if key not in cls._by_module:

            class Collect(trt.ILogger):
                def __init__(self):
                    trt.ILogger.__init__(self)
                    self.trt = trt
                    self.errors: list[str] = []
                    self.echo = None
                    self.verbose = False

                def log(self, severity, msg):
                    S = trt.ILogger.Severity
                    if severity in (S.INTERNAL_ERROR, S.ERROR):
                        self.errors.append(msg)
                        del self.errors[:-20]
                        if self.echo:
                            self.echo(f"[TensorRT] error: {msg}")
                    elif severity == S.WARNING and self.verbose and self.echo:
                        self.echo(f"[TensorRT] warning: {msg}")

                def take(self) -> list[str]:
                    e, self.errors = self.errors, []
                    return e

            cls._by_module[key] = Collect()
        return cls._by_module[key]


trt_logger = _Log.get


class TrtEngine(EngineBase):
    """Engine protocol over a TensorRT engine file.

    engine_path: a `.engine` written by `arborspec build` (engines.json beside it is read for
      the TensorRT module, compute capability and model limits; optional).
    device: the CUDA device the engine runs on; the KVCache must live there too.
    clone_logits: return a fresh logits tensor (default). False returns a view of the
      preallocated buffer, valid until this engine's next call.
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
        self.entry = manifest_entry(self.path)
        recorded = (self.entry or {}).get("trt", {}).get("module")
        trt, self.flavour = _import_trt(flavour or settings.text(_ENV_MODULE) or recorded)
        self.trt = trt
        self.clone_logits = clone_logits
        self._check_compatible()

        log = _Log.get(trt)
        log.take()
        with torch.cuda.device(self.device):
            self.runtime = trt.Runtime(log)
            self.engine = self.runtime.deserialize_cuda_engine(self.path.read_bytes())
            if self.engine is None:
                raise EngineError(self._deserialize_error(log.take()))
            self._read_io()
            self._make_context()
        self._active_profile = 0
        self._logits_buf: torch.Tensor | None = None

    # ------------------------------------------------------------------ set-up

    def _gpu_cc(self) -> str:
        return "%d.%d" % torch.cuda.get_device_capability(self.device)

    def _check_compatible(self) -> None:
        e = self.entry
        if not e:
            return
        built_cc, gpu_cc = e.get("compute_capability"), self._gpu_cc()
        if built_cc and built_cc != gpu_cc:
            raise EngineError(
                f"{self.path.name} was built for compute capability {built_cc} but "
                f"{torch.cuda.get_device_name(self.device)} is {gpu_cc}: rebuild it with "
                f"`arborspec build --compute-capability {gpu_cc}` (or on this GPU)"
            )
        built = e.get("trt", {})
        if built.get("module") and built["module"] != self.flavour:
            raise EngineError(
                f"{self.path.name} was built with {built['module']} but "
                f"{self.flavour} is loaded: use the same module "
                f"({_ENV_MODULE}={built['module']}) or rebuild"
            )

    def _deserialize_error(self, errors: list[str]) -> str:
        e = self.entry or {}
        built = e.get("trt", {})
        what = (
            f"built with {built.get('module')} {built.get('version')} for compute capability "
            f"{e.get('compute_capability')}"
            if e
            else "no engines.json beside it"
        )
        return (
            f"cannot load TensorRT engine {self.path} ({what}) with {self.flavour} "
            f"{self.trt.__version__} on {torch.cuda.get_device_name(self.device)} "
            f"(compute capability {self._gpu_cc()}): an engine only runs on the GPU "
            f"generation and TensorRT version it was built for; rebuild with `arborspec "
            f"build`. TensorRT said: " + ("; ".join(x.splitlines()[0] for x in errors) or "nothing")
        )

    def _read_io(self) -> None:
        trt, eng = self.trt, self.engine
        names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
        self.inputs = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: _torch_dtype(trt, eng.get_tensor_dtype(n)) for n in names}
        n_layers = sum(1 for n in self.inputs if n.startswith("past_key."))
        need = ["input_ids", "position_ids", "attention_mask", "logits"]
        for i in range(n_layers):
            need += [f"past_key.{i}", f"past_value.{i}", f"new_key.{i}", f"new_value.{i}"]
        missing = [n for n in need if n not in names]
        if missing or n_layers == 0:
            raise EngineError(
                f"{self.path.name} does not follow the engine contract: missing {', '.join(missing) or 'past_key.0'}"
            )
        # beyond the contract: an EAGLE-3 head's hidden input; outputs such as the features /
        # the head's output hidden state (returned) and a draft's top-k (scratch)
        extra_in = [n for n in self.inputs if n not in need]
        self.has_hidden_in = extra_in == [C.HIDDEN_IN]
        if extra_in and not self.has_hidden_in:
            raise EngineError(f"{self.path.name}: inputs {extra_in} are not part of the engine contract")
        self.extra_outputs = [n for n in self.outputs if n not in need]
        n_features = 0
        if C.HIDDEN_STATES in self.outputs:
            n_features = int(tuple(eng.get_tensor_shape(C.HIDDEN_STATES))[-1])
        kv_shape = tuple(eng.get_tensor_shape("past_key.0"))
        h_kv, d = kv_shape[2], kv_shape[3]
        vocab = tuple(eng.get_tensor_shape("logits"))[-1]
        if min(h_kv, d, vocab) < 1:
            raise EngineError(
                f"{self.path.name}: KV heads/head dim/vocab must be static (got {kv_shape}, vocab {vocab})"
            )
        # profile ranges over (B, T, P), from the engine itself (min, opt, max)
        self.profiles: list[dict[str, tuple[int, int]]] = []
        for k in range(eng.num_optimization_profiles):
            ids = eng.get_tensor_profile_shape("input_ids", k)
            past = eng.get_tensor_profile_shape("past_key.0", k)
            mask = eng.get_tensor_profile_shape("attention_mask", k)
            self.profiles.append(
                {
                    "B": (ids[0][0], ids[2][0]),
                    "T": (ids[0][1], ids[2][1]),
                    "P": (past[0][0], past[2][0]),
                    "S": (mask[0][2], mask[2][2]),
                }
            )
        self.max_batch = max(p["B"][1] for p in self.profiles)
        self.caps = EngineCapabilities(max_batch=self.max_batch)  # the profiles fix the largest B
        self.max_tokens = max(p["T"][1] for p in self.profiles)
        kv_dtype = self.dtypes["past_key.0"]
        cfg = {}
        meta = (self.entry or {}).get("onnx_metadata", {})
        for v in meta.values():
            try:
                obj = json.loads(v)
            except (TypeError, json.JSONDecodeError):
                continue
            if isinstance(obj, dict) and "max_position" in obj:
                cfg = obj
        max_ctx = (self.entry or {}).get("limits", {}).get("max_context")
        max_pos = cfg.get("max_position") or max_ctx or max(p["P"][1] + 1 for p in self.profiles)
        self.info = EngineInfo(
            vocab_size=vocab,
            max_position=int(max_pos),
            cache=CacheSpec(n_layers, h_kv, d, kv_dtype),
            max_tokens=self.max_tokens,
            name=cfg.get("name", self.path.stem),
            n_features=max(n_features, 0),
        )
        self.config = cfg

    def _make_context(self) -> None:
        """One execution context; profile switches are rare (prefill once, then decode)."""
        eng, trt = self.engine, self.trt
        self._runtime_cache = None
        self._runtime_cache_path = None
        if self.flavour == "tensorrt_rtx" and hasattr(eng, "create_runtime_config"):
            rc = eng.create_runtime_config()
            cache_name = (self.entry or {}).get("cache", {}).get("file") or (self.path.name + ".runtime.cache")
            self._runtime_cache_path = self.path.with_name(cache_name)
            cache = rc.create_runtime_cache()
            if cache is not None:
                if self._runtime_cache_path.is_file():
                    cache.deserialize(self._runtime_cache_path.read_bytes())
                rc.set_runtime_cache(cache)
                self._runtime_cache = cache
            self._runtime_config = rc
            self.context = eng.create_execution_context(rc)
        else:
            self.context = eng.create_execution_context()
        if self.context is None:
            raise EngineError(
                f"cannot create an execution context for {self.path.name} "
                "(out of GPU memory?): " + "; ".join(_Log.get(trt).take())
            )

    def save_runtime_cache(self) -> Path | None:
        """TensorRT-RTX: write the JIT kernel cache beside the engine (next load starts warm)."""
        if self._runtime_cache is None or self._runtime_cache_path is None:
            return None
        blob = self._runtime_cache.serialize()
        if blob is None:
            return None
        return atomic_write_bytes(self._runtime_cache_path, bytes(memoryview(blob)))

    def close(self) -> None:
        """Save the RTX runtime cache and release the context and engine."""
        if self.closed:
            return
        try:
            self.save_runtime_cache()
        finally:
            self.context = None
            self.engine = None
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
                        f"cannot switch {self.path.name} to profile {k}: " + "; ".join(_Log.get(self.trt).take())
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
                raise EngineError(f"{self.path.name}: execute_async_v3 failed: " + "; ".join(_Log.get(self.trt).take()))
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
                    f"{self.path.name}: shape {shape} rejected for {name}: " + "; ".join(_Log.get(self.trt).take())
                )
            if not ctx.set_tensor_address(name, ptr):
                raise EngineError(f"{self.path.name}: cannot bind {name}: " + "; ".join(_Log.get(self.trt).take()))

    def _extra_outputs(self) -> dict:
        """Every output needs an address: the extra ones get fresh buffers of their shapes."""
        ctx = self.context
        extra = {}
        for name in self.extra_outputs:
            buf = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=self.dtypes[name], device=self.device)
            if not ctx.set_tensor_address(name, buf.data_ptr()):
                raise EngineError(f"{self.path.name}: cannot bind {name}: " + "; ".join(_Log.get(self.trt).take()))
            extra[name] = buf
        return extra


class TrtProjection(TrtEngine):
    """An EAGLE-3 head's projection engine (`draft_fc.engine` from `draft_fc.onnx`):
    target features [N, F] -> the head's hidden input [N, H], on the engine's CUDA device."""

    def _read_io(self) -> None:
        trt, eng = self.trt, self.engine
        names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
        self.inputs = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if self.inputs != [C.TARGET_FEATURES] or self.outputs != [C.HIDDEN_STATES]:
            raise EngineError(
                f"{self.path.name} is not an EAGLE-3 projection engine ({self.inputs} -> {self.outputs}, "
                f"expected [{C.TARGET_FEATURES}] -> [{C.HIDDEN_STATES}])"
            )
        self.dtypes = {n: _torch_dtype(trt, eng.get_tensor_dtype(n)) for n in names}
        self.feature_size = int(tuple(eng.get_tensor_shape(C.TARGET_FEATURES))[-1])
        self.hidden_size = int(tuple(eng.get_tensor_shape(C.HIDDEN_STATES))[-1])
        shapes = eng.get_tensor_profile_shape(C.TARGET_FEATURES, 0)
        self.max_rows = int(shapes[2][0])
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
                    f"{self.path.name}: the projection call failed: " + "; ".join(_Log.get(self.trt).take())
                )
            del x
        return out.float()

    def forward(self, *args, **kwargs):
        raise EngineError(f"{self.path.name} is a projection engine: call it with the target features")
