"""A draft source that mixes a model draft with prompt lookup: `--draft BASE+lookup[:N]`.

Role in one decode step: step 1. Every call asks both sources for the same nodes: the model
draft (an EAGLE-3 head, a `layers:K` draft, ...) for its distribution p_M, the lookup index
(runtime/drafts/lookup.py) for the continuations of the longest n-gram it finds, p_L. Where lookup
finds one, the node's distribution is the mixture q = w * p_L + (1 - w) * p_M; where it finds
none, q = p_M. So a continuation the text has seen before ranks first, and the model's best
guesses follow as siblings and fill every node lookup has no opinion on: the tree gets
lookup's long copies in copy-heavy text and the model's guesses elsewhere, for the cost of
the model's calls (the lookup's own cost is small next to a model call). Step 5 (`commit`) tells both.

Candidates are target ids (the model's `token_map` is applied here), so the mixture's rows
span the target vocabulary. The accept rules stay lossless: deterministic (top-k) candidates
need no q, and sampled candidates are drawn from, and accepted against, this same q.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .base import DraftSource, ModelMixDraft, NodeView, TopK, full_vocab, to_target
from .lookup import LookupDraft

LOOKUP_WEIGHT = 0.5  # w: the lookup's share of q where it finds a continuation


class LookupMixDraft(ModelMixDraft):
    """`base` (a model DraftSource) mixed with a `LookupDraft` of the target vocabulary."""

    def __init__(self, base: DraftSource, lookup: LookupDraft, weight: float = LOOKUP_WEIGHT):
        if not 0.0 < weight < 1.0:
            raise InputError(f"lookup weight must be in (0, 1), got {weight}")
        if not base.finite_logits:
            raise InputError(f"draft {base.kind} cannot be mixed with lookup: it is a table draft itself")
        self.base, self.lookup, self.weight = base, lookup, float(weight)
        self.kind = f"{base.kind}+lookup"
        self.vocab_size = lookup.vocab_size  # the target's: candidates are target ids
        self.token_map = None
        self.needs_target_features = base.needs_target_features
        self.finite_logits = True
        tmap = base.token_map
        if tmap is None and base.vocab_size != self.vocab_size:
            raise InputError(f"draft vocabulary ({base.vocab_size}) differs from the target's ({self.vocab_size})")
        self._tmap = tmap.cpu().long() if tmap is not None else None

    # ------------------------------------------------------------------ lifecycle
    def fork(self) -> "LookupMixDraft":
        return LookupMixDraft(self.base.fork(), self.lookup.fork(), self.weight)

    def prepare(self, policy, max_len: int) -> None:
        self.base.prepare(policy, max_len)
        self.lookup.prepare(policy, max_len)

    def forget(self) -> None:
        self.base.forget()
        self.lookup.forget()

    def reset(self, committed: list[int], features: torch.Tensor | None = None) -> None:
        self.base.reset(committed, features)
        self.lookup.reset(committed)

    def commit(self, tree, path: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.base.commit(tree, path, features)
        self.lookup.commit(tree, path)

    def defer(self, root: int, features: torch.Tensor | None = None) -> None:
        self.base.defer(root, features)
        self.lookup.defer(root)

    def close(self) -> None:
        self.base.close()

    # ------------------------------------------------------------------ full rows
    def _mix_rows(self, model_logits: torch.Tensor, lookup_logp: torch.Tensor) -> torch.Tensor:
        """log q [F, V_target] from the model's logits [F, V_draft] and lookup's log-probs."""
        pm = full_vocab(torch.softmax(model_logits.float().cpu(), -1), self._tmap, self.vocab_size)
        pl = torch.exp(lookup_logp.float())  # 0 where lookup has nothing
        hit = (pl.sum(-1, keepdim=True) > 0).float()
        w = self.weight * hit
        return torch.log((1 - w) * pm + w * pl)

    def start(self, root: int) -> torch.Tensor:
        return self._mix_rows(self.base.start(root)[None], self.lookup.start(root)[None])[0]

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        return self._mix_rows(self.base.expand(nodes, frontier), self.lookup.expand(nodes, frontier))

    # ------------------------------------------------------------------ top-k
    def _mix_topk(self, m: TopK, lk: TopK, k: int) -> TopK:
        """The top-k of q among both sources' top-k candidates (vectorised over rows; duplicate
        tokens merged): values log q (a lower bound where a source's tail is cut off)."""
        mt = to_target(m.indices.cpu(), self._tmap)
        mp = torch.exp(m.values.float().cpu())
        lp = torch.exp(lk.values.float().cpu())  # 0 for missing entries
        lt = torch.where(lp > 0, lk.indices.cpu(), torch.full_like(lk.indices.cpu(), -1))
        w = self.weight * (lp.sum(-1, keepdim=True) > 0).float()
        cand = torch.cat([lt, mt], 1)  # [F, C]
        prob = torch.cat([w * lp, (1 - w) * mp], 1)
        same = cand[:, :, None] == cand[:, None, :]  # [F, C, C]
        total = (same * prob[:, None, :]).sum(-1)
        later = same.tril(-1).any(-1) | (cand < 0)  # a repeat of an earlier slot, or no candidate
        total = total.masked_fill(later, 0.0)
        vals, pos = torch.topk(total, min(k, total.shape[1]), dim=-1)
        return TopK(torch.log(vals), cand.gather(1, pos).clamp_min(0))

    def start_topk(self, root: int, k: int, logprobs: bool = False) -> TopK:
        return self._mix_topk(self.base.start_topk(root, k, True), self.lookup.start_topk(root, k, True), k)

    def expand_topk(self, nodes: NodeView, frontier: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
        return self._mix_topk(
            self.base.expand_topk(nodes, frontier, k, True), self.lookup.expand_topk(nodes, frontier, k, True), k
        )
