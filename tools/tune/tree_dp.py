"""Sequoia's dynamic program: the best static tree for measured acceptance and a measured
cost curve.

Role in one decode step: none at run time; `arborspec tune` uses it to choose the tree that
step 1 drafts (`--tree auto`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from arborspec.runtime.errors import InputError


# ----------------------------------------------------------------------------- the DP
@dataclass
class DPResult:
    """Tables of one depth limit D: value[n] = best expected accepted tokens (bonus excluded)
    with at most n nodes; `tree(n)` rebuilds the rank paths."""

    depth_limit: int
    value: list[float]
    _choice: dict
    _order: list[list[int]]

    def tree(self, n: int) -> list[list[int]]:
        paths: list[list[int]] = []

        def build(d: int, budget: int, prefix: tuple):
            if d > self.depth_limit or budget <= 0:
                return
            sizes = []
            j = len(self._order[d])
            b = budget
            while j > 0:
                s = self._choice[(d, j, b)]
                if s:
                    sizes.append((self._order[d][j - 1], s))
                    b -= s
                j -= 1
            for rank, s in sorted(sizes):
                p = prefix + (rank,)
                paths.append(list(p))
                build(d + 1, s - 1, p)

        build(1, n, ())
        return sorted(paths, key=lambda p: (len(p), p))


def _q_at(q: Sequence[Sequence[float]], d: int) -> list[float]:
    """Acceptance row for depth d (1-based); depths past the measured ones reuse the last."""
    return list(q[min(d, len(q)) - 1])


def sequoia_dp(q: Sequence[Sequence[float]], n_max: int, depth_limit: int) -> DPResult:
    """Best tree with <= n nodes and depth <= D, for every n <= n_max (Sequoia, Chen et al. 2024).

    q[d-1][r]: probability that the target's token at depth d is the draft's rank-r
    candidate (ranks are distinct tokens, so at most one child of a node is accepted). The
    expected number of accepted tokens of a tree is the sum over its nodes of the product of
    q along the node's path. F(n, d): the best forest of children (at depth d) of one node
    using at most n nodes:  F(n, d) = max over children j with subtree sizes s_j >= 1,
    sum s_j <= n, of  sum_j q[d][r_j] * (1 + F(s_j - 1, d + 1)),  F(., D + 1) = 0.
    A 0/1 knapsack over the k ranks (best q first) computes it in O(k n^2) per depth."""
    order = {}
    choice = {}
    F_next = [0.0] * (n_max + 1)
    for d in range(depth_limit, 0, -1):
        row = _q_at(q, d)
        ranks = sorted(range(len(row)), key=lambda r: (-row[r], r))
        ranks = [r for r in ranks if row[r] > 0] or ranks[:1]
        order[d] = ranks
        sub = [0.0] + [1.0 + F_next[s - 1] for s in range(1, n_max + 1)]  # value of a child subtree of s nodes
        G = [0.0] * (n_max + 1)
        for j, r in enumerate(ranks, start=1):
            a = row[r]
            newG = list(G)
            for b in range(n_max + 1):
                best, arg = G[b], 0
                for s in range(1, b + 1):
                    v = G[b - s] + a * sub[s]
                    if v > best + 1e-15:
                        best, arg = v, s
                newG[b] = best
                choice[(d, j, b)] = arg
            G = newG
        F_next = G
    return DPResult(depth_limit, F_next, choice, [[]] + [order[d] for d in range(1, depth_limit + 1)])


def tree_value(paths: Sequence[Sequence[int]], q: Sequence[Sequence[float]]) -> float:
    """Expected accepted tokens (bonus excluded) of a tree under the acceptance model q."""
    total = 0.0
    for p in paths:
        v = 1.0
        for d, r in enumerate(p, start=1):
            row = _q_at(q, d)
            v *= row[r] if r < len(row) else 0.0
        total += v
    return total


def level_frontiers(paths: Sequence[Sequence[int]]) -> list[int]:
    """Draft call sizes after the root call: for each level l = 1..depth-1, the number of
    level-l nodes that have children (the frontier expanded by that level's draft call)."""
    if not paths:
        return []
    depth = max(len(p) for p in paths)
    parents = {tuple(p[:-1]) for p in paths if len(p) > 1}
    return [sum(1 for p in parents if len(p) == lvl) for lvl in range(1, depth)]


# ----------------------------------------------------------------------------- costs
def interp(curve: dict, x: float) -> float:
    """Piecewise-linear interpolation of {size: ms}; linear extrapolation past the ends."""
    xs = sorted(curve)
    if len(xs) == 1:
        return float(curve[xs[0]])
    if x <= xs[0]:
        a, b = xs[0], xs[1]
    elif x >= xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        b = next(v for v in xs if v >= x)
        a = max(v for v in xs if v <= x)
        if a == b:
            return float(curve[a])
    return float(curve[a] + (curve[b] - curve[a]) * (x - a) / (b - a))


def tree_ancestors(paths: Sequence[Sequence[int]]):
    """The tree mask [T, T] (bool) of root + the rank paths, nodes by depth then rank: row j
    holds j's ancestors and j."""
    import torch

    nodes = [()] + sorted({tuple(x) for x in paths}, key=lambda x: (len(x), x))
    index = {n: i for i, n in enumerate(nodes)}
    anc = torch.eye(len(nodes), dtype=torch.bool)
    for i, n in enumerate(nodes[1:], 1):
        anc[i] |= anc[index[n[:-1]]]
    return anc


def layout_calls(paths: Sequence[Sequence[int]]) -> list[int]:
    """Rows of the verify calls a row-invariant ONNX Runtime target makes for this tree
    (runtime/backends/row_layout.py: one padded call, or one chain call per path)."""
    from arborspec.runtime.backends.row_layout import verify_calls

    return verify_calls(tree_ancestors(paths))


def step_cost_ms(paths, verify: dict, dcost: dict, calls=None) -> float:
    """Predicted time of one step with this tree: verify over root + nodes (calls: paths -> the
    rows of each verify call, for a target that lays trees out, see `layout_calls`; default one
    call of root + nodes), the draft's root call and one draft call per expanded level."""
    rows = calls(paths) if calls is not None else [len(paths) + 1]
    verify_ms = sum(interp(verify, r) for r in rows)
    return verify_ms + interp(dcost, 1) + sum(interp(dcost, f) for f in level_frontiers(paths) if f)


# ----------------------------------------------------------------------------- tuning
def choose_tree(q, verify: dict, dcost: dict, max_nodes: int, max_depth: int, simulate=None, calls=None) -> dict:
    """Every (n, D): DP tree, expected tokens/step, predicted step ms and tokens/s; the best.
    calls: see `step_cost_ms`.
    simulate: paths -> tokens per step of the decoding loop replayed on the calibration text
    (`acceptance_sim.simulated_tokens_per_step`); when given, it prices every DP tree instead of
    the DP's own estimate under q (kept as `dp_tokens_per_step`)."""
    grid = []
    for D in range(1, max_depth + 1):
        res = sequoia_dp(q, max_nodes, D)
        for n in range(1, max_nodes + 1):
            paths = res.tree(n)
            if not paths or (len(paths) < n and n > 1):
                continue  # the DP found nothing (worth adding): no tree, or a smaller budget's
            e_dp = res.value[n] + 1.0
            e = simulate(paths) if simulate is not None else e_dp
            ms = step_cost_ms(paths, verify, dcost, calls)
            grid.append(
                {
                    "nodes": len(paths),
                    "depth_limit": D,
                    "depth": max(len(p) for p in paths),
                    "expected_tokens_per_step": e,
                    "dp_tokens_per_step": e_dp,
                    "step_ms": ms,
                    "tokens_per_s": 1e3 * e / ms,
                    "paths": paths,
                }
            )
    if not grid:
        raise InputError(
            "no tree pays: the draft's proposals were never accepted on the calibration prompts "
            "(give more --calib-tokens or --limit-prompts, or another --draft)"
        )
    best = max(grid, key=lambda g: g["tokens_per_s"])
    return {"best": best, "grid": grid, "vanilla_tokens_per_s": 1e3 / interp(verify, 1)}
