"""Helpers for the lossless chi-square tests (shared by the torch and ONNX Runtime suites)."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from arborspec.runtime import decode as decode_mod
from arborspec.runtime.accept import Acceptance
from arborspec.runtime.kvcache import KVCache
from arborspec.runtime.sampling import SamplingParams, probs, sample

PROMPT = [1, 3, 2]


def exact_two_token_distribution(engine, prompt, sp: SamplingParams) -> np.ndarray:
    """P(x1, x2) of the warped target, by enumeration: [V, V]."""
    v = engine.info.vocab_size

    def next_probs(seq):
        n = len(seq)
        cache = KVCache(engine.info.cache, n, 1)
        logits = engine.forward(
            torch.tensor([seq]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], cache
        )
        return probs(logits[0, -1], sp).double().numpy()

    p1 = next_probs(prompt)
    joint = np.zeros((v, v))
    for x in range(v):
        if p1[x] > 0:
            joint[x] = p1[x] * next_probs(prompt + [x])
    return joint


def sample_two_tokens(decoder, prompt, n, seed0=0) -> np.ndarray:
    v = decoder.target.info.vocab_size
    counts = np.zeros((v, v))
    for i in range(n):
        toks = decoder.generate(prompt, 2, seed=seed0 + i).tokens
        counts[toks[0], toks[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells with tiny expectation are pooled."""
    n = counts.sum()
    exp = expected_p.flatten() * n
    obs = counts.flatten()
    if (obs[exp == 0] > 0).any():  # a token the target can never emit: certainly lossy
        return 0.0
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    return float(stats.chisquare(o[keep], e[keep] * o[keep].sum() / e[keep].sum()).pvalue)


def seed_rule_accept(logits, tree, sp, rng):
    """The seed write-up's accept rule, faithfully: every node accepted independently with
    min(1, p/q) against its parent's unmodified target distribution, a residual resample
    per rejected node, the longest accepted path, a bonus from the target; when no first-level
    child is accepted, the last first-level child's resampled token. Known to be lossy."""
    p_rows = probs(logits.float(), sp)
    n = tree.n
    accepted = torch.zeros(n, dtype=torch.bool)
    resampled = {}
    for i in range(n):
        par = int(tree.parents[i])
        p = p_rows[par + 1]
        q = tree.q[tree.qrow[i]]
        x = int(tree.tokens[i])
        ok = float(torch.rand((), generator=rng)) < min(1.0, float(p[x] / q[x])) if q[x] > 0 else False
        parent_ok = par < 0 or bool(accepted[par])
        accepted[i] = ok and parent_ok
        if not ok:
            res = torch.clamp(p - q, min=0)
            res = res / res.sum() if res.sum() > 0 else p
            resampled[i] = sample(res, rng)
    if bool(accepted.any()):
        deepest = int(torch.argmax(torch.where(accepted, tree.depth, -1)))
        path = tree.anc[deepest].nonzero().flatten()
        bonus = sample(p_rows[deepest + 1], rng)
        return Acceptance(path, tree.tokens[path].tolist() + [bonus])
    first = [i for i in range(n) if int(tree.parents[i]) < 0]
    return Acceptance(torch.zeros(0, dtype=torch.long), [resampled[first[-1]]])


class use_seed_rule:
    """Context manager: run the decode loop with the seed's accept rule."""

    def __enter__(self):
        self._orig = decode_mod.accept
        decode_mod.accept = seed_rule_accept

    def __exit__(self, *exc):
        decode_mod.accept = self._orig
