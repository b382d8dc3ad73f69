"""Temperature, top-k and top-p against an independent implementation: transformers' logits
warpers (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, applied in the order
`generate` applies them), not the runtime's own `probs()`. The kept tokens must be the same
set and the probabilities equal; rows whose top-p boundary sits within float rounding of the
threshold are left out (either answer is right there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arborspec.runtime.sampling import SamplingParams, probs

tw = pytest.importorskip("transformers.generation.logits_process")

CASES = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (1.0, 1, 1.0),
    (0.9, 0, 0.5),
    (1.0, 0, 0.9),
    (0.6, 20, 0.8),
    (1.0, 3, 0.3),
    (2.0, 0, 0.05),
]


def reference(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    scores = logits.clone()
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    scores = tw.TemperatureLogitsWarper(t)(ids, scores)
    if k:
        scores = tw.TopKLogitsWarper(k)(ids, scores)
    if p < 1.0:
        scores = tw.TopPLogitsWarper(p)(ids, scores)
    return torch.softmax(scores, -1)


def near_the_threshold(logits: torch.Tensor, t: float, k: int, p: float, tol: float = 1e-5) -> torch.Tensor:
    """Rows where the mass before some token is within `tol` of top_p (after temperature, top-k)."""
    if p >= 1.0:
        return torch.zeros(logits.shape[0], dtype=torch.bool)
    x = logits / t
    if k:
        kth = torch.topk(x, k, -1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    sp = torch.softmax(x, -1).sort(-1, descending=True).values
    before = sp.cumsum(-1) - sp
    return ((before - p).abs() < tol).any(-1)


@pytest.mark.parametrize("t,k,p", CASES)
def test_warped_probabilities_equal_transformers(t, k, p):
    g = torch.Generator().manual_seed(int(1000 * t + 10 * k + 100 * p))
    logits = torch.randn(400, 64, generator=g) * 3
    keep = ~near_the_threshold(logits, t, k, p)
    assert keep.sum() > 300
    want = reference(logits, t, k, p)[keep]
    got = probs(logits, SamplingParams(t, k, p))[keep]
    assert torch.equal(got > 0, want > 0), "a different set of tokens kept"
    assert torch.allclose(got, want, atol=1e-6)
    if k or p < 1.0:  # the case cuts something: the test can see a wrong cut
        assert (want == 0).any()


def test_the_token_crossing_top_p_is_kept():
    """Probabilities 0.5, 0.3, 0.2 with top_p 0.6: the second token crosses 0.6 and stays."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    want = reference(logits, 1.0, 0, 0.6)
    assert torch.equal(want > 0, torch.tensor([[True, True, False]]))
    assert torch.allclose(probs(logits, SamplingParams(1.0, 0, 0.6)), want, atol=1e-6)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.95])
def test_a_nucleus_of_thousands_of_tokens_equals_transformers(p):
    """A real vocabulary's nucleus: top_p_filter looks among the 256 most likely tokens first, then
    4x as many, up to all (a full sort of 49k entries cost 3.5 ms a row). Rows from peaked
    (a nucleus of a few tokens) to flat (thousands, past 256 and 1024): the same kept set as
    transformers' and the same probabilities."""
    g = torch.Generator().manual_seed(int(100 * p))
    scale = torch.linspace(0.3, 12.0, 120)[:, None]
    logits = torch.randn(120, 20000, generator=g) * scale
    keep = ~near_the_threshold(logits, 1.0, 0, p)
    want = reference(logits, 1.0, 0, p)[keep]
    got = probs(logits, SamplingParams(1.0, 0, p))[keep]
    sizes = (want > 0).sum(-1)
    assert keep.sum() > 60 and sizes.min() < 256 and sizes.max() > 1024
    assert torch.equal(got > 0, want > 0), "a different set of tokens kept"
    assert torch.allclose(got, want, atol=1e-6)


def nucleus_float64(x: torch.Tensor, p: float):
    """The rule written out in float64: each row sorted (most likely first, equal ones in token
    order), the cumulative mass before each token, the token dropped once it reaches p (the first
    one never). -> (kept mask, each token's mass-before minus p, in token order)."""
    x = x.double()
    order = np.argsort(-x.numpy(), axis=1, kind="stable")
    e = torch.exp(x - x.amax(1, keepdim=True)).nan_to_num(0.0)
    pe = torch.gather(e, 1, torch.from_numpy(order))
    pe = pe / pe.sum(1, keepdim=True)
    before = torch.cumsum(pe, 1) - pe
    keep_sorted = before < p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, torch.from_numpy(order), keep_sorted)
    gap = torch.zeros_like(before).scatter(1, torch.from_numpy(order), before - p)
    return keep, gap


def test_the_cpu_nucleus_and_the_device_paths_nucleus_follow_the_rule():
    """top_p_filter has two implementations of one rule: CPU rows (`_nucleus_rows`: the tokens above
    a floor, sorted, sums in float64) and any device (`_nucleus_topk`: a widening top-k, float32).
    Both run on CPU tensors, so both are checked here against the rule written out in float64:
    peaked to flat rows of a 49k vocabulary (nuclei from one token to thousands, every floor of
    NUCLEUS_FLOORS and the last resort used), a row with -inf entries and one with equal logits.
    Each may differ from it only at a token whose mass-before is within its rounding of top_p (the
    CPU path's float32 exponentials: 1e-7; the device path's float32 sums: 1e-5). Kept logits
    untouched."""
    from arborspec.runtime.sampling import NUCLEUS_FLOORS, _nucleus_rows, _nucleus_topk

    g = torch.Generator().manual_seed(11)
    scale = torch.logspace(-1.5, 1.3, 48)[:, None]
    x = torch.randn(48, 49152, generator=g) * scale
    x[5, 100:] = float("-inf")  # a short row
    x[40, :10] = x[40].max() + 3.0  # ten equal most likely tokens
    x[46:, 1:] = torch.tensor([[-12.0], [-17.0]])  # one token and a long tail: 2^-17, 2^-25 of it
    x[46:, 0] = 0.0
    for p in (0.3, 0.9, 0.95, 0.999):
        want, gap = nucleus_float64(x, p)
        rows, dev = _nucleus_rows(x, p), _nucleus_topk(x, p)
        for got, tol in ((rows, 1e-7), (dev, 1e-5)):  # float32 exponentials; float32 sums
            differ = torch.isfinite(got) != want
            if got is dev:  # its top-k orders equal logits its own way (and its float32 sums
                # over the 49k equal tails drift by a few tokens): as many of the ten kept
                assert torch.isfinite(dev[40]).sum() == want[40].sum()
                differ[[40, 46, 47]] = False
            assert (gap[differ].abs() < tol).all(), f"top_p {p}: {'CPU' if got is rows else 'device'} path"
        for got in (rows, dev):
            assert torch.equal(got[torch.isfinite(got)], x[torch.isfinite(got)])
    kept = torch.isfinite(_nucleus_rows(x, 0.95)).sum(1)
    assert kept.min() == 1 and kept.max() > 4096  # from one token to thousands
    assert kept[40] == 10  # the ten equal most likely tokens hold 0.95: all ten kept
    # which floor held each row's nucleus: each is used, and the last resort (every token)
    e = torch.exp(x - x.amax(1, keepdim=True)).double()
    mass = torch.stack([(e * (e >= f)).sum(1) for f in NUCLEUS_FLOORS]) / e.sum(1)
    used = set()
    for p in (0.95, 0.999):
        held = mass >= p
        used |= set(held.int().argmax(0).masked_fill(~held.any(0), len(NUCLEUS_FLOORS)).tolist())
    assert used == set(range(len(NUCLEUS_FLOORS) + 1))
    # equal logits: the earlier tokens first; NaN and all -inf rows: the device path's answer
    assert torch.isfinite(_nucleus_rows(torch.tensor([[0.5, 0.5, 0.5]]), 0.5)).tolist() == [[True, True, False]]
    odd = torch.tensor([[float("nan"), 1.0, 2.0], [float("-inf")] * 3])
    for p in (0.2, 0.9):
        got, dev = _nucleus_rows(odd, p), _nucleus_topk(odd, p)
        assert torch.equal(got.isnan(), dev.isnan()) and torch.equal(got.isinf(), dev.isinf())


@pytest.mark.parametrize("t,k,p", CASES + [(1e-30, 0, 0.9), (0.8, 50, 0.95), (0.8, 0, 0.95)])
def test_cpu_rows_probabilities_are_the_warped_softmax(t, k, p):
    """probs() on CPU rows runs in numpy (`_probs_rows`); on any other device it is
    softmax(warp_logits). Both on the same SmolLM2-sized rows, peaked to flat: the same kept
    tokens (rows within rounding of the top-p threshold left out) and the same probabilities."""
    from arborspec.runtime.sampling import _probs_rows, warp_logits

    g = torch.Generator().manual_seed(int(1000 * t + 10 * k + 100 * p))
    x = torch.randn(24, 49152, generator=g) * torch.logspace(-1, 1.2, 24)[:, None]
    sp = SamplingParams(t, k, p)
    keep = ~near_the_threshold(x, max(t, 1e-30), k, p, tol=2e-6)
    got, want = _probs_rows(x, sp), torch.softmax(warp_logits(x, sp), -1)
    assert torch.equal(probs(x, sp), got) and keep.sum() >= 16
    assert torch.equal(got[keep] > 0, want[keep] > 0), "a different set of tokens kept"
    assert torch.allclose(got[keep], want[keep], atol=1e-6, rtol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(24))
    odd = torch.tensor([[float("nan"), 1.0, 2.0]])
    assert _probs_rows(odd, sp) is None and torch.isnan(probs(odd, sp)).all()


MIN_P = [(1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.2), (1.3, 10, 0.9, 0.1), (0.8, 0, 0.95, 0.3), (2.0, 0, 0.98, 0.1)]


@pytest.mark.parametrize("t,k,p,m", MIN_P)
def test_min_p_equals_transformers(t, k, p, m):
    """min-p after temperature, top-k and top-p (transformers' MinPLogitsWarper last, as
    `generate` orders them), on the CPU rows (numpy) and the torch path alike; rows within
    rounding of either threshold left out."""
    from arborspec.runtime.sampling import _probs_rows, warp_logits

    g = torch.Generator().manual_seed(int(1000 * t + 10 * k + 100 * p + 7 * m))
    logits = torch.randn(400, 64, generator=g) * 3
    ids = torch.zeros(400, 1, dtype=torch.long)
    scores = tw.TemperatureLogitsWarper(t)(ids, logits.clone())
    if k:
        scores = tw.TopKLogitsWarper(k)(ids, scores)
    if p < 1.0:
        scores = tw.TopPLogitsWarper(p)(ids, scores)
    want = torch.softmax(tw.MinPLogitsWarper(m)(ids, scores), -1)
    # rows where some token's p / p_max is within rounding of min_p
    pre = torch.softmax(scores, -1)
    ratio = pre / pre.amax(-1, keepdim=True)
    keep = ~near_the_threshold(logits, t, k, p) & ~((ratio - m).abs() < 1e-5).any(-1)
    assert keep.sum() > 300
    sp = SamplingParams(t, k, p, min_p=m)
    got = probs(logits, sp)
    assert torch.equal(got, _probs_rows(logits, sp))
    for mine in (got, torch.softmax(warp_logits(logits, sp), -1)):
        assert torch.equal(mine[keep] > 0, want[keep] > 0), "a different set of tokens kept"
        assert torch.allclose(mine[keep], want[keep], atol=1e-6)
    cut = probs(logits, SamplingParams(t, k, p))
    assert ((cut > 0) & (got == 0))[keep].any(), "min-p cut nothing here"
