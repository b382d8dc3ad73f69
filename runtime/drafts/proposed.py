"""Trees a draft source proposes whole: its shape is its own, not the tree policy's level loop.

Role in one decode step: step 1. A source that knows a whole tree at once (the suffix draft,
runtime/drafts/suffix.py: as long as its match holds, as wide as its continuations differ) sets
`proposes` and answers `propose(root) -> Proposal` (parents, tokens, log-probs, level order).
The decoder runs such a source under `ProposingPolicy` (DraftSource.widen), which adds the
proposal's node budget to the policy's, so that the verify buffers, the cache's room and the
engine's token limit hold the largest tree it can propose. The tree builder
(runtime/drafts/tree_builder.py) then
  * alone (`--draft suffix`): verifies the proposal as the tree (`proposal_tree`);
  * mixed with a model draft (`--draft export+suffix`): builds the model's tree with the policy
    as usual, then `merge`s the proposal into it: the union of both trees' paths, a proposed
    node that hangs the same token off the same parent as a model node being that node, the
    model's nodes first and in their order (the model draft's own bookkeeping stays valid), the
    proposal's new nodes after them. `Tree.base` keeps the model's tree for its commit.
Proposed candidates are deterministic (no draw): the accept rule treats them as top-k
candidates (runtime/accept.py), so greedy output stays vanilla's and sampling stays lossless.
A model tree of sampled candidates is verified without the proposal (the sampled accept rule
reads every sibling's q).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..trees import Tree, TreePolicy


@dataclass
class Proposal:
    """A proposed tree in level order (a parent before its children): parents [n] (-1: the
    root), target token ids [n], cumulative log-probs [n] (numpy)."""

    parents: np.ndarray
    tokens: np.ndarray
    scores: np.ndarray

    @property
    def n(self) -> int:
        return int(self.tokens.size)

    def after(self, prefix: np.ndarray) -> "Proposal":
        """This proposal hung below a chain of `prefix` tokens from the root (the chain's nodes
        first, at score 0)."""
        k = int(prefix.size)
        par = np.concatenate([np.arange(-1, k - 1), np.where(self.parents >= 0, self.parents + k, k - 1)])
        scores = np.concatenate([np.zeros(k, dtype=np.float32), self.scores])
        return Proposal(par.astype(np.int64), np.concatenate([prefix.astype(np.int64), self.tokens]), scores)

    @staticmethod
    def empty() -> "Proposal":
        z = np.zeros(0, dtype=np.int64)
        return Proposal(z, z, np.zeros(0, dtype=np.float32))


class ProposingPolicy(TreePolicy):
    """`base` (the policy asked for) with room for `extra` proposed nodes; `alone`: the
    proposal is the whole tree (no model draft), so the base policy drafts nothing."""

    kind = "proposed"

    def __init__(self, base: TreePolicy, extra: int, alone: bool, name: str):
        self.base, self.extra, self.alone = base, int(extra), bool(alone)
        self.depth = self.extra if alone else max(base.depth, self.extra)  # the deepest tree it verifies
        self.candidates = base.candidates
        self.spec = name if alone else f"{base.spec}+{name}"

    @property
    def max_nodes(self) -> int:
        return self.extra if self.alone else self.base.max_nodes + self.extra


def unwrap(policy: TreePolicy) -> TreePolicy:
    """The policy a model draft follows (the one under a ProposingPolicy)."""
    return policy.base if isinstance(policy, ProposingPolicy) else policy


def _ancestors(parents: np.ndarray, n0: int, anc0: np.ndarray | None) -> np.ndarray:
    """anc [n, n] for parents [n] (level order), its first n0 rows given as anc0."""
    n = parents.size
    anc = np.zeros((n, n), dtype=bool)
    if n0:
        anc[:n0, :n0] = anc0
    for i in range(n0, n):
        p = parents[i]
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def proposal_tree(prop: Proposal) -> Tree:
    """A proposal verified as the whole tree (deterministic candidates, no draft call)."""
    par = prop.parents.astype(np.int64)
    depth = np.ones(prop.n, dtype=np.int64)
    for i in range(prop.n):
        if par[i] >= 0:
            depth[i] = depth[par[i]] + 1
    idx = torch.arange(prop.n)
    return Tree(
        torch.from_numpy(prop.tokens.astype(np.int64)),
        torch.from_numpy(par),
        torch.from_numpy(depth),
        torch.from_numpy(prop.scores.astype(np.float32)),
        torch.from_numpy(_ancestors(par, 0, None)),
        idx,
        torch.full((prop.n,), -1, dtype=torch.long),
    )


def _leaves(parents: np.ndarray) -> int:
    n = parents.size
    return n - np.unique(parents[parents >= 0]).size


def merge(base: Tree, prop: Proposal, paths: int | None = None, lead: int = 1) -> Tree:
    """The union of the model's tree `base` and a proposal (see the module docstring); `base`
    itself when the proposal adds no node. With `paths`: where the union would have more leaves
    than max(base's, paths), the proposal alone if it has >= `lead` nodes, else `base`.
    Tree.base of a new tree is the model's tree, Tree.base_kept how many of its nodes lead it."""
    if prop.n == 0 or base.candidates != "topk":
        return base
    tree = _union(base, prop)
    if paths is not None and tree is not base:
        if _leaves(tree.parents.numpy()) > max(_leaves(base.parents.numpy()), paths):
            if prop.n < lead:
                return base
            tree = proposal_tree(prop)
            tree.base, tree.base_kept, tree.draft_calls = base, 0, base.draft_calls
    return tree


def _union(base: Tree, prop: Proposal) -> Tree:
    """merge's union: the model's nodes first, the proposal's new nodes after them."""
    nb = base.n
    at = {(p, t): i for i, (p, t) in enumerate(zip(base.parents.tolist(), base.tokens.tolist()))}
    where = np.empty(prop.n, dtype=np.int64)  # proposal node -> merged node
    new_par: list[int] = []
    new_tok: list[int] = []
    new_score: list[float] = []
    bdepth = base.depth.tolist()
    new_depth: list[int] = []
    for j, (p, t) in enumerate(zip(prop.parents.tolist(), prop.tokens.tolist())):
        mp = int(where[p]) if p >= 0 else -1
        hit = at.get((mp, t)) if mp < nb else None
        if hit is not None:
            where[j] = hit
            continue
        where[j] = nb + len(new_tok)
        new_par.append(mp)
        new_tok.append(t)
        new_score.append(float(prop.scores[j]))
        new_depth.append(1 if mp < 0 else (bdepth[mp] if mp < nb else new_depth[mp - nb]) + 1)
    if not new_tok:
        return base
    m = len(new_tok)
    parents = np.concatenate([base.parents.numpy(), np.asarray(new_par, dtype=np.int64)])
    anc = _ancestors(parents, nb, base.anc.numpy())
    tree = Tree(
        torch.cat([base.tokens, torch.tensor(new_tok, dtype=torch.long)]),
        torch.from_numpy(parents),
        torch.cat([base.depth, torch.tensor(new_depth, dtype=torch.long)]),
        torch.cat([base.score.float(), torch.tensor(new_score, dtype=torch.float32)]),
        torch.from_numpy(anc),
        torch.cat([base.origin, torch.full((m,), -1, dtype=torch.long)]),
        torch.cat([base.qrow, torch.full((m,), -1, dtype=torch.long)]),
        base.q,
        base.candidates,
        base.draft_calls,
    )
    tree.base, tree.base_kept = base, nb
    return tree


def build_proposed(draft, policy: ProposingPolicy, root: int, base_builder):
    """The tree of a proposing draft under `policy` (a generator, as tree_builder's level loop):
    the proposal alone, or `base_builder(policy.base)`'s model tree merged with it (at most
    `draft.paths` leaves beyond the model's, a proposal of `draft.lead` nodes displacing it)."""
    if policy.alone:
        return proposal_tree(draft.propose(root))
    base = yield from base_builder(policy.base)
    tree = merge(base, draft.propose(root), draft.paths, draft.lead)
    if tree is base and base.n:  # nothing new at the root: extend the model's first path instead
        path = first_path(base)
        below = draft.propose_after(base.tokens[path].tolist())
        if below.n:
            tree = merge(base, below.after(base.tokens[path].numpy()))
    return tree


def first_path(tree: Tree) -> list[int]:
    """The node indices from the root down its first children (the model's top-ranked path)."""
    first: dict[int, int] = {}
    for i, p in enumerate(tree.parents.tolist()):
        first.setdefault(p, i)
    path, at = [], -1
    while at in first:
        at = first[at]
        path.append(at)
    return path
