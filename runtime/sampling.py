"""Logit warping shared by target and draft: temperature, top-k, top-p.

Role in one decoding step: the accept rule compares the target's and the draft's
distributions after the SAME warping, which is what makes sampling lossless with respect to
the warped target distribution the user asked for. Temperature 0 means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        import math

        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
                raise InputError(f"{name.replace('_', '-')} must be a finite number, got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InputError(f"top-k must be an integer, got {self.top_k!r}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """float logits [..., V] -> warped logits (temperature-scaled; -inf outside top-k/top-p)."""
    x = logits.float()
    if sp.greedy:
        return x
    # shift each row's maximum to 0 first (softmax does not change): a tiny temperature then
    # sends the other logits to -inf instead of the maximum to +inf (NaN probabilities)
    m = x.max(-1, keepdim=True).values
    # (and a temperature below float32's range, which would round to 0, divides as 1e-30)
    x = (x - torch.where(torch.isfinite(m), m, torch.zeros_like(m))) / max(sp.temperature, 1e-30)
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        x = top_p_filter(x, sp.top_p)
    return x


TOP_P_FIRST_K = 256  # top_p_filter looks among this many of the most likely tokens first


def top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf on every token the nucleus drops: a token is dropped when the mass strictly before it
    (most likely first) already reaches top_p; the most likely token always stays. The nucleus is
    looked for among the TOP_P_FIRST_K most likely tokens, then 4x as many, up to all of them:
    every token past the first k is dropped once those k hold top_p. (Sorting all 49k entries cost
    3.5 ms a row on one EPYC core: 455 ms a step for a 128-row sampled batch, ten times the H100's
    replayed call, which made the GPU corpus's sampled requests its slowest part.)"""
    v = x.shape[-1]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    k = min(v, TOP_P_FIRST_K)
    while True:
        top, order = torch.topk(x, k, dim=-1)  # sorted, most likely first
        p = torch.exp(top - lse)
        before = torch.cumsum(p, dim=-1) - p
        if k == v or bool((before[..., -1] + p[..., -1] >= top_p).all()):
            break
        k = min(v, 4 * k)
    drop = before >= top_p
    drop[..., 0] = False  # (a top_p below float32's range)
    keep = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, ~drop)
    return x.masked_fill(~keep, float("-inf"))


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Warped probabilities [..., V] (float32). For greedy, a one-hot at the argmax."""
    if sp.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(warp_logits(logits, sp), dim=-1)


# The decoder's random draws, all of them: the accept rule's coins and samples and the sampled
# candidates. Named once here so that a test can replace them with an enumeration of their
# outcomes and compute the decoder's output distribution exactly (tests/lossless_util.py).
def sample(p: torch.Tensor, rng: torch.Generator) -> int:
    """One token from a probability vector [V] (not necessarily normalised), by inverting its
    cumulative sum (float64) at one uniform draw: zero-probability tokens are never drawn.
    (torch.multinomial draws an exponential per entry: 1.09 ms on 49k entries against 0.05 ms
    here, measured on 2 Xeon cores; it was 1.4 ms of every sampled token.)"""
    c = torch.cumsum(p.reshape(-1), 0, dtype=torch.float64)
    total = float(c[-1])
    if not total > 0.0 or total == float("inf"):
        raise ValueError(f"sample: the probabilities must have a positive finite sum (got {total})")
    u = float(torch.rand((), generator=rng, dtype=torch.float64)) * total
    i = int(torch.searchsorted(c, torch.tensor([u], dtype=torch.float64), right=True))
    return min(i, c.numel() - 1)


def coin(prob: float, rng: torch.Generator) -> bool:
    """True with probability `prob` (one uniform draw)."""
    return float(torch.rand((), generator=rng)) < prob


def draw_candidates(q: torch.Tensor, k: int, rng: torch.Generator, unique: bool) -> torch.Tensor:
    """k candidates per row of q [F, V] -> [F, k]: i.i.d. (with replacement), or `unique`:
    sequential draws without replacement, by the Gumbel-top-k trick (q = 0 entries come last).
    The draws run on the host with the decoder's (CPU) generator wherever q lives, so that one
    seed gives the same candidates on every device; the ids come back on q's device."""
    qc = q.detach().to("cpu", torch.float32)
    if not unique:
        return torch.multinomial(qc, k, replacement=True, generator=rng).to(q.device)
    # Gumbel-top-k: the top-k of log q + G (G = -log E, E = -log u ~ Exp(1)) is the top-k of q / E,
    # one logarithm over the rows instead of three: 1.52 -> 0.57 ms on 4 rows of 49k entries (a
    # mixed draft's level), 0.18 -> 0.12 ms on 8k (the EAGLE-3 head's); q = 0 entries come last
    e = torch.rand(qc.shape, generator=rng).clamp_(1e-20, 1.0).log_().neg_()
    return torch.topk(qc / e, k, dim=-1).indices.to(q.device)
