"""TensorRT's loader half (Polygraphy's shape: a loader, then a runner): everything that turns a
serialized engine into an execution context and a checked signature, before any call runs.

Here: the import of `tensorrt` or `tensorrt_rtx` (`import_trt`, shared with the engine build),
the collecting logger (`trt_logger`), `load_engine` (the engines.json entry, the compatibility
checks, deserialisation, the execution context and TensorRT-RTX's runtime cache) and the engine's
I/O read against the contract (`read_io` -> `TrtGraph`; `read_projection_io` for an EAGLE-3
head's projection). The runners are `TrtEngine` / `TrtProjection` (backends/tensorrt.py).

Works with `tensorrt` (10.x/11.x) or `tensorrt_rtx`: the module recorded in the engine's
`engines.json` is used, else `tensorrt` when importable, else `tensorrt_rtx`
(`ARBORSPEC_TRT_MODULE` forces one). Importing this file needs neither.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import contract as C
from .. import settings
from ..errors import EngineError
from ..kvcache import CacheSpec
from .base import EngineInfo

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


def trt_errors(trt) -> str:
    """What TensorRT's logger collected since it was last asked, as one line."""
    return "; ".join(_Log.get(trt).take())


# ---------------------------------------------------------------------------- loading
@dataclass
class TrtLoaded:
    """A deserialized engine and its execution context (what the runner runs on): the module
    and its name, the engines.json entry (or None), TensorRT's runtime, the engine, the context
    and, on TensorRT-RTX, its runtime config and JIT kernel cache with the file it is kept in."""

    trt: Any
    flavour: str
    entry: dict | None
    runtime: Any = None
    engine: Any = None
    context: Any = None
    runtime_config: Any = None
    runtime_cache: Any = None
    runtime_cache_path: Path | None = None


def _gpu_cc(device: torch.device) -> str:
    return "%d.%d" % torch.cuda.get_device_capability(device)


def check_compatible(path: Path, entry: dict | None, flavour: str, device: torch.device) -> None:
    """An engine only runs on the GPU generation and the TensorRT module it was built for."""
    if not entry:
        return
    built_cc, gpu_cc = entry.get("compute_capability"), _gpu_cc(device)
    if built_cc and built_cc != gpu_cc:
        raise EngineError(
            f"{path.name} was built for compute capability {built_cc} but "
            f"{torch.cuda.get_device_name(device)} is {gpu_cc}: rebuild it with "
            f"`arborspec build --compute-capability {gpu_cc}` (or on this GPU)"
        )
    built = entry.get("trt", {})
    if built.get("module") and built["module"] != flavour:
        raise EngineError(
            f"{path.name} was built with {built['module']} but "
            f"{flavour} is loaded: use the same module "
            f"({_ENV_MODULE}={built['module']}) or rebuild"
        )


def _deserialize_error(path: Path, loaded: TrtLoaded, device: torch.device, errors: list[str]) -> str:
    e = loaded.entry or {}
    built = e.get("trt", {})
    what = (
        f"built with {built.get('module')} {built.get('version')} for compute capability "
        f"{e.get('compute_capability')}"
        if e
        else "no engines.json beside it"
    )
    return (
        f"cannot load TensorRT engine {path} ({what}) with {loaded.flavour} "
        f"{loaded.trt.__version__} on {torch.cuda.get_device_name(device)} "
        f"(compute capability {_gpu_cc(device)}): an engine only runs on the GPU "
        f"generation and TensorRT version it was built for; rebuild with `arborspec "
        f"build`. TensorRT said: " + ("; ".join(x.splitlines()[0] for x in errors) or "nothing")
    )


def load_engine(path: Path, device: torch.device, flavour: str | None = None) -> TrtLoaded:
    """Deserialize `path` on `device` with the module its engines.json names (`flavour` or
    ARBORSPEC_TRT_MODULE overrides) -> TrtLoaded, the execution context not made yet
    (`make_context`, once the runner has read the I/O)."""
    entry = manifest_entry(path)
    recorded = (entry or {}).get("trt", {}).get("module")
    trt, name = import_trt(flavour or settings.text(_ENV_MODULE) or recorded)
    loaded = TrtLoaded(trt, name, entry)
    check_compatible(path, entry, name, device)
    log = _Log.get(trt)
    log.take()
    loaded.runtime = trt.Runtime(log)
    loaded.engine = loaded.runtime.deserialize_cuda_engine(path.read_bytes())
    if loaded.engine is None:
        raise EngineError(_deserialize_error(path, loaded, device, log.take()))
    return loaded


def make_context(path: Path, loaded: TrtLoaded) -> None:
    """One execution context (profile switches are rare: prefill once, then decode); on
    TensorRT-RTX with the JIT kernel cache kept beside the engine read back into it."""
    eng = loaded.engine
    if loaded.flavour == "tensorrt_rtx" and hasattr(eng, "create_runtime_config"):
        rc = eng.create_runtime_config()
        cache_name = (loaded.entry or {}).get("cache", {}).get("file") or (path.name + ".runtime.cache")
        loaded.runtime_cache_path = path.with_name(cache_name)
        cache = rc.create_runtime_cache()
        if cache is not None:
            if loaded.runtime_cache_path.is_file():
                cache.deserialize(loaded.runtime_cache_path.read_bytes())
            rc.set_runtime_cache(cache)
            loaded.runtime_cache = cache
        loaded.runtime_config = rc
        loaded.context = eng.create_execution_context(rc)
    else:
        loaded.context = eng.create_execution_context()
    if loaded.context is None:
        raise EngineError(
            f"cannot create an execution context for {path.name} (out of GPU memory?): " + trt_errors(loaded.trt)
        )


# ---------------------------------------------------------------------------- the engine's I/O
@dataclass(frozen=True)
class TrtGraph:
    """What a contract engine is, from its I/O: tensor names and torch dtypes, the extras beyond
    the contract (an EAGLE-3 head's hidden input, outputs such as the features), the
    optimisation profiles' (min, max) of B, T, P and S = P + T, its EngineInfo and model config."""

    inputs: list
    outputs: list
    dtypes: dict
    has_hidden_in: bool
    extra_outputs: list
    profiles: list
    info: EngineInfo
    config: dict


def _io(trt, eng) -> tuple[list, list, list, dict]:
    """(all names, inputs, outputs, torch dtype of each)."""
    names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
    inputs = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    return names, inputs, outputs, {n: _torch_dtype(trt, eng.get_tensor_dtype(n)) for n in names}


def _contract_names(path: Path, names: list, inputs: list) -> tuple[int, list]:
    """(layers, the contract's names) of the engine; one line where one is missing."""
    n_layers = sum(1 for n in inputs if n.startswith("past_key."))
    need = ["input_ids", "position_ids", "attention_mask", "logits"]
    for i in range(n_layers):
        need += [f"past_key.{i}", f"past_value.{i}", f"new_key.{i}", f"new_value.{i}"]
    missing = [n for n in need if n not in names]
    if missing or n_layers == 0:
        raise EngineError(
            f"{path.name} does not follow the engine contract: missing {', '.join(missing) or 'past_key.0'}"
        )
    return n_layers, need


def _profiles(eng) -> list[dict[str, tuple[int, int]]]:
    """Profile ranges over (B, T, P) and S = P + T, from the engine itself (min, max)."""
    out = []
    for k in range(eng.num_optimization_profiles):
        ids = eng.get_tensor_profile_shape("input_ids", k)
        past = eng.get_tensor_profile_shape("past_key.0", k)
        mask = eng.get_tensor_profile_shape("attention_mask", k)
        out.append(
            {
                "B": (ids[0][0], ids[2][0]),
                "T": (ids[0][1], ids[2][1]),
                "P": (past[0][0], past[2][0]),
                "S": (mask[0][2], mask[2][2]),
            }
        )
    return out


def _model_config(entry: dict | None) -> dict:
    """The model config among the ONNX metadata engines.json recorded ({} without one)."""
    cfg = {}
    for v in (entry or {}).get("onnx_metadata", {}).values():
        try:
            obj = json.loads(v)
        except (TypeError, json.JSONDecodeError):
            continue
        if isinstance(obj, dict) and "max_position" in obj:
            cfg = obj
    return cfg


def read_io(path: Path, loaded: TrtLoaded) -> TrtGraph:
    """The engine's I/O checked against the contract (one line for what does not follow it)."""
    eng = loaded.engine
    names, inputs, outputs, dtypes = _io(loaded.trt, eng)
    n_layers, need = _contract_names(path, names, inputs)
    # beyond the contract: an EAGLE-3 head's hidden input; outputs such as the features /
    # the head's output hidden state (returned) and a draft's top-k (scratch)
    extra_in = [n for n in inputs if n not in need]
    has_hidden_in = extra_in == [C.HIDDEN_IN]
    if extra_in and not has_hidden_in:
        raise EngineError(f"{path.name}: inputs {extra_in} are not part of the engine contract")
    n_features = 0
    if C.HIDDEN_STATES in outputs:
        n_features = int(tuple(eng.get_tensor_shape(C.HIDDEN_STATES))[-1])
    kv_shape = tuple(eng.get_tensor_shape("past_key.0"))
    h_kv, d = kv_shape[2], kv_shape[3]
    vocab = tuple(eng.get_tensor_shape("logits"))[-1]
    if min(h_kv, d, vocab) < 1:
        raise EngineError(f"{path.name}: KV heads/head dim/vocab must be static (got {kv_shape}, vocab {vocab})")
    profiles = _profiles(eng)
    cfg = _model_config(loaded.entry)
    max_ctx = (loaded.entry or {}).get("limits", {}).get("max_context")
    max_pos = cfg.get("max_position") or max_ctx or max(p["P"][1] + 1 for p in profiles)
    info = EngineInfo(
        vocab_size=vocab,
        max_position=int(max_pos),
        cache=CacheSpec(n_layers, h_kv, d, dtypes["past_key.0"]),
        max_tokens=max(p["T"][1] for p in profiles),
        name=cfg.get("name", path.stem),
        n_features=max(n_features, 0),
    )
    extra_out = [n for n in outputs if n not in need]
    return TrtGraph(inputs, outputs, dtypes, has_hidden_in, extra_out, profiles, info, cfg)


def read_projection_io(path: Path, loaded: TrtLoaded) -> tuple[dict, int, int, int]:
    """An EAGLE-3 head's projection engine: target_features [N, F] -> hidden_states [N, H]
    -> (torch dtypes, F, H, the most rows N a call takes)."""
    eng = loaded.engine
    _, inputs, outputs, dtypes = _io(loaded.trt, eng)
    if inputs != [C.TARGET_FEATURES] or outputs != [C.HIDDEN_STATES]:
        raise EngineError(
            f"{path.name} is not an EAGLE-3 projection engine ({inputs} -> {outputs}, "
            f"expected [{C.TARGET_FEATURES}] -> [{C.HIDDEN_STATES}])"
        )
    feature_size = int(tuple(eng.get_tensor_shape(C.TARGET_FEATURES))[-1])
    hidden_size = int(tuple(eng.get_tensor_shape(C.HIDDEN_STATES))[-1])
    max_rows = int(eng.get_tensor_profile_shape(C.TARGET_FEATURES, 0)[2][0])
    return dtypes, feature_size, hidden_size, max_rows
