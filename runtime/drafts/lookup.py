"""Prompt-lookup (n-gram) draft source: candidates from the sequence itself, no model.

Role in one decode step: step 1. Proposes the tokens that followed earlier occurrences of the
current suffix in the sequence (prompt lookup decoding, Saxena 2023), as a tree: several
earlier continuations become sibling branches, ranked by how often they occurred. Step 5
(`commit`) appends the accepted tokens to its n-gram index.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InputError
from .base import DraftSource, NodeView, TopK, topk_of


class LookupDraft(DraftSource):
    """An index from each n-gram (n = min_ngram..max_ngram) of the committed tokens to the
    counts of the tokens that followed it, updated as tokens are committed. A node's
    distribution comes from the longest n-gram of its own context (the committed tokens + its
    tree path) found in the index; tokens never seen there get -inf, or, with a `fallback`
    draft (e.g. a BigramDraft), the fallback's log-probs shifted far below every lookup
    candidate."""

    kind = "lookup"
    finite_logits = False

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, fallback=None):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError("lookup draft needs 1 <= min_ngram <= max_ngram")
        self.vocab_size, self.max_n, self.min_n, self.fallback = vocab_size, max_ngram, min_ngram, fallback
        self.ctx: list[int] = []
        self.index: dict[tuple, dict[int, int]] = {}
        self._root: list[int] = []

    def _append(self, t: int) -> None:
        ctx = self.ctx
        j = len(ctx)
        for n in range(self.min_n, self.max_n + 1):
            if j >= n:
                nxt = self.index.setdefault(tuple(ctx[j - n :]), {})
                nxt[t] = nxt.get(t, 0) + 1
        ctx.append(t)

    def fork(self) -> "LookupDraft":
        fb = self.fallback.fork() if self.fallback is not None else None
        return LookupDraft(self.vocab_size, self.max_n, self.min_n, fb)

    def forget(self) -> None:
        if self.fallback is not None:
            self.fallback.forget()

    def reset(self, committed: list[int], features=None) -> None:
        self.ctx, self.index = [], {}
        for t in committed:
            self._append(int(t))
        if self.fallback is not None:
            self.fallback.reset(committed)

    def _rows(self, tails: list[list[int]]) -> torch.Tensor:
        out = torch.full((len(tails), self.vocab_size), float("-inf"))
        if self.fallback is not None:
            last = torch.tensor([t[-1] for t in tails])
            out = torch.log_softmax(self.fallback._rows(last), -1) - 1e4
        for r, tail in enumerate(tails):
            hit = self._hit(tail)
            if hit:
                toks = torch.tensor(list(hit.keys()))
                cnt = torch.tensor(list(hit.values()), dtype=torch.float32)
                out[r, toks] = torch.log(cnt / cnt.sum())
        return out

    def _hit(self, tail: list[int]) -> dict[int, int] | None:
        """Continuation counts of the longest n-gram suffix of `tail` found in the index."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            hit = self.index.get(tuple(tail[-n:]))
            if hit:
                return hit
        return None

    def _topk(self, tails: list[list[int]], k: int, logprobs: bool) -> TopK:
        """Top-k candidates straight from the counts (no vocabulary-wide row): values are
        log(count / total), missing entries -inf."""
        if self.fallback is not None:
            return topk_of(self._rows(tails), k, logprobs)
        vals = torch.full((len(tails), k), float("-inf"))
        idx = torch.zeros((len(tails), k), dtype=torch.long)
        for r, tail in enumerate(tails):
            hit = self._hit(tail)
            if hit:
                best = sorted(hit.items(), key=lambda kv: -kv[1])[:k]
                total = sum(hit.values())
                idx[r, : len(best)] = torch.tensor([t for t, _ in best])
                vals[r, : len(best)] = torch.log(torch.tensor([c / total for _, c in best]))
        return TopK(vals, idx)

    def _tails(self, nodes: NodeView, frontier: torch.Tensor) -> list[list[int]]:
        toks = nodes.tokens.tolist()
        anc = nodes.anc.numpy()
        return [
            (self._root + [toks[j] for j in np.flatnonzero(anc[f])])[-self.max_n :]  # level order
            for f in frontier.tolist()
        ]

    def _set_root(self, root: int) -> None:
        self._root = self.ctx[-(self.max_n - 1) :] + [int(root)] if self.max_n > 1 else [int(root)]

    def start(self, root: int) -> torch.Tensor:
        self._set_root(root)
        return self._rows([self._root])[0]

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        return self._rows(self._tails(nodes, frontier))

    def start_topk(self, root: int, k: int, logprobs: bool = False) -> TopK:
        self._set_root(root)
        return self._topk([self._root], k, logprobs)

    def expand_topk(self, nodes: NodeView, frontier: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
        return self._topk(self._tails(nodes, frontier), k, logprobs)

    def defer(self, root: int, features=None) -> None:
        self._append(int(root))

    def commit(self, tree, path: torch.Tensor, features=None) -> None:
        for t in [self._root[-1]] + (tree.tokens[path].tolist() if path.numel() else []):
            self._append(int(t))
