"""One draft call per tree level for a whole batch: a model draft with one B-row cache.

Role in one decode step: step 1 for batched decoding (runtime/batch_decode.py). Every sequence
builds its tree with its own level loop (runtime/drafts/tree_builder.py); the batch driver
collects one `DraftCall` from each sequence per level and `BatchedModelDraft.answer` runs them
as ONE engine call: row b carries sequence b's chain (its pending tokens and root) at the start,
or its frontier at a deeper level, padded to the batch's widest; padding rows see only
themselves. After the verify call each sequence's `commit` queues the gather that keeps its
chain and its accepted path's rows; the gathers of all rows run as one before the next call.

Cache: like the target's batch cache (runtime/kvcache.py "batched decoding"): rows share the
column space, row b's committed draft tokens are [0, len_b) and its mask hides the gap to the
longest row. A step's chain and scratch columns are common to all rows ([P, P+M) for the
chains, then one block per level); each row keeps which column holds which of its nodes.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..kvcache import KVCache, release_row, sized_cache
from ..tree_plan import causal_block, causal_prefill, padded_call
from ..trees import Tree, TreePolicy
from .base import DraftSource, topk_of, tree_capacity
from .tree_builder import DraftCall


class RowDraft(DraftSource):
    """One sequence's view of a BatchedModelDraft (what BatchDecoder gives the sequence)."""

    kind = "model"

    def __init__(self, batch: "BatchedModelDraft"):
        self.batch = batch
        self.vocab_size = batch.vocab_size
        self.row = -1
        self.length = 0  # committed draft tokens in its row
        self.pending: list[int] = []  # accepted tokens not yet run through the draft
        self.chain0 = self.chain = 0  # this step's chain columns [chain0, chain0 + chain)
        self.col = np.full(64, -1, dtype=np.int64)  # drafted node -> cache column

    @property
    def model_s(self) -> float:
        return self.batch.model_s

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        cap = tree_capacity(policy, self.vocab_size)
        if self.col.size < cap:
            self.col = np.full(cap, -1, dtype=np.int64)

    def reset(self, committed: list[int], features=None) -> None:
        self.batch.join(self, list(committed))

    def leave(self) -> None:
        self.batch.leave(self)

    def start(self, root: int) -> torch.Tensor:
        return self.batch.answer([(self, DraftCall("start", root))])[0]

    def expand(self, nodes, frontier) -> torch.Tensor:
        return self.batch.answer([(self, DraftCall("expand", nodes=nodes, frontier=frontier))])[0]

    def start_topk(self, root: int, k: int, logprobs: bool = False):
        return self.batch.answer([(self, DraftCall("start", root, k=k, logprobs=logprobs))])[0]

    def expand_topk(self, nodes, frontier, k: int, logprobs: bool = False):
        return self.batch.answer([(self, DraftCall("expand", nodes=nodes, frontier=frontier, k=k, logprobs=logprobs))])[
            0
        ]

    def commit(self, tree: Tree, path: torch.Tensor, features=None) -> None:
        self.batch.commit(self, tree, path)

    def defer(self, root: int, features=None) -> None:
        self.pending.append(int(root))  # run in this row's chain at the next start call


class BatchedModelDraft:
    """A contract draft engine shared by up to `max_batch` sequences, one cache row each."""

    def __init__(self, engine, max_batch: int):
        self.engine, self.max_batch = engine, max_batch
        self.vocab_size = engine.info.vocab_size
        self.rows: list[RowDraft] = []  # rows[i].row == i
        self.cache: KVCache | None = None
        self._scratch: KVCache | None = None
        self._row_views = engine.caps.row_views
        self._gather: list = []  # queued commits: (row, dst0, src positions)
        self.model_s = 0.0
        self.calls = 0

    def handle(self) -> RowDraft:
        return RowDraft(self)

    # ------------------------------------------------------------------ rows
    def _ensure(self, need: int) -> None:
        e = self.engine
        self.cache = sized_cache(self.cache, e.info.cache, need, self.max_batch, e.device, e.info.max_position + 64)

    @torch.inference_mode()
    def join(self, h: RowDraft, committed: list[int]) -> None:
        """Prefill a sequence's committed tokens alone, copy them into a free row."""
        self._flush()
        if h.row < 0:
            h.row = len(self.rows)
            self.rows.append(h)
        e = self.engine
        n = len(committed)
        if self._scratch is None or self._scratch.max_len < n + 1:
            self._scratch = KVCache(e.info.cache, max(n + 1, 64), 1, e.device)
        self._scratch.reset()
        if n:
            causal_prefill(e, committed, self._scratch)
        self._ensure(max(self.cache.length if self.cache else 0, n) + 1)
        self.cache.load_row(h.row, self._scratch, n)
        h.length, h.pending = n, []
        self.cache.length = max(r.length for r in self.rows)

    @torch.inference_mode()
    def leave(self, h: RowDraft) -> None:
        self._flush()
        if h.row >= 0:
            release_row(self.rows, h, self.cache)

    def commit(self, h: RowDraft, tree: Tree, path: torch.Tensor) -> None:
        """Queue the gather that keeps the row's chain and its accepted path's run nodes."""
        src = list(range(h.chain0, h.chain0 + h.chain))
        if path.numel():
            pth = path.numpy()
            cols = h.col[tree.origin.numpy()[pth]]
            ran = cols >= 0
            src += cols[ran].tolist()
            h.pending = tree.tokens.numpy()[pth[~ran]].tolist()  # leaves: run at the next start
        else:
            h.pending = []
        self._gather.append((h.row, h.length, src))
        h.length += len(src)
        h.chain = 0

    def _flush(self) -> None:
        if self.cache is not None:
            self.cache.commit_rows(self._gather)
            self.cache.length = max((r.length for r in self.rows), default=0)
        self._gather = []

    # ------------------------------------------------------------------ one call per level
    @torch.inference_mode()
    def answer(self, pairs: list[tuple[RowDraft, DraftCall]]) -> list:
        """Answer one DraftCall per sequence with one engine call per kind (all "start" at a
        step's first level, all "expand" later)."""
        out: list = [None] * len(pairs)
        for kind in ("start", "expand"):
            idx = [i for i, (_, c) in enumerate(pairs) if c.kind == kind]
            if idx:
                got = (self._start if kind == "start" else self._expand)([pairs[i] for i in idx])
                for i, g in zip(idx, got):
                    out[i] = g
        return out

    def _call(self, ids, pos, mask):
        dev = self.engine.device
        n_rows = ids.shape[0]
        view = self.cache.rows(n_rows) if n_rows != self.cache.batch else self.cache
        t0 = time.perf_counter()
        logits = self.engine.forward(ids.to(dev), pos.to(dev), mask.to(dev), view)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.model_s += time.perf_counter() - t0
        self.calls += 1
        return logits

    def _frame(self, t: int, p: int):
        """A padded call's ids / positions / mask over this cache's rows in use."""
        return padded_call(len(self.rows) if self._row_views else self.max_batch, t, p)

    @staticmethod
    def _reply(rows: torch.Tensor, call: DraftCall):
        """Logits rows ([V] for a start, [F, V] for a level) or their top-k ([1, k] / [F, k])."""
        if call.k is None:
            return rows
        return topk_of(rows if rows.dim() == 2 else rows[None], call.k, call.logprobs)

    def _start(self, pairs):
        self._flush()
        p = self.cache.length
        chains = [h.pending + [c.root] for h, c in pairs]
        m_max = max(len(ch) for ch in chains)
        self._ensure(p + m_max)
        ids, pos, mask = self._frame(m_max, p)
        for (h, _), ch in zip(pairs, chains):
            b, m = h.row, len(ch)
            ids[b, :m] = torch.tensor(ch)
            pos[b, :m] = torch.arange(h.length, h.length + m)
            pos[b, m:] = h.length
            mask[b, :, : h.length] = True
            mask[b, :m, p : p + m] = causal_block(m)
            h.chain0, h.chain = p, m
            h.col.fill(-1)
        logits = self._call(ids, pos, mask)
        self.cache.length = p + m_max
        return [self._reply(logits[h.row, len(ch) - 1], c) for (h, c), ch in zip(pairs, chains)]

    def _expand(self, pairs):
        q = self.cache.length
        frs = [c.frontier.numpy() for _, c in pairs]
        f_max = max(fr.size for fr in frs)
        self._ensure(q + f_max)
        ids, pos, mask = self._frame(f_max, q)
        for (h, c), fr in zip(pairs, frs):
            b, f = h.row, fr.size
            nodes = c.nodes
            root_pos = h.length + h.chain - 1
            ids[b, :f] = nodes.tokens[fr]
            pos[b, :f] = nodes.depth[fr] + root_pos
            pos[b, f:] = root_pos
            mask[b, :, : h.length] = True
            mask[b, :f, h.chain0 : h.chain0 + h.chain] = True
            n = nodes.tokens.numel()
            ran = np.nonzero(h.col[:n] >= 0)[0]
            if ran.size:  # the frontier's ancestors that were run at earlier levels
                block = torch.from_numpy(nodes.anc.numpy()[fr[:, None], ran])
                mask[b, :f, torch.from_numpy(h.col[ran])] = block
            h.col[fr] = np.arange(q, q + f)
        logits = self._call(ids, pos, mask)
        self.cache.length = q + f_max
        return [self._reply(logits[h.row, : fr.size], c) for (h, c), fr in zip(pairs, frs)]
