"""ONNX Runtime backend: runs an arborspec contract graph with IOBinding.

Role in one decoding step: every model call of the step (one draft call per tree level, the
target's single verify call, prefills) is `OrtEngine.forward`. The committed prefix
`cache.k[i, :P]` of each layer is bound as `past_key.{i}` by address, and the outputs
`new_key.{i}` / `new_value.{i}` are bound straight onto the cache tail `cache.k[i, P:P+T]`,
so ONNX Runtime reads and writes the runtime's KV slab in place (zero copy); logits are
written into a fresh float32 torch tensor that is returned. CPU EP by default; with
onnxruntime-gpu and a CUDA cache the same bindings use device_type "cuda" and the cache never
leaves the GPU.

Never imports onnx: the model's config is read from the session's metadata_props.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import contract as C
from .. import settings
from ..errors import DeviceError, EngineError, ExportDirError, InputError, MissingFileError, one_line
from ..kvcache import CacheSpec, KVCache, resolve_device
from . import row_layout
from .base import EngineBase, EngineCapabilities, EngineInfo, check_call

_ORT_TYPES = C.ORT_TYPES
_ELEM = C.ONNX_ELEM


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EngineError(
            "the onnxruntime backend needs `pip install onnxruntime` (or onnxruntime-gpu for CUDA)"
        ) from e
    return ort


def _is_causal(mask: torch.Tensor) -> bool:
    """Whether a [B, T, T] mask (P = 0) is the causal one."""
    t = mask.shape[1]
    return bool(torch.equal(mask, torch.ones(t, t, dtype=torch.bool, device=mask.device).tril().expand_as(mask)))


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
    _import_ort()
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


def _engine_device(device: str | torch.device) -> torch.device:
    dev = resolve_device(device)
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"onnxruntime backend supports cpu or cuda devices, not {device!r}")
    return dev


def _host_threads(load: OrtLoad) -> int | None:
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


def _check_runs_on(graph: OrtGraph, load: OrtLoad, path: Path) -> None:
    if load.cuda and graph.kv_layout == "bhsd" and graph.kv_dtype == torch.float32:
        # measured on an H200 (ONNX Runtime 1.31.1): the CUDA EP has no fp32 GroupQueryAttention,
        # the node falls back to the CPU, and the in-place cache it shares with its output
        # breaks there: wrong tokens, no error. Refuse rather than answer wrongly.
        raise ExportDirError(
            f"{path}: this GroupQueryAttention export keeps an fp32 KV cache, which ONNX Runtime's CUDA "
            "provider cannot run on the GPU (its kernel is fp16/bf16 only); re-export for CUDA with "
            "`arborspec export --attention onnx` (or `--kv-dtype fp16`)"
        )


# ---------------------------------------------------------------------------- the engine
class OrtEngine(EngineBase):
    """Engine protocol over an ONNX Runtime session of an arborspec contract graph."""

    def __init__(
        self,
        path: str | os.PathLike,
        providers: list | None = None,
        device: str | torch.device = "cpu",
        session_options=None,
        spinning: bool = False,
        row_invariant: bool | None = None,
    ):
        """spinning: with per-session thread pools only (`new_session_options`), let this
        session's threads spin-wait between runs (faster when no other session runs between its
        calls: vanilla and model-free drafts). row_invariant: run every call in the row-invariant
        layout (runtime/backends/row_layout.py; in-place "bhsd" graphs only): one-token calls
        padded to two rows, tree nodes at columns congruent to their positions, batches of
        one-token rows row by row; None: ARBORSPEC_ORT_ROW_LAYOUT=1."""
        ort = _import_ort()
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"{path}: no such ONNX file")
        self.device = _engine_device(device)
        load = OrtLoad(self.device, providers, session_options, spinning, row_invariant)
        host_threads = _host_threads(load)
        self.session, so = load_session(ort, path, load)
        # "shared": the process-wide pool every arborspec session runs on; "session": its own
        self.thread_pool = "session" if so.use_per_session_threads else "shared"
        self.path = path
        self.providers = self.session.get_providers()
        self._device_type = "cuda" if load.cuda else "cpu"
        self._device_id = (self.device.index or 0) if load.cuda else 0
        graph = read_graph(self.session, path)
        _check_runs_on(graph, load, path)
        self._take_graph(graph)
        # row_invariant: lay every call out so that a row's logits and K/V do not depend on the
        # call that carries it (row_layout.py; in-place graphs only); None: ARBORSPEC_ORT_ROW_LAYOUT=1
        self.row_invariant = (
            bool(row_layout_env() if row_invariant is None else row_invariant)
            and self.kv_layout == "bhsd"
            and not self.has_hidden_in
        )
        self.caps = self._capabilities(graph, host_threads)
        # how a tree is laid out: "auto" (row_layout.prefer_paths), "bands" (one padded call), "paths"
        self.tree_layout = "auto"
        self._logits_scratch: torch.Tensor | None = None
        # bhsd caches: the IOBinding with a cache's K/V slabs bound (in and out), per cache slab
        # address; a call rebinds only ids, positions, mask and outputs (`_binding`)
        self._bindings: dict = {}

    def _take_graph(self, graph: OrtGraph) -> None:
        """The graph's signature as the engine's attributes and EngineInfo."""
        cfg = graph.config
        self.metadata, self.config = graph.metadata, cfg
        self.input_names, self.output_names = graph.input_names, graph.output_names
        self.has_hidden_in = graph.has_hidden_in
        self.kv_dtype, self.kv_layout = graph.kv_dtype, graph.kv_layout
        # the graph pads a one-token call's attention with one dummy row (export/row_pad.py): one-token
        # calls need no padding row here, a batch of rows runs row by row, caches get a spare column
        self.pads_row = graph.metadata.get(C.META_PAD_ROW) == "1"
        self.info = EngineInfo(
            vocab_size=int(cfg["vocab_size"]),
            max_position=int(cfg["max_position"]),
            cache=CacheSpec(int(cfg["n_layers"]), int(cfg["n_kv_heads"]), int(cfg["head_dim"]), self.kv_dtype,
                            self.kv_layout, spare=int(self.pads_row)),
            name=cfg.get("name", "") or self.path.stem,
            n_features=graph.n_features,
        )

    def _capabilities(self, graph: OrtGraph, host_threads: int | None) -> EngineCapabilities:
        return EngineCapabilities(
            # GroupQueryAttention's CPU kernel rejects B > 1 with T > 1 after a prefix: batched
            # decoding verifies roots only (T = 1) while several sequences are active
            batched_trees=self.kv_layout != "bhsd",
            row_views=self.kv_layout == "bhsd",  # runs n rows of a larger batch cache (KVCache.rows)
            # one-token rows of a batch may each attend over their own length (C.META_RAGGED_ROWS)
            ragged_rows=graph.metadata.get(C.META_RAGGED_ROWS) == "1",
            max_topk=graph.max_topk,
            host_threads=host_threads,
            row_invariant=self.row_invariant,
        )

    # ------------------------------------------------------------------ checks
    def check_inputs(self, input_ids, position_ids, mask, cache: KVCache) -> None:
        """The contract's checks plus this graph's: dtypes, the cache's layout, devices."""
        self._check_open()
        check_call(self.info, input_ids, position_ids, mask, cache)
        if input_ids.dtype != torch.int64 or position_ids.dtype != torch.int64:
            raise InputError(f"input_ids/position_ids must be int64, got {input_ids.dtype}/{position_ids.dtype}")
        spec = self.info.cache
        if cache.k.dtype != self.kv_dtype or cache.v.dtype != self.kv_dtype:
            raise InputError(f"KV cache dtype {cache.k.dtype} != engine dtype {self.kv_dtype}")
        if self.kv_layout == "bhsd":
            exp, names = (
                (spec.n_layers, cache.batch, spec.n_kv_heads, cache.max_len + spec.spare, spec.head_dim),
                "[L, B, Hkv, S, D]",
            )
        else:
            exp, names = (
                (spec.n_layers, cache.max_len, cache.batch, spec.n_kv_heads, spec.head_dim),
                "[L, S, B, Hkv, D]",
            )
        if tuple(cache.k.shape) != exp or tuple(cache.v.shape) != exp:
            raise InputError(
                f"KV cache shape {tuple(cache.k.shape)} does not fit this engine (expected {names} = {exp})"
            )
        # bound by address: "bhsd" binds each layer's slab (a batch-row view of a larger cache
        # keeps those contiguous), "sbhd" binds prefixes of the whole slab
        dense = (cache.k[0], cache.v[0]) if self.kv_layout == "bhsd" and spec.n_layers else (cache.k, cache.v)
        if not all(t.is_contiguous() for t in dense):
            raise InputError("KV cache slabs must be contiguous (they are bound by address)")
        for name, t in (
            ("input_ids", input_ids),
            ("position_ids", position_ids),
            ("attention_mask", mask),
            ("KV cache", cache.k),
        ):
            if t.device.type != self._device_type:
                raise InputError(f"{name} is on {t.device}, this engine runs on {self.device}")

    # ------------------------------------------------------------------ call
    def _bind_in(self, io, name: str, t: torch.Tensor) -> None:
        io.bind_input(name, self._device_type, self._device_id, _ELEM[t.dtype], tuple(t.shape), t.data_ptr())

    def _bind_out(self, io, name: str, t: torch.Tensor) -> None:
        io.bind_output(name, self._device_type, self._device_id, _ELEM[t.dtype], tuple(t.shape), t.data_ptr())

    def forward_impl(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """See Engine.forward: writes new K/V onto cache[:, P:P+T] (cache.length unchanged)
        and returns logits float32 [B, T, V] on self.device."""
        return self._run(input_ids, position_ids, mask, cache, None)[0]

    def forward_features_impl(self, input_ids, position_ids, mask, cache: KVCache):
        """-> (logits [B, T, V], target features [B, T, F]) from a graph with the contract's
        `hidden_states` output (an EAGLE-3 draft's target); (logits, None) without one."""
        logits, _, _, feats = self._run(input_ids, position_ids, mask, cache, None)
        return logits, feats

    def forward_hidden(self, input_ids, hidden, position_ids, mask, cache: KVCache):
        """An EAGLE-3 head graph: rows pair tokens with hidden states [B, T, H] -> (logits over
        the draft vocabulary [B, T, Vd], the layer's output hidden states [B, T, H])."""
        if not self.has_hidden_in:
            raise EngineError(f"{self.path.name} is not an EAGLE-3 head graph (no {C.HIDDEN_IN} input)")
        self.check_inputs(input_ids, position_ids, mask, cache)
        logits, _, _, out = self._run(input_ids, position_ids, mask, cache, None, hidden)
        return logits, out

    def forward_topk_impl(self, input_ids, position_ids, mask, cache: KVCache, k: int, logprobs: bool = True):
        """A draft graph with fused top-k (caps.max_topk >= k): (log-probs [B, T, k], ids [B, T, k])
        straight from the graph; the vocabulary-wide logits go to a reused scratch buffer."""
        _, vals, ids, _ = self._run(input_ids, position_ids, mask, cache, k)
        return vals[..., :k], ids[..., :k]

    def _run(self, input_ids, position_ids, mask, cache: KVCache, k: int | None, hidden=None):
        """One call -> (logits, top-k values, top-k ids, features): on a row-invariant engine
        over a cache, in the row layout where it applies (`_run_laid_out`, `_run_rows`), else as
        it is (`_call`)."""
        b, t = input_ids.shape
        if cache.length > 0 and (self.row_invariant or self.pads_row):
            out = None
            if b == 1 and self.row_invariant:
                out = self._run_laid_out(input_ids, position_ids, mask, cache, k)
            elif b > 1 and t == 1:  # a padded graph's attention cannot take B > 1 rows of T + 1 either
                out = self._run_rows(input_ids, position_ids, mask, cache, k)
            if out is not None:
                return out
        return self._call(input_ids, position_ids, mask, cache, k, hidden)

    def _call(self, input_ids, position_ids, mask, cache: KVCache, k: int | None, hidden=None):
        """The call as it is: the inputs and the cache bound, one session run."""
        b, t = input_ids.shape
        p = cache.length
        if self.has_hidden_in:
            if hidden is None:
                raise EngineError(f"{self.path.name} is an EAGLE-3 head graph: call forward_hidden")
            hidden = hidden.to(device=self.device, dtype=torch.float32).contiguous()
            if tuple(hidden.shape[:2]) != (b, t):
                raise InputError(f"hidden states {tuple(hidden.shape)} do not match input_ids {tuple(input_ids.shape)}")
        if self.kv_layout == "bhsd" and p == 0 and t > 1 and not _is_causal(mask):
            return self._split_first_row(input_ids, position_ids, mask, cache, k, hidden)
        ids = input_ids.contiguous()
        pos = position_ids.contiguous()
        msk = mask.contiguous()
        io = self._binding(cache, p, t)
        self._bind_in(io, C.INPUT_IDS, ids)
        self._bind_in(io, C.POSITION_IDS, pos)
        self._bind_in(io, C.ATTENTION_MASK, msk)
        n_logits = b * t * self.info.vocab_size
        if k is None:
            logits = torch.empty((b, t, self.info.vocab_size), dtype=torch.float32, device=self.device)
        else:  # nobody reads these logits: a scratch buffer reused across calls
            if self._logits_scratch is None or self._logits_scratch.numel() < n_logits:
                self._logits_scratch = torch.empty(n_logits, dtype=torch.float32, device=self.device)
            logits = self._logits_scratch[:n_logits].view(b, t, self.info.vocab_size)
        self._bind_out(io, C.LOGITS, logits)
        vals = idx = None
        if self.caps.max_topk:
            kk = self.caps.max_topk
            vals = torch.empty((b, t, kk), dtype=torch.float32, device=self.device)
            idx = torch.empty((b, t, kk), dtype=torch.int64, device=self.device)
            self._bind_out(io, C.TOPK_LOGPROBS, vals)
            self._bind_out(io, C.TOPK_IDS, idx)
        if hidden is not None:
            self._bind_in(io, C.HIDDEN_IN, hidden)
        feats = None
        if self.info.n_features:
            feats = torch.empty((b, t, self.info.n_features), dtype=torch.float32, device=self.device)
            self._bind_out(io, C.HIDDEN_STATES, feats)
        if self._device_type == "cuda":
            # ORT runs on its own stream: torch's pending writes (ids, mask, cache commit)
            # must be done before ORT reads the buffers.
            torch.cuda.current_stream(self.device).synchronize()
            self.session.run_with_iobinding(io)
            io.synchronize_outputs()
        else:
            self.session.run_with_iobinding(io)
        # keep the bound tensors alive until the run has finished
        del ids, pos, msk, hidden
        return logits, vals, idx, feats

    def _run_laid_out(self, input_ids, position_ids, mask, cache: KVCache, k: int | None):
        """The call in row_layout's row-invariant layout (dummy rows where a node's column must
        match its position modulo 16; a one-row call gets a second row), or one chain call per
        root-to-leaf path when no such layout fits; None when the call needs no change."""
        p, t = cache.length, input_ids.shape[1]
        anc = row_layout.ancestors(mask, p)
        if not bool(mask[0, :, :p].all()):
            return None  # not over the whole cache (a cost probe, a ragged row): run it as it is
        if row_layout.is_chain(position_ids[0], anc, p):  # vanilla's one row, a chain's verify
            if t > 1 or self.pads_row:
                return None  # every row already sits where it commits (a padded graph pads a lone row itself)
            if p + 2 > self._columns(cache):
                return None  # the context's last column: no room for the padding row (vanilla's call too)
            rows = [0]
        else:
            par = row_layout.parents(anc)
            if par is None:
                return None  # not one tree: run it as it is
            rows = row_layout.slots(position_ids[0], anc, p, par)
        if (
            rows is None
            or p + max(max(rows) + 1, 2) > self._columns(cache)
            or self.tree_layout == "paths"
            or (self.tree_layout == "auto" and t > 1 and row_layout.prefer_paths(rows, anc))
        ):
            return self._run_paths(input_ids, position_ids, mask, cache, k, anc)
        ids, pos, m = row_layout.padded_call(input_ids, position_ids, mask, p, rows)
        out = self._call(ids, pos, m, cache, k)
        row_layout.move_kv(cache, p, rows)
        sel = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        return tuple(None if x is None else x.index_select(1, sel) for x in out)

    def _run_rows(self, input_ids, position_ids, mask, cache: KVCache, k: int | None):
        """A batch of one-token rows, each seeing a prefix [0, len_b] of its row (the ragged
        form), as one padded call per row: GroupQueryAttention cannot take B > 1 with T > 1 after
        a prefix, and a one-row call would take its one-row kernel (other logits than vanilla's
        padded calls). Rows that see only their own column P are padding (zero logits). None
        when a row has another form (the plain call then runs)."""
        b, p = input_ids.shape[0], cache.length
        seen = mask[:, 0, :]  # [B, P+1]
        last = torch.where(seen, torch.arange(p + 1, device=mask.device), -1).amax(1)  # [B]
        prefix = seen.sum(1) == last + 1
        padding = (last == p) & (seen.sum(1) == 1)
        if not bool((prefix | padding).all()):
            return None  # (each row's own call pads it, or runs it as one row at the context's last column)
        outs: list = [None] * 4
        for i in range(b):
            if bool(padding[i]):
                continue
            n = int(last[i])
            row = row_layout.row_view(cache, i, n)
            res = self._run(input_ids[i : i + 1], position_ids[i : i + 1], mask[i : i + 1, :, : n + 1], row, k)
            for j, x in enumerate(res):
                if x is not None:
                    if outs[j] is None:
                        outs[j] = x.new_zeros((b, *x.shape[1:]))
                    outs[j][i] = x[0]
        return tuple(outs)

    def _columns(self, cache: KVCache) -> int:
        """The columns a laid-out call may fill: the cache's, and no further than max_position
        (GroupQueryAttention's rotary cache ends there: past + rows beyond it is refused)."""
        return min(cache.max_len, self.info.max_position)

    def _run_paths(self, input_ids, position_ids, mask, cache: KVCache, k: int | None, anc):
        """A tree verified as chain calls, one per root-to-leaf path in depth-first order, each
        carrying only the nodes below where it leaves the previous path (whose K/V already sit
        at their committed columns): every node at the column it commits to, row-invariant at
        any P, one call per leaf. None when the paths do not start at position P."""
        p, t = cache.length, input_ids.shape[1]
        todo = row_layout.paths(anc)
        pos = position_ids[0]
        if any(pos[path].tolist() != list(range(p, p + len(path))) for path in todo):
            return None
        outs: list = [None] * 4
        kv = torch.empty((2, *cache.k.shape[:3], t, cache.k.shape[4]), dtype=cache.k.dtype, device=cache.k.device)
        prev: list = []
        try:
            for path in todo:
                b = next((i for i, (x, y) in enumerate(zip(path, prev)) if x != y), min(len(path), len(prev)))
                prev, new = path, path[b:]
                cache.length = p + b
                idx = torch.as_tensor(new, dtype=torch.long, device=self.device)
                m = torch.ones(1, len(new), p + b, dtype=torch.bool, device=mask.device)
                m = torch.cat([m, torch.ones(len(new), len(new), dtype=torch.bool, device=mask.device).tril()[None]], 2)
                call = row_layout.padded_call(input_ids[:, idx], position_ids[:, idx], m, p + b, list(range(len(new))))
                res = self._call(*call, cache, k)
                for i, x in enumerate(res):
                    if x is not None:
                        if outs[i] is None:
                            outs[i] = x.new_empty((x.shape[0], t, *x.shape[2:]))
                        outs[i][:, idx] = x[:, : len(new)]
                kv[0][..., idx, :] = cache.k[:, :, :, p + b : p + len(path)]
                kv[1][..., idx, :] = cache.v[:, :, :, p + b : p + len(path)]
        finally:
            cache.length = p
        cache.k[:, :, :, p : p + t] = kv[0]
        cache.v[:, :, :, p : p + t] = kv[1]
        return tuple(outs)

    def _binding(self, cache: KVCache, p: int, t: int):
        """An IOBinding with the cache bound. bhsd: each layer's whole slab is both input and
        output (the graph writes [P, P+T) in place), the same every call, so the binding is
        built once per cache and reused (binding 60 slabs costs 0.4 ms, 2 % of a SmolLM2 step on
        2 CPU cores; more of a GPU step); rebinding a name replaces it. sbhd: the dense prefix
        [0, P) in, the tail [P, P+T) out, bound every call."""
        n_layers = self.info.cache.n_layers
        if self.kv_layout == "bhsd":
            key = (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape), cache.k.dtype)
            io = self._bindings.get(key)
            if io is None:
                io = self.session.io_binding()
                for i in range(n_layers):
                    for name_in, name_out, slab in (
                        (C.past_key(i), C.new_key(i), cache.k[i]),
                        (C.past_value(i), C.new_value(i), cache.v[i]),
                    ):
                        self._bind_in(io, name_in, slab)
                        self._bind_out(io, name_out, slab)
                if len(self._bindings) >= 8:  # caches come and go (requests, forks): keep a few
                    self._bindings.pop(next(iter(self._bindings)))
                self._bindings[key] = io
            return io
        io = self.session.io_binding()
        for i in range(n_layers):
            # dense prefix [0, P) of the layer's slab (a zero-size tensor when P == 0)
            self._bind_in(io, C.past_key(i), cache.k[i, :p])
            self._bind_in(io, C.past_value(i), cache.v[i, :p])
            self._bind_out(io, C.new_key(i), cache.k[i, p : p + t])
            self._bind_out(io, C.new_value(i), cache.v[i, p : p + t])
        return io

    def _split_first_row(self, input_ids, position_ids, mask, cache: KVCache, k: int | None, hidden=None):
        """GroupQueryAttention treats a call with an empty cache as a causal prompt and ignores
        the attention bias there, so a tree verified at P = 0 (a one-token prompt) runs as two
        calls: the root alone, then the nodes over it. Exact: the first row of any valid mask at
        P = 0 sees only itself."""
        if bool(mask[:, 0, 1:].any()):
            raise InputError("the first row of a mask at P = 0 may see only itself")
        h0, h1 = (None, None) if hidden is None else (hidden[:, :1], hidden[:, 1:])
        first = self._run(input_ids[:, :1], position_ids[:, :1], mask[:, :1, :1], cache, k, h0)
        cache.length = 1
        try:
            rest = self._run(input_ids[:, 1:], position_ids[:, 1:], mask[:, 1:, :], cache, k, h1)
        finally:
            cache.length = 0
        return tuple(None if a is None else torch.cat([a, r], 1) for a, r in zip(first, rest))

    def __call__(self, input_ids, position_ids, mask, cache: KVCache) -> torch.Tensor:
        return self.forward(input_ids, position_ids, mask, cache)

    def close(self) -> None:
        """Release the ONNX Runtime session."""
        self.session = None
        super().close()

    def __repr__(self) -> str:
        return f"OrtEngine({str(self.path)!r}, providers={self.providers})"
