"""ONNX Runtime's loader half (Polygraphy's shape: a loader, then a runner): everything that
turns an ONNX file into a checked InferenceSession, before any call runs.

Here: the import of onnxruntime, the process-wide shared intra-op thread pool
(`enable_shared_pool`, `shared_pool`, `keep_session_pools`, `pool_unchosen`), the SessionOptions
every session gets (`new_session_options`, `qdq_exact_matmul`), the providers
(`session_providers`), `load_session`, the graph's signature checked against the contract
(`read_graph` -> `OrtGraph`, `graph_info` -> EngineInfo) and `OrtLoad` (how an engine loads).
The runner is `OrtEngine` (backends/onnxruntime.py).

Never imports onnx: the model's config is read from the session's metadata_props.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import contract as C
from .. import settings
from ..errors import DeviceError, EngineError, ExportDirError, InputError, MissingFileError, one_line
from ..kvcache import CacheSpec, resolve_device
from .base import EngineInfo

_ORT_TYPES = C.ORT_TYPES


def import_ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EngineError(
            "the onnxruntime backend needs `pip install onnxruntime` (or onnxruntime-gpu for CUDA)"
        ) from e
    return ort


QDQ_ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"


def qdq_exact_matmul(so) -> None:
    """Keep QDQ exports exact: ONNX Runtime fuses DequantizeLinear + MatMul into MatMulNBits with
    accuracy level 4 (int8 activations) by default, which changes the logits (measured: 1e-2 on a
    tiny model, vs 4e-7 at level 0) and makes them depend on how many tokens a call carries, so a
    tree would no longer reproduce vanilla greedy decoding. Level 0 computes in float32;
    ARBORSPEC_ORT_QDQ_ACCURACY_LEVEL=4 trades that for speed."""
    so.add_session_config_entry(QDQ_ACCURACY_KEY, settings.text("ARBORSPEC_ORT_QDQ_ACCURACY_LEVEL"))


SHARED_POOL_ENV = "ARBORSPEC_ORT_SHARED_POOL"
_shared = False
_asked = False  # enable_shared_pool was called (the CLI's commands call it): a choice was made


def _pool_env() -> str:
    on = settings.switch(SHARED_POOL_ENV)  # "" unset, else "0" / "1"
    return "" if on is None else str(int(on))


def enable_shared_pool() -> bool:
    """Run every later arborspec session on one process-wide ONNX Runtime intra-op thread pool.
    Returns whether it is on.

    A decode step alternates sessions (the draft's level calls, the target's verify). With a
    pool per session, each pool's threads either spin-wait after a run (and steal the cores the
    other session needs next) or sleep (and every run pays the wake-up). One shared pool spins
    and is the pool the next session runs on: every configuration measured faster with it, the
    tokens the same (figures: benchmarks/history/measurements.md, "Figures moved out of
    docstrings").

    Process-wide and irreversible in ONNX Runtime: afterwards every session of the process must
    be created with `use_per_session_threads = False` (a default session, Polygraphy's or your
    own, fails), so the runtime never turns it on by itself: the `arborspec` command does for
    generate, bench, tune and serve; an application opts in with this call or
    ARBORSPEC_ORT_SHARED_POOL=1. ARBORSPEC_ORT_SHARED_POOL=0, or ARBORSPEC_ORT_SPINNING=0/1, keeps a
    pool per session."""
    global _shared, _asked
    _asked = True
    if _shared:
        return True
    if _pool_env() == "0" or settings.switch("ARBORSPEC_ORT_SPINNING") is not None:
        return False
    import_ort()
    try:
        from onnxruntime.capi import _pybind_state

        _pybind_state.set_global_thread_pool_sizes(0, 0)  # 0: ONNX Runtime's default size
    except Exception:  # pragma: no cover - an onnxruntime build without global pools
        return False
    _shared = True
    return True


def shared_pool() -> bool:
    """Whether new sessions run on the shared pool (`enable_shared_pool`)."""
    if not _shared and _pool_env() == "1":
        return enable_shared_pool()
    return _shared


def keep_session_pools() -> None:
    """Choose a pool per session (the default) knowingly: open_export no longer warns about it."""
    global _asked
    _asked = True


def pool_unchosen() -> bool:
    """Neither the shared pool nor a pool per session was chosen: no `enable_shared_pool` call and
    none of ARBORSPEC_ORT_SHARED_POOL / ARBORSPEC_ORT_SPINNING set (an application that never heard
    of them; open_export then warns where a model draft would pay for it)."""
    return not _asked and not _pool_env() and settings.switch("ARBORSPEC_ORT_SPINNING") is None


def new_session_options(ort, spinning: bool = False):
    """The SessionOptions of every session the runtime opens: the shared thread pool where it is
    on (`enable_shared_pool`), else a pool of its own that spin-waits only if `spinning`
    (ARBORSPEC_ORT_SPINNING=0/1 overrides); exact QDQ matmuls (`qdq_exact_matmul`)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if shared_pool():
        so.use_per_session_threads = False
    else:
        env = settings.switch("ARBORSPEC_ORT_SPINNING")
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if (spinning if env is None else env) else "0")
    qdq_exact_matmul(so)
    return so


ROW_LAYOUT_ENV = "ARBORSPEC_ORT_ROW_LAYOUT"


def row_layout_env() -> bool | None:
    """ARBORSPEC_ORT_ROW_LAYOUT: 1 lays every target call out row-invariantly (row_layout.py), 0
    never, unset (None) where the export needs it (int8 activations: export_dir.open_export)."""
    return settings.switch(ROW_LAYOUT_ENV)


def _int8_qdq(meta: dict) -> bool:
    """Whether the graph's metadata says it holds 8-bit QDQ weights (export/qdq.py)."""
    try:
        q = json.loads(meta.get(C.META_QUANTIZATION, "") or "{}")
    except ValueError:
        return False
    return q.get("format") == "qdq" and bool((q.get("layers_by_type") or {}).get("int8"))


# ---------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class OrtLoad:
    """How an OrtEngine loads its graph (its keyword arguments; Polygraphy's loader half, the
    engine is the runner): the device, the providers (None: CUDA then CPU on a CUDA device,
    else CPU), the session options (None: `new_session_options(spinning)`, 8-bit QDQ weights
    dequantised at load) and the row layout (None: ARBORSPEC_ORT_ROW_LAYOUT)."""

    device: torch.device
    providers: list | None = None
    session_options: Any = None
    spinning: bool = False
    row_invariant: bool | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def engine_device(device: str | torch.device) -> torch.device:
    dev = resolve_device(device)
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"onnxruntime backend supports cpu or cuda devices, not {device!r}")
    return dev


def engine_host_threads(load: OrtLoad) -> int | None:
    """torch threads for the decoder's host work while this engine runs (decode.host_threads):
    on CPU ONNX Runtime's pool owns the cores, so 1 (ARBORSPEC_HOST_THREADS overrides)."""
    env = settings.whole("ARBORSPEC_HOST_THREADS")
    return None if load.cuda else (1 if env is None else env)


def session_providers(ort, load: OrtLoad) -> list:
    """The providers asked for, or the default ones; a CUDA device on an onnxruntime without a
    CUDA provider is refused before loading (the CPU build would also print its own warning)."""
    if load.cuda and load.providers is None and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise DeviceError(
            f"CUDA was requested but this onnxruntime {ort.__version__} has no CUDA provider "
            f"({ort.get_available_providers()}): install onnxruntime-gpu with matching CUDA/cuDNN libraries"
        )
    if load.providers is not None:
        return load.providers
    if load.cuda:
        return [("CUDAExecutionProvider", {"device_id": load.device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def load_session(ort, path: Path, load: OrtLoad):
    """-> (InferenceSession, its SessionOptions). ONNX Runtime's load errors become one line;
    a CUDA device the session silently left for the CPU is refused."""
    providers = session_providers(ort, load)
    so = load.session_options if load.session_options is not None else new_session_options(ort, load.spinning)
    try:
        session = ort.InferenceSession(str(path), so, providers=providers)
        if load.session_options is None and _int8_qdq(session.get_modelmeta().custom_metadata_map):
            # 8-bit QDQ weights: ONNX Runtime's fused 8-bit MatMulNBits is slow with float
            # activations (measured, SmolLM2 int8: 293 ms per token vs 36 ms); dequantise them
            # once at load instead (exact, float32 weights in memory)
            so.add_session_config_entry("session.disable_quant_qdq", "1")
            session = ort.InferenceSession(str(path), so, providers=providers)
    except Exception as e:  # ORT raises its own exception types (Fail, InvalidGraph...)
        msg = one_line(e)
        if "external" in msg.lower() or "No such file" in msg or "open file" in msg.lower():
            raise MissingFileError(
                f"{path}: cannot load the model, an external-data file is missing or unreadable ({msg})"
            ) from None
        raise ExportDirError(f"{path}: ONNX Runtime cannot load the model: {msg}") from None
    active = session.get_providers()
    if load.cuda and "CUDAExecutionProvider" not in active:
        # onnxruntime-gpu silently falls back to CPU when CUDA libraries are missing
        raise DeviceError(
            f"CUDA was requested but ONNX Runtime runs on {active} "
            "(install onnxruntime-gpu with matching CUDA/cuDNN libraries)"
        )
    return session, so


@dataclass(frozen=True)
class OrtGraph:
    """What a loaded contract graph is, from its session: the metadata and config, the
    contract's input/output names, the optional extras (a draft's fused top-k up to `max_topk`,
    `n_features` target features, an EAGLE-3 head's hidden input) and its KV cache."""

    metadata: dict
    config: dict
    input_names: list
    output_names: list
    max_topk: int
    n_features: int
    has_hidden_in: bool
    kv_dtype: torch.dtype
    kv_layout: str

    @property
    def pads_row(self) -> bool:
        """The graph pads a one-token call's attention with one dummy row (export/row_pad.py)."""
        return self.metadata.get(C.META_PAD_ROW) == "1"


def read_graph(session, path: Path) -> OrtGraph:
    """The graph's signature checked against the contract (names, KV and logits types, the
    metadata's KV dtype)."""
    meta = session.get_modelmeta().custom_metadata_map
    cfg = C.check_metadata(meta, path)
    n = int(cfg["n_layers"])
    input_names, output_names = C.input_names(n), C.output_names(n)
    got_in = [x.name for x in session.get_inputs()]
    got_out = [x.name for x in session.get_outputs()]
    # optional outputs after the K/V ones: a draft graph's own top-k (contract TOPK_OUTPUTS,
    # K in the metadata), then the target features / an EAGLE-3 head's output hidden state
    # (HIDDEN_STATES); an EAGLE-3 head graph has one more input (HIDDEN_IN)
    extra_out = got_out[len(output_names) :]
    max_topk = 0
    if extra_out[:2] == list(C.TOPK_OUTPUTS) and C.META_TOPK in meta:
        max_topk = int(meta[C.META_TOPK])
        extra_out = extra_out[2:]
    n_features = 0
    if extra_out == [C.HIDDEN_STATES]:
        dims = session.get_outputs()[-1].shape
        n_features = int(dims[-1]) if isinstance(dims[-1], int) else 0
        extra_out = []
    extra_in = got_in[len(input_names) :]
    has_hidden_in = extra_in == [C.HIDDEN_IN]
    if has_hidden_in:
        extra_in = []
    if got_in[: len(input_names)] != input_names or extra_in or got_out[: len(output_names)] != output_names or extra_out:
        raise ExportDirError(
            f"{path}: graph inputs/outputs {got_in} -> {got_out} do not follow the contract for {n} layers"
        )
    kv_type = session.get_inputs()[3].type if n else "tensor(float)"
    if kv_type not in _ORT_TYPES:
        raise ExportDirError(f"{path}: unsupported KV element type {kv_type}")
    kv_dtype = _ORT_TYPES[kv_type]
    # the cache dtype is the graph's own input type (an fp32 graph may keep an fp16 cache:
    # `export --kv-dtype fp16`); the metadata, when present, must say the same
    declared = C.kv_dtype_name(meta, path)
    if declared is not None and C.DTYPES[declared] != kv_dtype:
        raise ExportDirError(
            f"{path}: metadata declares a {declared} KV cache but past_key.0 is {kv_type}: re-export the model"
        )
    logits_type = session.get_outputs()[0].type
    if logits_type != "tensor(float)":
        raise ExportDirError(f"{path}: logits are {logits_type}, the contract wants float32")
    return OrtGraph(dict(meta), cfg, input_names, output_names, max_topk, n_features, has_hidden_in, kv_dtype,
                    C.kv_layout(meta, path))


def check_runs_on(graph: OrtGraph, load: OrtLoad, path: Path) -> None:
    """Refuse a graph the chosen device would run wrongly."""
    if load.cuda and graph.kv_layout == "bhsd" and graph.kv_dtype == torch.float32:
        # measured on an H200 (ONNX Runtime 1.31.1): the CUDA EP has no fp32 GroupQueryAttention,
        # the node falls back to the CPU, and the in-place cache it shares with its output
        # breaks there: wrong tokens, no error. Refuse rather than answer wrongly.
        raise ExportDirError(
            f"{path}: this GroupQueryAttention export keeps an fp32 KV cache, which ONNX Runtime's CUDA "
            "provider cannot run on the GPU (its kernel is fp16/bf16 only); re-export for CUDA with "
            "`arborspec export --attention onnx` (or `--kv-dtype fp16`)"
        )


def graph_info(graph: OrtGraph, path: Path) -> EngineInfo:
    """The engine's EngineInfo from its graph's config (the file's stem names a nameless one)."""
    cfg = graph.config
    return EngineInfo(
        vocab_size=int(cfg["vocab_size"]),
        max_position=int(cfg["max_position"]),
        cache=CacheSpec(int(cfg["n_layers"]), int(cfg["n_kv_heads"]), int(cfg["head_dim"]), graph.kv_dtype,
                        graph.kv_layout, spare=int(graph.pads_row)),
        name=cfg.get("name", "") or path.stem,
        n_features=graph.n_features,
    )
