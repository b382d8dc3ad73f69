"""Temperature, top-k and top-p against an independent implementation: transformers' logits
warpers (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, applied in the order
`generate` applies them), not the runtime's own `probs()`. The kept tokens must be the same
set and the probabilities equal; rows whose top-p boundary sits within float rounding of the
threshold are left out (either answer is right there)."""

from __future__ import annotations

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


def near_the_threshold(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """Rows where the mass before some token is within 1e-5 of top_p (after temperature, top-k)."""
    if p >= 1.0:
        return torch.zeros(logits.shape[0], dtype=torch.bool)
    x = logits / t
    if k:
        kth = torch.topk(x, k, -1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    sp = torch.softmax(x, -1).sort(-1, descending=True).values
    before = sp.cumsum(-1) - sp
    return ((before - p).abs() < 1e-5).any(-1)


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
