"""The decoder's random primitives (runtime/sampling.py), which the exact tests enumerate and so
take on trust, checked here against their definitions by a chi-square test on 40,000 draws made
in one vectorised call: `draw_candidates` with replacement (i.i.d. from q) and without
(sequential draws without replacement, as the sample-unique rule assumes), `coin` and `sample`
(also on an unnormalised vector, as the accept rule's residual is)."""

from __future__ import annotations

from itertools import permutations, product

import numpy as np
import pytest
import torch
from scipy import stats

from arborspec.runtime.sampling import coin, draw_candidates, sample

Q = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
N = 40_000


def pvalue(observed: dict, expected: dict) -> float:
    keys = sorted(expected)
    assert set(observed) <= set(keys), "an outcome of probability 0 was drawn"
    o = np.array([observed.get(k, 0) for k in keys], dtype=float)
    e = np.array([expected[k] for k in keys])
    e = e / e.sum() * o.sum()
    return float(stats.chisquare(o, e).pvalue)


@pytest.mark.parametrize("unique,per_call", [(False, N), (True, N), (True, 8)])
def test_draw_candidates_follow_their_definition(unique, per_call):
    """per_call 8: a draft level's few rows, whose unique draws look at the nonzero entries only."""
    g = torch.Generator().manual_seed(7 + unique + per_call)
    rows = []
    for _ in range(N // per_call):
        rows += draw_candidates(Q.expand(per_call, -1).contiguous(), 2, g, unique).tolist()
    seen: dict = {}
    for r in rows:
        seen[tuple(r)] = seen.get(tuple(r), 0) + 1
    q = Q.double().tolist()
    if unique:
        want = {(a, b): q[a] * q[b] / (1 - q[a]) for a, b in permutations(range(4), 2)}
    else:
        want = {(a, b): q[a] * q[b] for a, b in product(range(4), repeat=2)}
    assert pvalue(seen, want) > 1e-3


def test_coin_and_sample_follow_their_definition():
    g = torch.Generator().manual_seed(3)
    heads = sum(coin(0.3, g) for _ in range(4000))
    assert abs(heads / 4000 - 0.3) < 0.03  # 4 standard deviations
    assert not any(coin(0.0, g) for _ in range(200)) and all(coin(1.0, g) for _ in range(200))
    draws = [sample(Q, g) for _ in range(4000)]
    seen = {(x,): draws.count(x) for x in set(draws)}
    assert pvalue(seen, {(i,): float(Q[i]) for i in range(4)}) > 1e-3
    # an unnormalised vector (the residual max(0, p - q) of the accept rule) draws p / sum(p)
    r = torch.tensor([0.0, 0.05, 0.0, 0.15, 0.0])
    draws = [sample(r, g) for _ in range(4000)]
    seen = {(x,): draws.count(x) for x in set(draws)}
    assert pvalue(seen, {(1,): 0.25, (3,): 0.75}) > 1e-3
    with pytest.raises(ValueError, match="positive finite sum"):
        sample(torch.zeros(5), g)


def test_sample_over_the_nonzero_entries_draws_what_the_whole_row_draws():
    """`sample` inverts the cumulative sum of the nonzero entries only (a nucleus, not 49k zeros):
    the partial sums are the whole row's, so one draw gives the token the whole row's inversion
    gives (checked draw by draw against that definition, written out here), never a zero entry."""
    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        p = torch.rand(2000, generator=g) * (torch.rand(2000, generator=g) < 0.02)
        p[int(torch.randint(2000, (), generator=g))] += 0.1  # at least one nonzero
        seed = 1000 + trial
        got = sample(p, torch.Generator().manual_seed(seed))
        c = torch.cumsum(p, 0, dtype=torch.float64)
        u = float(torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)) * float(c[-1])
        want = min(int(torch.searchsorted(c, torch.tensor([u], dtype=torch.float64), right=True)), 1999)
        assert got == want and p[got] > 0


def test_unique_draws_with_fewer_nonzero_entries_than_k_end_with_distinct_zero_entries():
    g = torch.Generator().manual_seed(11)
    q = torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0, 0.0]]).expand(4, -1).contiguous()
    firsts = []
    for _ in range(2000):
        for r in draw_candidates(q, 4, g, True).tolist():
            assert sorted(r[:2]) == [1, 3] and len(set(r)) == 4 and all(q[0, x] == 0 for x in r[2:])
            firsts.append(r[0])
    assert abs(firsts.count(1) / len(firsts) - 0.7) < 0.02  # 8,000 draws: 0.005 a standard deviation
