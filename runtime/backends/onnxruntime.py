"""ONNX Runtime backend, the runner: `OrtEngine` runs an arborspec contract graph with IOBinding.

Role in one decoding step: every model call of the step (one draft call per tree level, the
target's single verify call, prefills) is `OrtEngine.forward`. The committed prefix
`cache.k[i, :P]` of each layer is bound as `past_key.{i}` by address, and the outputs
`new_key.{i}` / `new_value.{i}` are bound straight onto the cache tail `cache.k[i, P:P+T]`,
so ONNX Runtime reads and writes the runtime's KV slab in place (zero copy); logits are
written into a fresh float32 torch tensor that is returned. CPU EP by default; with
onnxruntime-gpu and a CUDA cache the same bindings use device_type "cuda" and the cache never
leaves the GPU.

The loader half (session, shared thread pool, session options, providers, the graph's
signature) is backends/ort_loader.py; how a call is laid out before it runs (the row-invariant
paths) is backends/ort_layouts.py. Never imports onnx.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import contract as C
from ..errors import EngineError, InputError, MissingFileError
from ..kvcache import KVCache
from .base import EngineBase, EngineCapabilities, check_call
from .ort_layouts import LaidOutCalls, is_causal
from .ort_loader import (  # noqa: F401 - enable_shared_pool, keep_session_pools: re-exported for tools/commands/cli.py
    OrtGraph,
    OrtLoad,
    check_runs_on,
    enable_shared_pool,
    engine_device,
    engine_host_threads,
    graph_info,
    import_ort,
    keep_session_pools,
    load_session,
    read_graph,
    row_layout_env,
)

_ELEM = C.ONNX_ELEM


class OrtEngine(LaidOutCalls, EngineBase):
    """Engine protocol over an ONNX Runtime session of an arborspec contract graph.

    path: the graph (`target.onnx`, `draft.onnx`, ...); device: "cpu" or a CUDA device (the
    KVCache must live there too). Keywords: providers (None: CUDA then CPU on a CUDA device,
    else CPU), session_options (None: `ort_loader.new_session_options`), spinning and
    row_invariant (below). The same signature as TrtEngine's: (path, device, *, options)."""

    def __init__(
        self,
        path: str | os.PathLike,
        device: str | torch.device = "cpu",
        *,
        providers: list | None = None,
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
        ort = import_ort()
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"{path}: no such ONNX file")
        self.device = engine_device(device)
        load = OrtLoad(self.device, providers, session_options, spinning, row_invariant)
        host_threads = engine_host_threads(load)
        self.session, so = load_session(ort, path, load)
        # "shared": the process-wide pool every arborspec session runs on; "session": its own
        self.thread_pool = "session" if so.use_per_session_threads else "shared"
        self.path = path
        self.providers = self.session.get_providers()
        self._device_type = "cuda" if load.cuda else "cpu"
        self._device_id = (self.device.index or 0) if load.cuda else 0
        graph = read_graph(self.session, path)
        check_runs_on(graph, load, path)
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
        self.metadata, self.config = graph.metadata, graph.config
        self.input_names, self.output_names = graph.input_names, graph.output_names
        self.has_hidden_in = graph.has_hidden_in
        self.kv_dtype, self.kv_layout = graph.kv_dtype, graph.kv_layout
        # the graph pads a one-token call's attention with one dummy row (export/row_pad.py): one-token
        # calls need no padding row here, a batch of rows runs row by row, caches get a spare column
        self.pads_row = graph.pads_row
        self.info = graph_info(graph, self.path)

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
        if self.kv_layout == "bhsd" and p == 0 and t > 1 and not is_causal(mask):
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

    def __call__(self, input_ids, position_ids, mask, cache: KVCache) -> torch.Tensor:
        return self.forward(input_ids, position_ids, mask, cache)

    def close(self) -> None:
        """Release the ONNX Runtime session."""
        self.session = None
        super().close()

    def __repr__(self) -> str:
        return f"OrtEngine({str(self.path)!r}, providers={self.providers})"
