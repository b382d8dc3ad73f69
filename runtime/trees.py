"""Tree policies and the drafted tree: which candidates to draft, kept as flat tensors.

Role in one decoding step: steps 1 and 2. A policy decides, level by level, which of each
frontier node's candidate children enter the tree and which new nodes are expanded at the
next level (one draft call per level over that frontier); `Tree` holds the result as flat
tensors in level order (parent index < child index) with the ancestor matrix maintained
incrementally; runtime/tree_plan.write_tree turns it into the target's input ids, position
ids (past_len + depth: siblings share a position) and tree attention mask with tensor ops.

Spec strings (CLI `--tree`):
  chain:K          classic speculative decoding, K drafted tokens
  full:D,W         every node gets its top-W children, depth D (the NanoGPT write-up)
  beam:4,16,16     per level, the global top-n children of the whole frontier by cumulative
                   draft log-prob (LongSpec's beam tree)
  dynamic:K,D,N    EAGLE-2: expand the top-K nodes of each level by cumulative log-prob,
                   K children each, D levels, then keep the best N nodes overall;
  dynamic:K,D,N,P  the same, keeping only nodes whose cumulative draft probability is >= P
                   (0 < P < 1): the tree is as large as the draft is sure, step by step
  static:FILE.json explicit paths of child ranks, Medusa style: [[0],[1],[0,0],[0,1],...]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from .errors import MissingFileError, TreeSpecError

CANDIDATE_MODES = ("topk", "sample", "sample-unique")  # how draft children are made when sampling

# ----------------------------------------------------------------------------- policies


class TreePolicy:
    """Base: a fixed-depth expansion. Subclasses say how many candidates each frontier node
    offers per level (`width`), which ones are kept (`select`) and what is expanded next."""

    kind = "base"
    depth: int
    data_dependent = False  # True when selection depends on draft scores (beam, dynamic)
    candidates: str | None = None  # sampled candidates a tuned tree file chose (`tune --temperature`)

    def width(self, level: int) -> int:
        raise NotImplementedError

    # Selection works on small numpy arrays (the tree's bookkeeping, not the vocabulary): a
    # numpy op costs about a tenth of a torch op on tensors this size.
    def select(self, level: int, scores: np.ndarray) -> np.ndarray:
        """scores [F, k] cumulative log-probs of the candidates -> bool keep mask [F, k]."""
        return np.ones(scores.shape, dtype=bool)

    def expand(self, level: int, scores: np.ndarray) -> np.ndarray:
        """scores [n] of the nodes just added at `level` -> bool mask of nodes to expand."""
        return np.ones(scores.shape, dtype=bool)

    def finalize(self, scores: np.ndarray, depth: np.ndarray) -> np.ndarray | None:
        """Optional final pruning: bool keep mask over all nodes (must be ancestor-closed)."""
        return None

    @property
    def max_nodes(self) -> int:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.spec

    spec: str = ""


class FullTree(TreePolicy):
    kind = "full"

    def __init__(self, depth: int, width: int, spec: str = ""):
        if depth < 1 or width < 1:
            raise TreeSpecError("full:D,W needs D >= 1 and W >= 1")
        self.depth, self.w, self.spec = depth, width, spec or f"full:{depth},{width}"

    def width(self, level):
        return self.w

    @property
    def max_nodes(self):
        return sum(self.w**l for l in range(1, self.depth + 1))


class ChainTree(FullTree):
    kind = "chain"

    def __init__(self, k: int, spec: str = ""):
        if k < 1:
            raise TreeSpecError("chain:K needs K >= 1")
        super().__init__(k, 1, spec or f"chain:{k}")


class BeamTree(TreePolicy):
    kind = "beam"
    data_dependent = True

    def __init__(self, widths: list[int], spec: str = ""):
        if not widths or min(widths) < 1:
            raise TreeSpecError("beam:n1,n2,... needs at least one level, each n >= 1")
        self.widths, self.depth = list(widths), len(widths)
        self.spec = spec or "beam:" + ",".join(map(str, widths))

    def width(self, level):
        return self.widths[level - 1]

    def select(self, level, scores):
        return _top_mask(scores.ravel(), self.widths[level - 1]).reshape(scores.shape)

    @property
    def max_nodes(self):
        return sum(self.widths)


class DynamicTree(TreePolicy):
    kind = "dynamic"
    data_dependent = True

    def __init__(self, k: int, depth: int, budget: int, spec: str = "", min_prob: float | None = None):
        if k < 1 or depth < 1 or budget < 1:
            raise TreeSpecError("dynamic:K,D,N needs K, D, N >= 1")
        if min_prob is not None and not 0.0 < min_prob < 1.0:
            raise TreeSpecError(f"dynamic:K,D,N,P needs 0 < P < 1, got {min_prob}")
        self.k, self.depth, self.budget = k, depth, budget
        self.min_logp = float(np.log(min_prob)) if min_prob is not None else None
        tail = f",{min_prob:g}" if min_prob is not None else ""
        self.spec = spec or f"dynamic:{k},{depth},{budget}{tail}"

    def width(self, level):
        return self.k

    def select(self, level, scores):
        if self.min_logp is None:
            return np.ones(scores.shape, dtype=bool)
        return scores >= self.min_logp

    def expand(self, level, scores):
        return _top_mask(scores, self.k)

    def finalize(self, scores, depth):
        if scores.size <= self.budget:
            return None
        # rank by score, ties broken towards shallower nodes: a child never outranks its parent
        # (cumulative log-probs only decrease along a path), so the top N is ancestor-closed
        return _top_mask(scores.astype(np.float64) - depth.astype(np.float64) * 1e-9, self.budget)

    @property
    def max_nodes(self):
        return self.budget


class StaticTree(TreePolicy):
    kind = "static"

    def __init__(self, paths: list[list[int]], spec: str = "", candidates: str | None = None):
        if candidates is not None and candidates not in CANDIDATE_MODES:
            raise TreeSpecError(f"static tree: unknown candidates {candidates!r} ({', '.join(CANDIDATE_MODES)})")
        self.candidates = candidates
        seen = set()
        for p in paths:
            if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
                raise TreeSpecError(f"static tree: each path must be a non-empty list of ranks >= 0, got {p!r}")
            seen.add(tuple(p))
        for p in seen:
            if len(p) > 1 and p[:-1] not in seen:
                raise TreeSpecError(f"static tree: path {list(p)} has no parent path {list(p[:-1])}")
        if not seen:
            raise TreeSpecError("static tree: no paths")
        self.paths = sorted(seen, key=lambda p: (len(p), p))
        self.depth = max(len(p) for p in self.paths)
        self.spec = spec or "static"
        # the structure is fixed: precompute, per level, the frontier (as rank paths in the
        # order nodes are added) and the keep mask over [F, width]
        self._levels = []
        frontier = [()]
        for level in range(1, self.depth + 1):
            kids = [p for p in self.paths if len(p) == level]
            w = max(p[-1] for p in kids) + 1
            keep = np.zeros((len(frontier), w), dtype=bool)
            index = {f: i for i, f in enumerate(frontier)}
            for p in kids:
                keep[index[p[:-1]], p[-1]] = True
            added = [frontier[i] + (int(r),) for i, r in zip(*np.nonzero(keep))]
            parents = {p[:-1] for p in self.paths if len(p) == level + 1}
            expand = np.array([a in parents for a in added], dtype=bool)
            self._levels.append((w, keep, expand))
            frontier = [a for a, e in zip(added, expand) if e]

    def width(self, level):
        return self._levels[level - 1][0]

    def select(self, level, scores):
        return self._levels[level - 1][1]

    def expand(self, level, scores):
        return self._levels[level - 1][2]

    @property
    def max_nodes(self):
        return len(self.paths)


def _top_mask(x: np.ndarray, n: int) -> np.ndarray:
    """bool mask of the n largest entries of a 1-D array (all of them when n >= size)."""
    keep = np.zeros(x.shape, dtype=bool)
    if n >= x.size:
        keep[:] = True
    elif n > 0:
        keep[np.argpartition(-x, n - 1)[:n]] = True
    return keep


def _ints(text: str, spec: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise TreeSpecError(f"malformed tree spec {spec!r}: expected integers after ':'") from None
    return vals


def parse_tree_spec(spec: str, base_dir: str | None = None) -> TreePolicy:
    """Parse a `--tree` spec string (see the module docstring) into a policy."""
    if not isinstance(spec, str) or ":" not in spec:
        raise TreeSpecError(
            f"malformed tree spec {spec!r}: expected chain:K, full:D,W, beam:n1,n2,..., "
            "dynamic:K,D,N[,P] or static:FILE.json"
        )
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "static":
        path = rest if os.path.isabs(rest) or base_dir is None else os.path.join(base_dir, rest)
        if not os.path.isfile(path):
            raise MissingFileError(f"static tree file not found: {path}")
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise TreeSpecError(f"static tree file {path} is not valid JSON: {e}") from None
        candidates = None
        if isinstance(data, dict):
            candidates = data.get("candidates")  # what `tune --temperature` measured fastest
            data = data.get("paths", data.get("choices"))
        if not isinstance(data, list):
            raise TreeSpecError(f"static tree file {path}: expected a list of paths")
        return StaticTree(data, spec, candidates)
    if kind == "dynamic" and rest.count(",") == 3:  # dynamic:K,D,N,P (P a probability)
        head, _, p = rest.rpartition(",")
        try:
            prob = float(p)
        except ValueError:
            raise TreeSpecError(f"malformed tree spec {spec!r}: P in dynamic:K,D,N,P is a probability") from None
        vals = _ints(head, spec)
        if len(vals) == 3:
            return DynamicTree(*vals, spec=spec, min_prob=prob)
    vals = _ints(rest, spec)
    if kind == "chain" and len(vals) == 1:
        return ChainTree(vals[0], spec)
    if kind == "full" and len(vals) == 2:
        return FullTree(vals[0], vals[1], spec)
    if kind == "beam" and len(vals) >= 1:
        return BeamTree(vals, spec)
    if kind == "dynamic" and len(vals) == 3:
        return DynamicTree(*vals, spec=spec)
    raise TreeSpecError(
        f"malformed tree spec {spec!r}: expected chain:K, full:D,W, beam:n1,n2,..., dynamic:K,D,N[,P] or static:FILE.json"
    )


# ----------------------------------------------------------------------------- the tree


@dataclass
class Tree:
    """Draft nodes in level order (the root, the last committed token, is implicit: index -1).

    tokens/parents/depth/score: [N]; anc: bool [N, N], anc[i, j] = j is i or an ancestor of i;
    origin: [N] the node's index as drafted (before a policy's final pruning), which is how a
    draft source finds its own bookkeeping for a node; qrow: [N] row of `q` holding the draft
    distribution its candidate was drawn from."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    anc: torch.Tensor
    origin: torch.Tensor
    qrow: torch.Tensor
    q: torch.Tensor | None = None  # [R, V] warped draft distributions (sampled candidates only)
    candidates: str = "topk"
    draft_calls: int = 0
    plan: object = None  # the TreePlan this tree follows (fixed-shape policies), else None
    forced: bool = False  # a grammar's forced tokens (Tree.chain), not the draft's: it defers them
    base: object = None  # the model draft's own tree where a proposal was merged into it (drafts/proposed.py)
    base_kept: int = 0  # how many of `base`'s nodes lead this tree (0: the proposal replaced them)

    def children(self) -> list[list[int]]:
        """Child node indices per parent; index 0 is the root, index i + 1 is node i."""
        if self.plan is not None:
            return self.plan.children
        kids: list[list[int]] = [[] for _ in range(self.n + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids

    @property
    def n(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def chain(tokens, device="cpu") -> "Tree":
        """A chain of given tokens (deterministic candidates, no draft call): a grammar's forced
        tokens (runtime/decode.py)."""
        k = len(tokens)
        idx = torch.arange(k, device=device)
        anc = torch.ones(k, k, dtype=torch.bool, device=device).tril()
        toks = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
        z = torch.zeros(k, device=device)
        return Tree(toks, idx - 1, idx + 1, z, anc, idx, torch.zeros_like(idx), forced=True)

    @staticmethod
    def empty(device="cpu") -> "Tree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return Tree(z, z, z, z.float(), torch.zeros(0, 0, dtype=torch.bool, device=device), z, z)

    def prune(self, keep) -> "Tree":
        """Keep an ancestor-closed subset of nodes (a bool mask), remapping parent indices."""
        idx = torch.as_tensor(np.asarray(keep)).nonzero().flatten()
        remap = torch.full((self.n + 1,), -1, dtype=torch.long)
        remap[idx] = torch.arange(idx.numel())
        par = self.parents[idx]
        new_par = torch.where(par >= 0, remap[par.clamp(min=0)], par)
        return Tree(
            self.tokens[idx],
            new_par,
            self.depth[idx],
            self.score[idx],
            self.anc[idx][:, idx],
            self.origin[idx],
            self.qrow[idx],
            self.q,
            self.candidates,
            self.draft_calls,
        )
