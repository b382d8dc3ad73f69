"""How an OrtEngine's call is laid out before it runs (the runner's other half, beside
backends/onnxruntime.py): `_run` picks the path, each ends in the engine's plain `_call`.

- `_run_laid_out`: one call in row_layout's row-invariant layout (dummy rows, nodes at columns
  congruent to their positions), or `_run_paths`: one chain call per root-to-leaf path;
- `_run_rows`: a batch of one-token rows over their own prefixes, row by row;
- `_split_first_row`: a tree at P = 0 as the root alone, then the nodes (GroupQueryAttention
  treats a call with an empty cache as a causal prompt).

A mixin of OrtEngine: it reads the engine's `row_invariant`, `pads_row`, `tree_layout`, `info`,
`kv_layout` and `device`.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..kvcache import KVCache
from . import row_layout


def is_causal(mask: torch.Tensor) -> bool:
    """Whether a [B, T, T] mask (P = 0) is the causal one."""
    t = mask.shape[1]
    return bool(torch.equal(mask, torch.ones(t, t, dtype=torch.bool, device=mask.device).tril().expand_as(mask)))


class LaidOutCalls:
    """The layout paths of an OrtEngine's calls (see the module's docstring)."""

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
