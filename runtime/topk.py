"""A call's top-k candidates: `TopK` and `topk_of`, where the logits are.

Below both the backends (an engine's `forward_topk`, backends/torch_backend.py) and the draft
sources (runtime/drafts/: a level's candidates), so neither climbs to the other for it;
runtime/drafts/base.py re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TopK:
    """A draft call's top-k per row: `values` [F, k] (log-probs when asked for, else raw
    logits), `indices` [F, k] draft-vocabulary ids; computed where the logits are."""

    values: torch.Tensor
    indices: torch.Tensor


def topk_of(logits: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
    """Top-k of logits [F, V] on their device; log-probs (values minus the log-normaliser) when
    `logprobs` (rows with no finite logit keep -inf)."""
    vals, idx = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1)
    if logprobs:
        lse = torch.logsumexp(logits.float(), -1, keepdim=True)
        vals = vals - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return TopK(vals, idx)
