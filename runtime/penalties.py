"""Penalties, logit bias, min_tokens: the request's logit processing that depends on the tokens so far.

Role in one decoding step: step 4. Before the accept walk reads a verify row (the target's
logits at the root or at a tree node), the row is processed as plain decoding would process
the target's logits after that row's own history: the prompt, the tokens generated so far and
the tokens on the tree path down to that node (`TokenHistory.process`). Step 1 processes the
draft's rows the same way along each frontier node's path (`process_draft`), so that the draft
proposes what the penalised target will pick. The walk then compares
the drafted tokens with those processed rows (greedy: their argmax; sampled: their warped
distribution), so greedy speculation stays token for token the processed greedy decoding and
sampling stays lossless with respect to the processed distribution (the accept rule is exact
for any draft: processing the draft's rows only raises its acceptance). Only the rows the walk
reads are processed: a greedy step touches depth + 1 rows, never the whole tree.

The rules, in this order (the conventions and the order of Hugging Face `generate` and vLLM):
  * logit_bias {token: bias} (OpenAI): bias added to the token's logit, every row;
  * repetition_penalty r (HF, CTRL): every token in the prompt or the output so far has its
    logit divided by r where positive, multiplied by r where negative;
  * presence_penalty a, frequency_penalty b (OpenAI): a token generated c > 0 times so far has
    a + b * c subtracted from its logit (the output only, not the prompt).
  * min_tokens n (vLLM): the ids that end the answer masked while fewer than n tokens precede
    the row (`MinTokens`).
`RowProcessing` chains a sequence's processors (these, then a grammar's mask: runtime/structured.py).
Then temperature, top-k, top-p and min-p warp the processed row (runtime/sampling.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .errors import InputError, NumericalError


class TokenHistory:
    """One sequence's tokens as the penalties read them: the prompt and the committed output.
    Kept as index arrays and an output-count vector, extended once a step (`extend`)."""

    def __init__(self, prompt: Sequence[int], vocab_size: int, sp):
        self.sp = sp
        self.vocab_size = vocab_size
        if check_bias(sp, vocab_size):
            self.bias_ids = np.array([t for t, _ in sp.logit_bias], dtype=np.int64)
            self.bias = np.array([b for _, b in sp.logit_bias], dtype=np.float32)
        self.seen = np.unique(np.asarray(list(prompt), dtype=np.int64))  # prompt and output (repetition)
        self.counts = np.zeros(vocab_size, dtype=np.int64)  # output tokens so far (presence, frequency)
        self.out = np.zeros(0, dtype=np.int64)  # the distinct output tokens

    def extend(self, tokens: Sequence[int]) -> None:
        """Step 5's bookkeeping: the tokens a step committed join the history."""
        if not tokens:
            return
        t = np.asarray(tokens, dtype=np.int64)
        np.add.at(self.counts, t, 1)
        self.seen = np.union1d(self.seen, t)
        self.out = np.union1d(self.out, t)

    def process(self, row: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """A verify row [V] (on the host) after the history plus `path` (the tree's tokens from
        the root's first child down to the node whose row it is) -> the processed row, float32
        (a copy: the verify call's logits stay as they came)."""
        sp = self.sp
        x = row.detach().float().numpy().copy()
        p = np.asarray(path, dtype=np.int64)
        if sp.logit_bias:  # first, as transformers' and vLLM's processors
            x[self.bias_ids] += self.bias
        if sp.repetition_penalty != 1.0:
            ids = np.union1d(self.seen, p) if p.size else self.seen
            v = x[ids]
            x[ids] = np.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
        if sp.presence_penalty or sp.frequency_penalty:
            ids = np.union1d(self.out, p) if p.size else self.out
            c = self.counts[ids]  # (a copy: fancy indexing)
            np.add.at(c, np.searchsorted(ids, p), 1)  # the path's own tokens, each occurrence
            x[ids] -= (sp.frequency_penalty * c + sp.presence_penalty * (c > 0)).astype(np.float32)
        return torch.from_numpy(x)


class RowProcessing:
    """A sequence's row processors in order: its penalties (TokenHistory), then its structured
    output's mask (runtime/structured.GrammarState); each has process(row, path) and extend(tokens)."""

    def __init__(self, parts: list, vocab_size: int):
        self.parts, self.vocab_size = parts, vocab_size

    def _apply(self, row: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        for p in self.parts:
            row = p.process(row, path)
        return row

    def process(self, row: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """A verify row the accept walk reads (its path was accepted): some token must remain."""
        out = self._apply(row, path)
        if not bool(torch.isfinite(out).any()):
            raise NumericalError("structured output: the grammar allows no next token here")
        return out

    def extend(self, tokens: Sequence[int]) -> None:
        for p in self.parts:
            p.extend(tokens)

    def forced(self) -> list[int]:
        """The tokens a grammar forces next (structured.GrammarState.forced; [] without one)."""
        for p in self.parts:
            if hasattr(p, "forced"):
                return p.forced()
        return []

    def process_draft(self, rows: torch.Tensor, paths: list, token_map: torch.Tensor | None) -> torch.Tensor:
        """Step 1's counterpart: the draft's rows [F, Vd] processed as the target's will be, row f
        along paths[f] (target ids), so that the draft proposes what the processed target picks
        (its acceptance; exactness never depends on it). token_map: the draft's ids -> target ids
        where its vocabulary is reduced (the row is spread over the target's vocabulary for it)."""
        out = []
        for row, path in zip(rows.detach().float().cpu(), paths):
            if token_map is None:
                x = self._apply(row, path)
            else:
                full = torch.full((self.vocab_size,), float("-inf"))
                full[token_map] = row
                x = self._apply(full, path)[token_map]
            # a path the grammar refuses (or no allowed token in the draft's vocabulary): the
            # node is never accepted, whatever it proposes; its row stays as drafted
            out.append(x if bool(torch.isfinite(x).any()) else row)
        return torch.stack(out).to(rows.device)


def check_bias(sp, vocab_size: int) -> bool:
    """Whether `sp` has a logit bias; one InputError line when it (or stop_token_ids) names a
    token outside the vocabulary."""
    if sp.logit_bias and sp.logit_bias[-1][0] >= vocab_size:  # (sorted by token id)
        raise InputError(f"logit-bias token id {sp.logit_bias[-1][0]} is outside the vocabulary [0, {vocab_size})")
    if sp.stop_token_ids and sp.stop_token_ids[-1] >= vocab_size:
        raise InputError(f"stop-token-ids: {sp.stop_token_ids[-1]} is outside the vocabulary [0, {vocab_size})")
    return bool(sp.logit_bias)


class MinTokens:
    """No end of the answer before `n` tokens: the ending ids masked in every row whose path
    would put them earlier (vLLM's min_tokens); the TokenHistory interface."""

    def __init__(self, n: int, end_ids: Sequence[int]):
        self.n, self.end, self.produced = n, torch.tensor(sorted(end_ids), dtype=torch.long), 0

    def process(self, row: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        if self.produced + len(path) >= self.n:
            return row
        return row.detach().float().index_fill(-1, self.end, float("-inf"))

    def extend(self, tokens: Sequence[int]) -> None:
        self.produced += len(tokens)


def history_for(sp, prompt: Sequence[int], vocab_size: int, end_ids: Sequence[int] = ()) -> RowProcessing | None:
    """A sequence's row processing when its sampling parameters ask for any (penalties, logit
    bias, min_tokens before the `end_ids`, a grammar), else None."""
    parts = [TokenHistory(prompt, vocab_size, sp)] if sp.processes_logits else []
    if sp.min_tokens and end_ids:
        parts.append(MinTokens(sp.min_tokens, end_ids))
    if sp.grammar is not None:
        parts.append(sp.grammar.state(vocab_size))
    return RowProcessing(parts, vocab_size) if parts else None
