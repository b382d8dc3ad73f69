"""The model draft: any contract engine with the target's vocabulary (a smaller model, or a
`layers:K` truncated copy of the target), with its own preallocated cache.

Role in one decode step: step 1 (one engine call for the chain at `start`, one per level at
`expand`) and step 5 (`commit` keeps the chain and the accepted path's scratch rows).
`as_draft_source` wraps a bare engine into one.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import InputError
from ..kvcache import KVCache
from ..tree_plan import MaskBuffer, run_chain
from ..trees import Tree, TreePolicy
from .base import DraftSource, NodeView, TopK, scratch_mask, tree_capacity


class ModelDraft(DraftSource):
    """A neural draft behind the engine protocol, with its own preallocated cache.

    Cache layout: committed tokens [0, base), then this step's chain (the pending tokens and
    the root) [base, base + chain), then one scratch row per expanded node. Node -> scratch row
    bookkeeping lives here (`_slot`), keyed by the node's drafted index (`Tree.origin`)."""

    kind = "model"
    PREFILL_CHUNK = 512  # entries per call when the chain is long (the prompt at the first step)

    def __init__(self, engine, max_len: int | None = None):
        self.engine = engine
        self.vocab_size = engine.info.vocab_size
        self.cache = KVCache(engine.info.cache, max_len, 1, engine.device) if max_len else None
        self.mask = MaskBuffer(engine.device, 1 << 12)
        self._sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
        self.pending: list[int] = []
        self._base = 0  # committed length before this step's chain
        self._chain = 0  # tokens of the first call (pending + root)
        # node -> scratch row and scratch row -> node (numpy: tiny arrays, cheap ops)
        self._slot = np.full(64, -1, dtype=np.int64)
        self._slot_node = np.zeros(64, dtype=np.int64)
        self.model_s = 0.0
        self._owns_engine = True

    def fork(self) -> "ModelDraft":
        f = ModelDraft(self.engine)
        f._owns_engine = False
        return f

    def batch_driver(self, max_batch: int):
        """One draft call per level for the whole batch, where the engine batches trees."""
        if not self.engine.caps.batched_trees:
            return None
        from .batched import BatchedModelDraft

        return BatchedModelDraft(self.engine, max_batch)

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        cap = tree_capacity(policy, self.vocab_size)
        need = max_len + cap + 2
        if self.cache is None or self.cache.max_len < need:
            self.cache = KVCache(self.engine.info.cache, need, 1, self.engine.device)
        if self._slot.size < cap:
            self._slot = np.full(cap, -1, dtype=np.int64)
            self._slot_node = np.zeros(cap, dtype=np.int64)

    def reset(self, committed: list[int], features=None) -> None:
        if self.cache is None:
            raise RuntimeError("ModelDraft.prepare() must run before reset()")  # a caller bug
        self.cache.reset()
        self.pending = list(committed)

    def _forward(self, ids, pos, mask, k: int | None = None, logprobs: bool = False):
        t0 = time.perf_counter()
        if k is None:
            out = self.engine.forward(ids, pos, mask, self.cache)
        else:
            out = TopK(*self.engine.forward_topk(ids, pos, mask, self.cache, k, logprobs))
        if self._sync:
            self._sync()
        self.model_s += time.perf_counter() - t0
        return out

    def _start(self, root: int, k: int | None = None, logprobs: bool = False):
        """Run the pending tokens and the root as a causal chain (in chunks of PREFILL_CHUNK
        when it is long: the prompt); the root's row of the output."""
        chain = self.pending + [root]
        m = len(chain)
        c = self.cache
        p = c.length
        dev = self.engine.device

        def call(s, r, mask):
            ids = torch.tensor([chain[s : s + r]], dtype=torch.long, device=dev)
            pos = torch.arange(c.length, c.length + r, device=dev)[None]
            return self._forward(ids, pos, mask, k, logprobs)

        out = run_chain(call, self.mask, m, c, self.PREFILL_CHUNK)
        self._base, self._chain = p, m  # c.length is p + m
        self._slot.fill(-1)
        if k is None:
            return out[0, -1]
        return TopK(out.values[0, -1:], out.indices[0, -1:])

    def _expand(self, nodes: NodeView, frontier: torch.Tensor, k: int | None = None, logprobs: bool = False):
        f = int(frontier.numel())
        c = self.cache
        p = c.length
        dev = self.engine.device
        scratch0 = self._base + self._chain
        n_slots = p - scratch0
        fr = frontier.numpy()
        mask = scratch_mask(self.mask, nodes.anc, fr, self._slot_node, scratch0, p)
        ids = torch.from_numpy(nodes.tokens.numpy()[fr][None]).to(dev)
        pos = torch.from_numpy(nodes.depth.numpy()[fr][None] + (scratch0 - 1)).to(dev)
        out = self._forward(ids, pos, mask, k, logprobs)
        self.mask.release()
        self._slot[fr] = np.arange(n_slots, n_slots + f)
        self._slot_node[n_slots : n_slots + f] = fr
        c.length = p + f
        return out[0] if k is None else TopK(out.values[0], out.indices[0])

    def start(self, root: int) -> torch.Tensor:
        return self._start(root)

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        return self._expand(nodes, frontier)

    def _fused(self, k: int) -> bool:
        """Whether the engine returns its own top-k (fused in the graph, or on its device)."""
        return self.engine.caps.max_topk >= k

    def start_topk(self, root: int, k: int, logprobs: bool = False) -> TopK:
        if not self._fused(k):
            return super().start_topk(root, k, logprobs)
        return self._start(root, k, logprobs)

    def expand_topk(self, nodes: NodeView, frontier: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
        if not self._fused(k):
            return super().expand_topk(nodes, frontier, k, logprobs)
        return self._expand(nodes, frontier, k, logprobs)

    def defer(self, root: int, features=None) -> None:
        self.pending.append(int(root))  # run with the next start's chain

    def commit(self, tree: Tree, path: torch.Tensor, features=None) -> None:
        """Keep the chain and the accepted path's scratch rows; drop the rest."""
        c = self.cache
        c.length = self._base
        if path.numel():
            pth = path.numpy()
            slots = self._slot[tree.origin.numpy()[pth]]
            ran = slots >= 0
            src = list(range(self._chain)) + (slots[ran] + self._chain).tolist()
            # accepted nodes never run through the draft (leaves) are run at the next start
            self.pending = tree.tokens.numpy()[pth[~ran]].tolist()
        else:
            src, self.pending = list(range(self._chain)), []
        c.commit(src, 0)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close and self._owns_engine:
            close()
        self.cache = None


def as_draft_source(draft) -> DraftSource | None:
    """A draft source from a source (returned as is), an engine (wrapped in ModelDraft) or None."""
    if draft is None or (hasattr(draft, "start") and hasattr(draft, "expand")):
        return draft
    if hasattr(draft, "forward") and hasattr(draft, "info"):
        return ModelDraft(draft)
    raise InputError(f"not a draft source or engine: {type(draft).__name__}")
