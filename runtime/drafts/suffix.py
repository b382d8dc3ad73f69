"""The suffix draft: trees from where the text has gone before, as long as the match holds.

Role in one decode step: step 1 (`propose`: a whole tree, runtime/drafts/proposed.py) and step 5
(`commit`: the accepted tokens join its index). After SuffixDecoding (Oliaro et al. 2024,
arXiv 2411.04975): a suffix automaton over the request's prompt and output
(runtime/drafts/suffix_index.py) finds the longest suffix of the text that occurred before
(length L), and, with `mem`, one over earlier requests' outputs; the longer match wins. The
tokens that followed its earlier occurrences (at most 32, the most recent) make a trie whose
nodes carry the share of occurrences that continue that way (count / occurrences); the
proposal is its nodes with a share >= `prob`, the most shared first, at most min(nodes,
alpha x L) of them. So a long match repeated the same way becomes a long chain, occurrences
that part ways become branches, and a short or unsure match proposes a node or two, or none.

`SuffixDraft` alone (`--draft suffix`) verifies that tree; `SuffixMixDraft` (`--draft
export+suffix`) merges it into the model draft's own tree (proposed.merge). Memory of earlier
outputs is off unless asked (`mem=N` tokens); it is one per draft object and its forks, so in
`serve` it would be shared by every caller of the process: it stays off there by default.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..errors import InputError
from .base import DraftSource, ModelMixDraft
from .proposed import Proposal, ProposingPolicy, unwrap
from .spec import MIN_ALONE, MIN_MIXED, SuffixOptions
from .suffix_index import Matcher, SuffixAutomaton, SuffixMemory, walk

OCCURRENCES = 32  # earlier occurrences of the match whose continuations are read
REMATCH = 64  # tokens fed to a fresh memory matcher (matches longer than this are cut there)


def continuations(text: list[int], ends, depth: int, periodic: bool = False) -> list[list[int]]:
    """The (at most `depth`) tokens after each end position in `text`, cut at a separator
    (negative) or the text's end. periodic: `text` ends with the match itself, so a continuation
    that runs into it repeats with the period from its occurrence to the text's end (an
    overlapping copy: "a b a b" -> "a b ...")."""
    out = []
    for e in ends:
        e = int(e)
        row = text[e + 1 : e + 1 + depth]
        if periodic and len(row) < depth:
            row = (row * (depth // len(row) + 1))[:depth]
        if row and min(row) < 0:
            row = row[: next(i for i, t in enumerate(row) if t < 0)]
        out.append(row)
    return out


def grow(rows: list[list[int]], budget: int, min_prob: float, paths: int = 1) -> Proposal:
    """The trie of `rows` (level order), nodes whose share of rows is >= min_prob, on the `paths`
    best root-to-leaf paths (most shared leaf first, then the deepest), the `budget` most shared
    of them (ancestor-closed: a child is never more shared than its parent)."""
    m = len(rows)
    need = max(1, int(np.ceil(min_prob * m - 1e-9)))
    parents: list[int] = []
    tokens: list[int] = []
    counts: list[int] = []
    groups = {-1: range(m)}
    for d in range(budget):
        nxt: dict = {}
        for node, members in groups.items():
            by: dict = {}
            for r in members:
                if d < len(rows[r]):
                    by.setdefault(rows[r][d], []).append(r)
            for t, rs in by.items():
                if len(rs) >= need:
                    nxt[len(tokens)] = rs
                    parents.append(node)
                    tokens.append(t)
                    counts.append(len(rs))
        groups = nxt
        if not groups:
            break
    par, cnt = np.asarray(parents, dtype=np.int64), np.asarray(counts, dtype=np.float64)
    tok = np.asarray(tokens, dtype=np.int64)
    if tok.size <= budget and tok.size - len(set(parents) - {-1}) <= paths:  # nothing to cut
        return Proposal(par, tok, np.log(cnt / m).astype(np.float32))
    keep = _on_best_paths(par, cnt, paths)
    order = np.flatnonzero(keep)
    order = np.sort(order[np.lexsort((order, -cnt[order]))[:budget]])
    remap = np.full(tok.size, -1, dtype=np.int64)
    remap[order] = np.arange(order.size)
    par = np.where(par[order] >= 0, remap[np.maximum(par[order], 0)], -1)
    return Proposal(par, tok[order], np.log(cnt[order] / m).astype(np.float32))


def _on_best_paths(par: np.ndarray, cnt: np.ndarray, paths: int) -> np.ndarray:
    """bool [n]: the nodes on the `paths` best leaves' root paths (a leaf's rank: its count, then
    its depth)."""
    n = par.size
    depth = np.zeros(n, dtype=np.int64)
    has_kid = np.zeros(n, dtype=bool)
    for i in range(n):
        if par[i] >= 0:
            depth[i] = depth[par[i]] + 1
            has_kid[par[i]] = True
    leaves = np.flatnonzero(~has_kid)
    if leaves.size <= paths:
        return np.ones(n, dtype=bool)
    best = leaves[np.lexsort((-depth[leaves], -cnt[leaves]))[:paths]]
    keep = np.zeros(n, dtype=bool)
    for leaf in best.tolist():
        while leaf >= 0 and not keep[leaf]:
            keep[leaf] = True
            leaf = par[leaf]
    return keep


class SuffixDraft(DraftSource):
    """A draft with no model: each step proposes the tree of what followed the longest earlier
    match (module docstring). vocab_size: the target's; options: SuffixOptions; memory: a
    SuffixMemory shared with its forks (None: a new one of options.mem tokens, or none at 0)."""

    kind = "suffix"
    finite_logits = False
    proposes = True

    def __init__(self, vocab_size: int, options: SuffixOptions | None = None, memory: SuffixMemory | None = None):
        self.vocab_size, self.opts = vocab_size, options or SuffixOptions()
        if memory is None and self.opts.mem > 0:
            memory = SuffixMemory(self.opts.mem)
        self.memory = memory
        self.sam = SuffixAutomaton()
        self._start = 0  # where this request's output starts in sam.tokens
        self._remember = False  # whether the last request's output goes into the memory at reset
        self._matchers: list[Matcher] = []
        self._version = -1

    def widen(self, policy):
        return (
            policy if isinstance(policy, ProposingPolicy) else ProposingPolicy(policy, self.opts.nodes, True, "suffix")
        )

    def fork(self) -> "SuffixDraft":
        return SuffixDraft(self.vocab_size, self.opts, self.memory)

    def forget(self) -> None:
        """A cold request: earlier outputs are forgotten (and the last one is not remembered)."""
        self._remember = False
        if self.memory is not None:
            self.memory.clear()

    def reset(self, committed: list[int], features=None) -> None:
        if self.memory is not None and self._remember:
            self.memory.add(self.sam.tokens[self._start :])
        self.sam = SuffixAutomaton()
        self.sam.extend(committed)
        self._start, self._remember, self._version = len(committed) + 1, True, -1

    def _push(self, t: int) -> None:
        self.sam.append(t)
        for m in self._matchers:
            m.feed(t)

    def _sync_memory(self) -> None:
        """Matchers over the memory's generations, fed this text's last REMATCH tokens, whenever
        the memory changed."""
        mem = self.memory
        if mem is None or mem.version == self._version:
            return
        self._version = mem.version
        self._matchers = [Matcher(g) for g in mem.gens if len(g)]
        for t in self.sam.tokens[-REMATCH:]:
            for m in self._matchers:
                m.feed(t)

    def _match(self):
        """(automaton, state, match length, end bound) of the longest match: this text's own
        repeat, or a longer one in the memory."""
        state, length = self.sam.repeat()
        best = (self.sam, state, length, len(self.sam) - 1)  # the text's own end is no earlier occurrence
        for m in self._matchers:
            if m.length > best[2]:
                best = (m.sam, m.state, m.length, len(m.sam))
        return best

    def propose(self, root: int) -> Proposal:
        self._sync_memory()
        self._push(int(root))
        match = self._match()
        return self._grow(match, match[0].tokens if match[0] is self.sam else None, self.opts.nodes)

    def propose_after(self, tokens: list[int]) -> Proposal:
        """After `propose` in the same step: the proposal below the path `tokens` from the root
        (a model draft's guesses), as if they were committed; its nodes hang below the path."""
        if not tokens:
            return Proposal.empty()
        sam = self.sam
        state, length = sam.last, len(sam)
        for t in tokens:
            state, length = walk(sam, state, length, int(t))
        best = (sam, state, length, len(sam))
        for m in self._matchers:
            ms, ml = m.state, m.length
            for t in tokens:
                ms, ml = walk(m.sam, ms, ml, int(t))
            if ml > best[2]:
                best = (m.sam, ms, ml, len(m.sam))
        text = sam.tokens + [int(t) for t in tokens] if best[0] is sam else None
        return self._grow(best, text, self.opts.nodes - len(tokens))

    def _grow(self, match: tuple, text, nodes: int) -> Proposal:
        """The proposal from a match (automaton, state, length, ends before); text: the local
        text ending with the match (overlapping copies), None for the memory's; at most `nodes`."""
        sam, state, length, before = match
        o = self.opts
        budget = min(nodes, int(o.alpha * length)) if length >= (o.min or MIN_ALONE) else 0
        if budget < 1:
            return Proposal.empty()
        ends = sam.ends(state, before, OCCURRENCES)
        if not ends:
            return Proposal.empty()
        conts = continuations(sam.tokens if text is None else text, ends, budget, periodic=text is not None)
        return grow(conts, budget, o.prob, o.paths)

    def defer(self, root: int, features=None) -> None:
        self._sync_memory()
        self._push(int(root))

    def commit(self, tree, path: torch.Tensor, features=None) -> None:
        for t in tree.tokens[path].tolist() if path.numel() else []:
            self._push(int(t))


class SuffixMixDraft(ModelMixDraft):
    """`base` (a model DraftSource) drafting its tree under the policy, with the suffix draft's
    proposal merged into it every step (proposed.merge)."""

    proposes = True

    def __init__(self, base: DraftSource, suffix: SuffixDraft):
        if not base.finite_logits or getattr(base, "proposes", False):
            raise InputError(f"draft {base.kind} cannot be mixed with suffix: it is a table draft itself")
        if suffix.opts.min is None:  # mixed, a match shorter than MIN_MIXED adds rows the model covers
            suffix = SuffixDraft(suffix.vocab_size, dataclasses.replace(suffix.opts, min=MIN_MIXED), suffix.memory)
        self.base, self.suffix = base, suffix
        self.kind = f"{base.kind}+suffix"
        self.vocab_size, self.token_map = base.vocab_size, base.token_map
        self.needs_target_features = base.needs_target_features
        self.sample_scale = base.sample_scale
        self.paths, self.lead = suffix.opts.paths, suffix.opts.lead  # how merge treats disagreement

    def widen(self, policy):
        if isinstance(policy, ProposingPolicy):
            return policy
        return ProposingPolicy(policy, self.suffix.opts.nodes, False, "suffix")

    def fork(self) -> "SuffixMixDraft":
        return SuffixMixDraft(self.base.fork(), self.suffix.fork())

    def prepare(self, policy, max_len: int) -> None:
        self.base.prepare(unwrap(policy), max_len)

    def forget(self) -> None:
        self.base.forget()
        self.suffix.forget()

    def reset(self, committed: list[int], features=None) -> None:
        self.base.reset(committed, features)
        self.suffix.reset(committed)

    def close(self) -> None:
        self.base.close()

    # the model's tree: every draft call is the base's
    def start(self, root):
        return self.base.start(root)

    def expand(self, nodes, frontier):
        return self.base.expand(nodes, frontier)

    def start_topk(self, root, k, logprobs=False):
        return self.base.start_topk(root, k, logprobs)

    def expand_topk(self, nodes, frontier, k, logprobs=False):
        return self.base.expand_topk(nodes, frontier, k, logprobs)

    def propose(self, root: int) -> Proposal:
        return self.suffix.propose(root)

    def propose_after(self, tokens: list[int]) -> Proposal:
        return self.suffix.propose_after(tokens)

    def defer(self, root: int, features=None) -> None:
        self.base.defer(root, features)
        self.suffix.defer(root)

    def commit(self, tree, path: torch.Tensor, features=None) -> None:
        """The suffix index takes the path; the model its part inside its own tree (`commit`),
        then the proposed nodes after it, each as a committed token with its verify row's
        features (`defer`, as a grammar's forced tokens)."""
        self.suffix.commit(tree, path)
        base = tree.base
        if base is None:
            self.base.commit(tree, path, features)
            return
        nb = tree.base_kept
        k = int((path < nb).sum())  # the model's nodes come first on any path
        self.base.commit(base, path[:k], features[: nb + 1] if features is not None else None)
        for i in path[k:].tolist():
            self.base.defer(int(tree.tokens[i]), features[i + 1 : i + 2] if features is not None else None)
