"""Accept/reject over a verified tree: greedy, and lossless sampling.

Role in one decoding step: step 4. Given the target's logits for [root, nodes...] (one
verify call), choose the committed tokens: the longest accepted root-to-leaf path plus one
token from the target (the bonus token at the end of the path, or the corrected token where
the walk stopped).

Greedy (temperature 0): a node is accepted when its token is the target's argmax at its
parent and its parent is accepted; the deepest accepted node ends the path. This reproduces
vanilla greedy decoding token for token. Fully vectorised.

Sampling: a walk from the root; at each node the children are tried in order with the
residual distribution updated after every rejection, so that the token finally emitted at
each position is an exact sample of the (warped) target distribution:
  * `sample`        candidates drawn i.i.d. from the draft q (with replacement): multi-round
                    speculative sampling of SpecInfer (Miao et al., 2024, Alg. "MSS"):
                    accept x with min(1, p(x)/q(x)); on rejection p <- norm(max(0, p - q)).
  * `sample-unique` candidates drawn without replacement: recursive rejection sampling
                    (Yang et al., 2024, "Multi-Draft Speculative Sampling"; Jeon et al., 2024,
                    "Recursive Speculative Decoding"): as above, and q <- q with x removed,
                    renormalised.
  * `topk`          deterministic candidates (top-k, beam, dynamic, static trees): the draft
                    is a point mass on each candidate, so accept x with probability p(x); on
                    rejection p <- p with x zeroed, renormalised (as in EAGLE's tree sampling).
When no child is accepted, the next token is drawn from the final residual p.

The seed write-up instead accepts every sibling independently with min(1, p/q) against the
unmodified p and resamples each rejection from max(0, p - q): with several siblings (or with
top-k rather than sampled drafts) its output is NOT the target distribution; the tests show
it failing the chi-square test that these rules pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import SamplingParams, coin, probs, sample
from .trees import Tree


@dataclass(frozen=True)
class RowHooks:
    """What the sampled walk does to each row of logits it reads: check(row), the decoder's
    guard (NaN/Inf is a NumericalError there), before it becomes probabilities; then
    process(row, path_tokens), the request's penalties and grammar (penalties.RowProcessing)
    given the tokens accepted so far in this step. None: nothing."""

    check: Callable | None = None
    process: Callable | None = None


NO_HOOKS = RowHooks()


@dataclass
class Acceptance:
    path: torch.Tensor  # accepted node indices, root excluded, in order
    tokens: list[int]  # tokens of the path + the bonus / corrected token


def accept_greedy(logits: torch.Tensor, tree: Tree, process=None) -> Acceptance:
    """logits [T, V] for [root, nodes...]. Walks down from the root: at each accepted node the
    target's argmax picks the (unique) matching child. Only the rows on the accepted path are
    reduced (depth + 1 argmaxes, not T): on CPU that is most of the accept cost. On a GPU
    all T argmaxes are taken on the device and copied once (one host transfer).
    process(row, path_tokens): the row after the request's penalties and grammar
    (penalties.RowProcessing), given the tokens accepted so far in this step; then each row read
    is processed on the host."""
    toks = tree.tokens.tolist() if tree.n else []
    if process is not None:
        path_tokens: list[int] = []  # the walk's accepted tokens so far (the row's own path)
        best = lambda row: int(process(logits[row].float().cpu(), path_tokens).argmax())  # noqa: E731
    elif logits.device.type != "cpu":
        best_all = logits.argmax(-1).tolist()
        best = best_all.__getitem__
    else:  # numpy's argmax is SIMD: about 13x torch's on one 49k row (3.4 vs 45 us measured)
        rows = logits.float().numpy()
        best = lambda row: int(rows[row].argmax())  # noqa: E731
    kids = tree.children() if tree.n else None
    node, path = -1, []
    while True:
        a = best(node + 1)
        if kids is None:
            break
        nxt = next((c for c in kids[node + 1] if toks[c] == a), None)
        if nxt is None:
            break
        node = nxt
        path.append(node)
        if process is not None:
            path_tokens.append(a)
    return Acceptance(torch.tensor(path, dtype=torch.long), [toks[i] for i in path] + [a])


def accept_sampling(
    logits: torch.Tensor,
    tree: Tree,
    sp: SamplingParams,
    rng: torch.Generator,
    root_probs=None,
    hooks: RowHooks = NO_HOOKS,
) -> Acceptance:
    """Lossless walk for temperature > 0; the rule follows tree.candidates. root_probs: the root
    row's `probs(logits[0], sp)` when computed already (a batch's rows in one call). hooks:
    each row the walk reads is checked (hooks.check, on the host) and processed (hooks.process,
    as accept_greedy's process) before it is warped; the rows it never reads are not summed
    (a 15-row tree's 2.9 MB of logits cost 0.38 ms a step to check whole, cold after the verify
    call), and a GPU's row is checked in its host copy (no device sync of its own)."""
    check, process = hooks.check, hooks.process
    mode = tree.candidates
    kids = tree.children() if tree.n else None
    node = -1
    path: list[int] = []
    tokens: list[int] = []
    while True:
        if node == -1 and root_probs is not None:
            p = root_probs.float().cpu()
        else:
            row = logits[node + 1].float().cpu()
            if check is not None:
                check(row)
            if process is not None:
                row = process(row, tokens)  # the tokens accepted so far: this row's path
            p = probs(row, sp)
        children = kids[node + 1] if kids is not None else []
        q = None
        if children and mode != "topk":
            q = tree.q[tree.qrow[children[0]]].clone()
        chosen = -1
        for c in children:
            x = int(tree.tokens[c])
            if mode == "topk":
                if coin(float(p[x]), rng):
                    chosen = c
                    break
                p[x] = 0.0
                p = _renorm(p)
            else:
                qx = float(q[x])
                if qx > 0 and coin(min(1.0, float(p[x]) / qx), rng):
                    chosen = c
                    break
                if qx > 0:
                    p = _renorm(torch.clamp(p - q, min=0.0), fallback=p)
                if mode == "sample-unique":
                    q[x] = 0.0
                    q = _renorm(q)
        if chosen < 0:
            tokens.append(sample(p, rng))
            return Acceptance(torch.tensor(path, dtype=torch.long), tokens)
        path.append(chosen)
        tokens.append(int(tree.tokens[chosen]))
        node = chosen


def _renorm(p: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    s = float(p.sum())
    if s <= 1e-12:  # only reachable through rounding (the residual of p == q)
        return fallback if fallback is not None else p
    return p / s


def accept(
    logits: torch.Tensor,
    tree: Tree,
    sp: SamplingParams,
    rng: torch.Generator,
    root_probs=None,
    hooks: RowHooks = NO_HOOKS,
) -> Acceptance:
    """hooks: the row check (sampled walk only: the greedy caller checks the rows it read) and
    the request's penalties and grammar, row by row (RowHooks)."""
    if sp.greedy:
        return accept_greedy(logits, tree, hooks.process)
    return accept_sampling(logits, tree, sp, rng, root_probs, hooks)
