"""Logit warping shared by target and draft: temperature, top-k, top-p, min-p.

Role in one decoding step: the accept rule compares the target's and the draft's
distributions after the SAME warping, which is what makes sampling lossless with respect to
the warped target distribution the user asked for. Temperature 0 means greedy. The request's
penalties and logit bias (also `SamplingParams`) process the target's rows before warping,
along each row's tree path: runtime/penalties.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InputError


def _finite(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
        raise InputError(f"{name.replace('_', '-')} must be a finite number, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0: off; keeps the tokens at least min_p times as likely as the most likely
    # runtime/penalties.py: processed before warping (greedy too), along each row's tree path
    repetition_penalty: float = 1.0  # 1: off (HF: prompt and output tokens)
    presence_penalty: float = 0.0  # 0: off (OpenAI: output tokens)
    frequency_penalty: float = 0.0  # 0: off (OpenAI: output tokens, per occurrence)
    logit_bias: tuple = ()  # ((token, bias), ...) sorted by token; a dict is taken too
    grammar: object = None  # runtime/structured.Grammar: structured output (masks the target's rows)
    # the end of the answer (vLLM's fields): EOS masked until min_tokens are out (runtime/penalties.py),
    # extra token ids that end it too, or EOS not an end at all (a fixed-length benchmark)
    min_tokens: int = 0
    stop_token_ids: tuple = ()
    ignore_eos: bool = False

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _finite(name, getattr(self, name))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InputError(f"top-k must be an integer, got {self.top_k!r}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise InputError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition-penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InputError(f"{name.replace('_', '-')} must be in [-2, 2], got {getattr(self, name)}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InputError(f"min-tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore-eos must be a boolean, got {self.ignore_eos!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids
        ):
            raise InputError(f"stop-token-ids must be a list of token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(sorted(set(ids))))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def end_ids(self, eos_token_ids) -> list[int]:
        """The token ids that end this request's answer: the model's EOS (none with ignore_eos)
        and its stop_token_ids."""
        return sorted(({int(e) for e in eos_token_ids} if not self.ignore_eos else set()) | set(self.stop_token_ids))

    @property
    def processes_logits(self) -> bool:
        """Whether the target's rows are processed before warping (penalties or logit bias)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )


MAX_LOGIT_BIAS = 300  # tokens a logit_bias may name (OpenAI's limit)


def _bias_pairs(bias) -> tuple:
    """A logit bias ({token: bias} or (token, bias) pairs; token ids as ints or digit strings,
    as OpenAI's JSON sends them; biases in [-100, 100]) -> ((token, bias), ...) sorted by token."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise InputError('logit-bias must map token ids to numbers, e.g. {"50256": -100}') from None
    out = {}
    for k, v in pairs:
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InputError(f"logit-bias keys must be token ids (integers >= 0), got {k!r}")
        _finite("logit_bias", v)
        if not -100 <= v <= 100:
            raise InputError(f"logit-bias values must be in [-100, 100], got {v!r} for token {k}")
        out[k] = float(v)
    if len(out) > MAX_LOGIT_BIAS:
        raise InputError(f"logit-bias names {len(out)} tokens, over the limit of {MAX_LOGIT_BIAS}")
    return tuple(sorted(out.items()))


def warp_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """float logits [..., V] -> warped logits (temperature-scaled; -inf outside top-k/top-p)."""
    x = logits.float()
    if sp.greedy:
        return x
    # shift each row's maximum to 0 first (softmax does not change): a tiny temperature then
    # sends the other logits to -inf instead of the maximum to +inf (NaN probabilities)
    m = x.amax(-1, keepdim=True)  # (max(-1).values also finds the indices: 10x the time on a CPU row)
    # (and a temperature below float32's range, which would round to 0, divides as 1e-30)
    x = (x - torch.where(torch.isfinite(m), m, torch.zeros_like(m))) / max(sp.temperature, 1e-30)
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        x = top_p_filter(x, sp.top_p)
    if sp.min_p > 0.0:  # after top-k / top-p (HF's order): p / p_max = exp(x), the maximum at 0
        x = x.masked_fill(x < math.log(sp.min_p), float("-inf"))
    return x


TOP_P_FIRST_K = 256  # the device path looks among this many of the most likely tokens first
NUCLEUS_FLOORS = (2.0**-7, 2.0**-14, 2.0**-24)  # the CPU path's candidate floors, relative to the top


def top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf on every token the nucleus drops: a token is dropped when the mass strictly before it
    (most likely first; equal ones in token order) already reaches top_p; the most likely token
    always stays. On the CPU each row's nucleus is found among the tokens above a floor (numpy,
    `_nucleus_rows`); on a device among the top k, k widened 4x until it holds top_p."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.numel():
        return _nucleus_rows(x, top_p)
    return _nucleus_topk(x, top_p)


def _nucleus_rows(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p_filter on CPU rows, one at a time (`_nucleus`)."""
    v = x.shape[-1]
    rows = x.detach().reshape(-1, v).numpy()
    out = np.full(rows.shape, -np.inf, dtype=np.float32)
    for a, o in zip(rows, out):
        m = a.max()
        if not np.isfinite(m):  # no finite maximum (NaN or an all -inf row): the device path's answer
            o[:] = _nucleus_topk(torch.from_numpy(a[None]), top_p).numpy()[0]
            continue
        keep = _nucleus(a, np.exp(a - m), top_p)
        o[keep] = a[keep]
    return torch.from_numpy(out).view(x.shape)


def _nucleus(a: np.ndarray, e: np.ndarray, top_p: float) -> np.ndarray:
    """One row's nucleus (the kept token ids, most likely first) from its logits `a` and e =
    exp(a - max(a)), without a vocabulary-wide sort or top-k: only the tokens with e at or above
    a floor are sorted (2^-7 of the top, else 2^-14, 2^-24, else every token with mass), the
    first floor whose tokens hold top_p of the row's mass: it holds the whole nucleus (every
    token below it is less likely than each above, and the mass above already reaches top_p).
    Sums in float64; equal logits in token order. (Faster on the CPU than the widening top-k,
    whose width a flat row pushes to 4096 or all.)"""
    need = top_p * e.sum(dtype=np.float64)
    for floor in NUCLEUS_FLOORS + (0.0,):
        cand = np.flatnonzero(e >= floor) if floor else np.flatnonzero(e > 0)
        if floor == 0.0 or e[cand].sum(dtype=np.float64) >= need:
            break
    order = cand[np.argsort(-a[cand], kind="stable")]  # by logit: e rounds near-equal ones equal
    p = e[order].astype(np.float64)
    before = np.cumsum(p) - p
    return order[(before < need) | (np.arange(len(order)) == 0)]


def _nucleus_topk(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p_filter on any device, all rows at once: the nucleus is looked for among the
    TOP_P_FIRST_K most likely tokens, then 4x as many, up to all of them: every token past the
    first k is dropped once those k hold top_p. (A sort of the whole vocabulary per row made a
    large sampled batch's host work cost several replayed GPU calls.)"""
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
    """Warped probabilities [..., V] (float32): softmax(warp_logits). For greedy, a one-hot at the
    argmax. CPU rows go through numpy (`_probs_rows`), the same numbers in a few calls."""
    if sp.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if logits.device.type == "cpu" and logits.numel():
        p = _probs_rows(logits, sp)
        if p is not None:
            return p
    return torch.softmax(warp_logits(logits, sp), dim=-1)


def _probs_rows(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor | None:
    """softmax(warp_logits) on CPU rows, one at a time in numpy: temperature, top-k, top-p
    (`_nucleus`) and the normalisation (float64 sum) in ~10 numpy calls where the torch
    composition makes ~20 torch calls. Right after an ONNX Runtime call each call runs with cold
    caches (a SmolLM2 row: 0.6-0.8 ms cold against 0.27 warm, measured in the decode loop), so
    the count of calls is the cost. None where a row has no finite maximum (NaN, +-Inf: the
    torch path's answer)."""
    v = logits.shape[-1]
    rows = logits.detach().float().reshape(-1, v).numpy()
    out = np.zeros(rows.shape, dtype=np.float32)
    t = np.float32(max(sp.temperature, 1e-30))
    floor = np.float32(math.log(sp.min_p)) if sp.min_p > 0.0 else None  # min-p: z >= log(min_p)
    for a, o in zip(rows, out):
        m = a.max()
        if not np.isfinite(m):
            return None
        z = (a - m) / t  # the maximum at 0, as warp_logits
        if sp.top_k and sp.top_k < v:
            kth = np.partition(z, v - sp.top_k)[v - sp.top_k]
            z[z < kth] = -np.inf
        e = np.exp(z)
        if sp.top_p < 1.0:
            keep = _nucleus(z, e, sp.top_p)
            if floor is not None:  # after the nucleus (HF's order)
                keep = keep[z[keep] >= floor]
            o[keep] = e[keep] / e[keep].sum(dtype=np.float64)
        else:
            if floor is not None:
                e[z < floor] = 0.0
            o[:] = e / e.sum(dtype=np.float64)
    return torch.from_numpy(out).view(logits.shape)


# The decoder's random draws, all of them: the accept rule's coins and samples and the sampled
# candidates. Named once here so that a test can replace them with an enumeration of their
# outcomes and compute the decoder's output distribution exactly (tests/lossless_util.py).
def sample(p: torch.Tensor, rng: torch.Generator) -> int:
    """One token from a probability vector [V] (not necessarily normalised), by inverting its
    cumulative sum (float64) at one uniform draw: zero-probability tokens are never drawn. The
    sum runs over the nonzero entries only (a nucleus, not 49k zeros): the same partial sums,
    hence the same token, as over the whole row. (torch.multinomial draws an exponential per
    entry: 1.09 ms on 49k entries against 0.05 ms here, measured on 2 Xeon cores; it was 1.4 ms
    of every sampled token.)"""
    t = p.detach().reshape(-1).cpu()
    a = (t if t.dtype in (torch.float32, torch.float64) else t.float()).numpy()
    support = np.flatnonzero(a != 0)  # (a float array's own flatnonzero is 10x slower)
    c = np.cumsum(a[support], dtype=np.float64)
    total = float(c[-1]) if len(c) else 0.0
    if not total > 0.0 or total == float("inf"):
        raise ValueError(f"sample: the probabilities must have a positive finite sum (got {total})")
    u = float(torch.rand((), generator=rng, dtype=torch.float64)) * total
    return int(support[min(int(np.searchsorted(c, u, side="right")), len(c) - 1)])


def coin(prob: float, rng: torch.Generator) -> bool:
    """True with probability `prob` (one uniform draw)."""
    return float(torch.rand((), generator=rng)) < prob


_SUPPORT_ROWS = 16  # up to this many rows, unique draws look only at each row's nonzero entries


def _gumbel_topk_support(q: torch.Tensor, k: int, rng: torch.Generator) -> torch.Tensor:
    """Gumbel-top-k row by row over the nonzero entries only (a warped draft row is a nucleus of
    tens to hundreds of tokens, not its 8k-49k entries): the same distribution as over the whole
    row, whose zero entries come last; a row with fewer than k nonzero entries is completed with
    distinct zero entries (the accept rule never accepts them: q = 0). A draft level's one or two
    rows of 8k: 0.08 -> 0.02 ms a row (the whole row's exponentials and top-k skipped)."""
    rows = q.numpy()
    out = np.empty((rows.shape[0], k), dtype=np.int64)
    for a, o in zip(rows, out):
        s = np.flatnonzero(a != 0)  # (a float array's own flatnonzero is 10x slower)
        e = -np.log(np.maximum(torch.rand(s.size, generator=rng, dtype=torch.float64).numpy(), 1e-300))
        order = s[np.argsort(e / a[s], kind="stable")[:k]]  # the largest q / e first
        if order.size < k:  # too few nonzero entries: distinct zero entries after them
            order = np.concatenate([order, np.setdiff1d(np.arange(k + s.size), s)[: k - order.size]])
        o[:] = order
    return torch.from_numpy(out)


def draw_candidates(q: torch.Tensor, k: int, rng: torch.Generator, unique: bool) -> torch.Tensor:
    """k candidates per row of q [F, V] -> [F, k]: i.i.d. (with replacement), or `unique`:
    sequential draws without replacement, by the Gumbel-top-k trick (q = 0 entries come last).
    The draws run on the host with the decoder's (CPU) generator wherever q lives, so that one
    seed gives the same candidates on every device; the ids come back on q's device. Unique
    draws over a few rows (a draft level's frontier) look at each row's nonzero entries only
    (`_gumbel_topk_support`)."""
    qc = q.detach().to("cpu", torch.float32)
    if not unique:
        return torch.multinomial(qc, k, replacement=True, generator=rng).to(q.device)
    if qc.shape[0] <= _SUPPORT_ROWS:
        return _gumbel_topk_support(qc, k, rng).to(q.device)
    # Gumbel-top-k: the top-k of log q + G (G = -log E, E = -log u ~ Exp(1)) is the top-k of q / E,
    # one logarithm over the rows instead of three: 1.52 -> 0.57 ms on 4 rows of 49k entries (a
    # mixed draft's level), 0.18 -> 0.12 ms on 8k (the EAGLE-3 head's); q = 0 entries come last
    e = torch.rand(qc.shape, generator=rng).clamp_(1e-20, 1.0).log_().neg_()
    return torch.topk(qc / e, k, dim=-1).indices.to(q.device)
