"""Building one step's tree from a draft source: the level loop.

Role in one decode step: step 1. `draft_tree` asks the draft source for the root's
distribution, then expands the tree level by level under a policy, ONE draft call per level
over the frontier. Fixed-shape policies (chain, full, static) with top-k candidates follow
their `TreePlan` (runtime/tree_plan.py): per level one top-k where the logits are and one
gather into the plan's token slots, nothing else. Data-dependent trees (beam, dynamic, sampled
candidates, table drafts whose rows may be empty) are built in a preallocated `TreeWorkspace`
reused every step.

The level loop is written as a generator of `DraftCall` requests (`tree_builder`): `draft_tree`
answers each request at once with the sequence's own draft source; a batch driver
(runtime/batch_decode.py) gathers one request from every sequence and answers them all with one
draft call (runtime/drafts/batched.py), so B trees cost one draft call per level.

Candidates: `topk` (deterministic: the policy's top children), `sample` (i.i.d. draws from the
draft, with replacement) or `sample-unique` (draws without replacement, by the Gumbel-top-k
trick). The accept rule must match (runtime/accept.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from ..sampling import SamplingParams, draw_candidates, probs, warp_logits
from ..tree_plan import PLANNED_KINDS, plan_for
from ..trees import CANDIDATE_MODES, Tree, TreePolicy
from .base import DraftSource, NodeView, full_vocab, to_target, topk_of, tree_capacity
from .proposed import ProposingPolicy, build_proposed


@dataclass
class DraftCall:
    """One draft call the level loop needs: the root's distribution ("start") or the frontier's
    ("expand"); k None: full logits rows, else the top-k (log-probs with `logprobs`)."""

    kind: str  # "start" | "expand"
    root: int = 0
    nodes: NodeView | None = None
    frontier: torch.Tensor | None = None
    k: int | None = None
    logprobs: bool = False


def answer(draft: DraftSource, call: DraftCall):
    """A draft call answered by one sequence's draft source: logits [V] / [F, V] or a TopK."""
    if call.kind == "start":
        if call.k is None:
            return draft.start(call.root)
        return draft.start_topk(call.root, call.k, call.logprobs)
    if call.k is None:
        return draft.expand(call.nodes, call.frontier)
    return draft.expand_topk(call.nodes, call.frontier, call.k, call.logprobs)


class TreeWorkspace:
    """Per-step node buffers of capacity `cap` (numpy: the bookkeeping of a few dozen nodes costs
    a tenth as much as with torch ops), allocated once and reused."""

    def __init__(self, cap: int):
        self.cap = cap
        self.tokens = np.zeros(cap, dtype=np.int64)
        self.parents = np.zeros(cap, dtype=np.int64)
        self.depth = np.zeros(cap, dtype=np.int64)
        self.score = np.zeros(cap, dtype=np.float32)
        self.qrow = np.full(cap, -1, dtype=np.int64)
        self.anc = np.zeros((cap, cap), dtype=bool)
        self.arange = np.arange(cap, dtype=np.int64)

    @staticmethod
    def get(ws: "TreeWorkspace | None", cap: int) -> "TreeWorkspace":
        return ws if ws is not None and ws.cap >= cap else TreeWorkspace(cap)

    def append(self, n: int, level: int, parents, tokens, scores) -> int:
        """Append nodes at `level` after the first n: their parents (-1: the root), tokens,
        cumulative scores and ancestor rows. -> the new node count."""
        m = parents.size
        new = self.arange[n : n + m]
        self.tokens[n : n + m], self.parents[n : n + m], self.depth[n : n + m] = tokens, parents, level
        self.score[n : n + m] = scores
        anc = self.anc
        anc[n : n + m] = False
        has_par = parents >= 0
        anc[new[has_par]] = anc[parents[has_par]]
        anc[new, new] = True
        return n + m


@dataclass(frozen=True)
class DraftOptions:
    """How one sequence's step drafts its tree, besides the draft, policy, root and sampling (the
    decoders build one a step)."""

    candidates: str = "topk"  # topk | sample | sample-unique (sampled only at temperature > 0)
    rng: torch.Generator | None = None  # the sequence's random generator (sampled candidates)
    # keep the draft distributions for top-k candidates too (analysis and tests; the sampled
    # modes always keep them, the accept rule needs them)
    keep_q: bool = False
    workspace: TreeWorkspace | None = None  # node buffers reused every step (None: a new one)
    out_vocab: int | None = None  # the target's vocabulary, when the draft's rows are over a reduced one
    # the sequence's penalties.RowProcessing when its request has penalties or a grammar: the
    # draft's rows are processed along each node's path before candidates are chosen (full rows,
    # no fused top-k)
    history: object = None


DEFAULT_OPTIONS = DraftOptions()


@torch.inference_mode()
def draft_tree(
    draft: DraftSource, policy: TreePolicy, root: int, sp: SamplingParams, opts: DraftOptions = DEFAULT_OPTIONS
) -> Tree:
    """Build one step's tree: D levels, one draft call per level over the frontier; opts: the
    candidates, random generator, workspace ... (DraftOptions)."""
    builder = tree_builder(draft, policy, root, sp, opts)
    try:
        call = next(builder)
        while True:
            call = builder.send(answer(draft, call))
    except StopIteration as done:
        return done.value


def tree_builder(
    draft: DraftSource, policy: TreePolicy, root: int, sp: SamplingParams, opts: DraftOptions = DEFAULT_OPTIONS
):
    """draft_tree's level loop as a generator: yields DraftCalls, is sent their answers, and
    returns the Tree (StopIteration.value). Run it inside torch.inference_mode()."""
    candidates = opts.candidates
    if candidates not in CANDIDATE_MODES:
        raise InputError(f"unknown candidate mode {candidates!r} (expected one of {', '.join(CANDIDATE_MODES)})")
    if isinstance(policy, ProposingPolicy):  # a draft that proposes its own tree (drafts/proposed.py)
        return (yield from build_proposed(draft, policy, root, lambda base: tree_builder(draft, base, root, sp, opts)))
    sampled = candidates != "topk" and not sp.greedy
    if sampled and policy.data_dependent:
        raise InputError(f"tree policy {policy.kind} ranks candidates by score: use --candidates topk with it")
    if not sampled and policy.kind in PLANNED_KINDS and draft.finite_logits:
        return (yield from _draft_planned(draft, policy, root, sp, opts))
    return (yield from _draft_dynamic(draft, policy, root, sp, candidates if sampled else "topk", opts))


def _paths(tokens: torch.Tensor, anc: torch.Tensor, frontier) -> list:
    """The target-id tokens from the root's child down to each frontier node (its ancestors and
    itself, in level order): the tree part of that node's history for the penalties."""
    return [tokens[anc[int(f)]].tolist() for f in frontier]


def _draft_planned(draft, policy, root, sp, opts: DraftOptions) -> Tree:
    keep_q, history, out_vocab = opts.keep_q, opts.history, opts.out_vocab or draft.vocab_size
    plan = plan_for(policy, draft.vocab_size)
    tmap = draft.token_map
    tokens = torch.zeros(plan.n, dtype=torch.long)
    qs: list[torch.Tensor] = []
    qrow = torch.full((plan.n,), -1, dtype=torch.long)
    n_q = 0
    levels = plan.levels
    k0 = levels[0].k
    rows = keep_q or history is not None  # full rows (else the source's top-k, maybe fused)
    out = yield DraftCall("start", root, k=None if rows else k0)
    if rows:
        out = out[None]
        if history is not None:
            out = history.process_draft(out, [[]], tmap)
    calls = 1
    last = len(levels) - 1
    for li, lv in enumerate(levels):
        toks = torch.topk(out, lv.k, dim=-1).indices if rows else out.indices[:, : lv.k]
        if keep_q:
            qs.append(full_vocab(torch.softmax(warp_logits(out.float(), sp), -1), tmap, out_vocab).cpu())
            qrow[lv.start : lv.end] = n_q + lv.rows
            n_q += out.shape[0]
        tokens[lv.start : lv.end] = to_target(toks, tmap).cpu()[lv.rows, lv.ranks]
        if li == last or lv.frontier.numel() == 0:
            break
        e = lv.end
        nodes = NodeView(tokens[:e], plan.depth[:e], plan.parents[:e], plan.anc[:e, :e])
        nk = levels[li + 1].k
        out = yield DraftCall("expand", nodes=nodes, frontier=lv.frontier, k=None if rows else nk)
        if history is not None:
            out = history.process_draft(out, _paths(tokens, plan.anc, lv.frontier), tmap)
        calls += 1
    tree = Tree(
        tokens,
        plan.parents,
        plan.depth,
        torch.zeros(plan.n),
        plan.anc,
        plan.origin,
        qrow,
        torch.cat(qs) if qs else None,
        "topk",
        calls,
    )
    tree.plan = plan
    return tree


def _draft_dynamic(draft, policy, root, sp, mode: str, opts: DraftOptions) -> Tree:
    keep_q, history = opts.keep_q, opts.history
    vocab = draft.vocab_size
    ws = TreeWorkspace.get(opts.workspace, tree_capacity(policy, vocab))
    tmap = draft.token_map
    # no full rows needed: the source may fuse top-k (not with penalties: they process the rows)
    topk_only = mode == "topk" and not keep_q and history is None
    logprobs = policy.data_dependent
    qs: list[torch.Tensor] = []
    n_q = 0
    n = 0
    k = min(policy.width(1), vocab)
    out = yield DraftCall("start", root, k=k if topk_only else None, logprobs=logprobs)
    if not topk_only:
        out = out[None].float()
        if history is not None:
            out = history.process_draft(out, [[]], tmap)
    calls = 1
    frontier = np.array([-1], dtype=np.int64)
    f_score = np.zeros(1, dtype=np.float32)
    for level in range(1, policy.depth + 1):
        k = min(policy.width(level), vocab)
        if topk_only:
            vals, toks, q = out.values[:, :k], out.indices[:, :k], None
        else:
            vals, toks, q = _candidates(out, k, mode, sp, opts, draft)
        if q is not None:
            qs.append(q)
        fi, ci, scores = _kept(policy, level, f_score, vals)
        m = fi.size
        n = ws.append(n, level, frontier[fi], to_target(toks, tmap).cpu().numpy()[fi, ci], scores)
        if qs:
            ws.qrow[n - m : n] = n_q + fi
            n_q += frontier.size
        expand = policy.expand(level, ws.score[n - m : n]) if m else np.zeros(0, dtype=bool)
        frontier, f_score = ws.arange[n - m : n][expand], ws.score[n - m : n][expand]
        if level == policy.depth or frontier.size == 0:
            break
        nodes = NodeView(
            torch.from_numpy(ws.tokens[:n]),
            torch.from_numpy(ws.depth[:n]),
            torch.from_numpy(ws.parents[:n]),
            torch.from_numpy(ws.anc[:n, :n]),
        )
        fr = torch.from_numpy(frontier)
        if topk_only:
            out = yield DraftCall(
                "expand", nodes=nodes, frontier=fr, k=min(policy.width(level + 1), vocab), logprobs=logprobs
            )
        else:
            out = (yield DraftCall("expand", nodes=nodes, frontier=fr)).float()
            if history is not None:
                out = history.process_draft(out, _paths(nodes.tokens, nodes.anc, frontier), tmap)
        calls += 1
    return _final_tree(ws, policy, n, qs, mode, calls)


def _candidates(out, k: int, mode: str, sp, opts: DraftOptions, draft):
    """One level's candidates from the draft's full rows `out` [F, V]: (values [F, k] log-probs
    or logits, draft ids [F, k], the rows' draft distribution q over the target vocabulary).
    Sampled candidates come from q = softmax(warp(scale * logits)): the draft's sample_scale."""
    rng, tmap, scale = opts.rng, draft.token_map, draft.sample_scale
    out_vocab = opts.out_vocab or draft.vocab_size
    if mode == "topk":
        # deterministic candidates: the draft's top-k by raw logits (the ranking does not
        # depend on the temperature; top-k/top-p only mask a tail that the accept rule
        # handles), normalised to log-probs (keep_q: analysis and tests)
        t = topk_of(out, k, True)
        return t.values, t.indices, full_vocab(torch.softmax(warp_logits(out, sp), -1), tmap, out_vocab).cpu()
    x = out * scale if scale != 1.0 else out
    if x.device.type == "cpu" and bool(torch.isfinite(x.amax(-1)).all()):
        # every row has a finite maximum: q in numpy (sampling._probs_rows, the same q as below
        # in a third of the time), the unique draws over its nucleus (draw_candidates)
        q = probs(x, sp)
        toks = draw_candidates(q, k, rng, unique=mode == "sample-unique")
        return torch.log(q.gather(1, toks)), toks, full_vocab(q, tmap, out_vocab)
    warped = warp_logits(x, sp)
    # a table draft may have no opinion at a node (every logit -inf): no candidates there
    empty = ~torch.isfinite(warped).any(-1, keepdim=True)
    q = torch.softmax(warped.masked_fill(empty, 0.0), -1)
    toks = draw_candidates(q, k, rng, unique=mode == "sample-unique")
    vals = torch.log(q.gather(1, toks)).masked_fill(empty, float("-inf"))  # the k drawn, not the row
    return vals, toks, full_vocab(q.masked_fill(empty, 0.0), tmap, out_vocab).cpu()


def _kept(policy, level: int, f_score, vals):
    """The candidates `vals` [F, k] the policy keeps at `level` below frontier scores f_score [F]:
    (each kept one's frontier row, its column, its cumulative score)."""
    vals = vals.float().cpu().numpy()
    scores = f_score[:, None] + vals
    keep = policy.select(level, scores)
    if policy.kind != "static":  # a fixed structure keeps its shape; others drop q = 0
        keep &= np.isfinite(vals)
    fi, ci = np.nonzero(keep)
    return fi, ci, scores[fi, ci]


def _final_tree(ws: TreeWorkspace, policy, n: int, qs: list, mode: str, calls: int) -> Tree:
    """The policy's final pruning of the workspace's n nodes, as a Tree (parents renumbered)."""
    keep = policy.finalize(ws.score[:n], ws.depth[:n])
    idx = ws.arange[:n] if keep is None else np.nonzero(keep)[0]  # ancestor-closed, in order
    par = ws.parents[idx]
    if keep is not None:  # renumber parents after the final pruning
        remap = np.full(n, -1, dtype=np.int64)
        remap[idx] = np.arange(idx.size)
        par = np.where(par >= 0, remap[np.maximum(par, 0)], par)
    return Tree(
        torch.from_numpy(ws.tokens[idx]),
        torch.from_numpy(par),
        torch.from_numpy(ws.depth[idx]),
        torch.from_numpy(ws.score[idx]),
        torch.from_numpy(ws.anc[np.ix_(idx, idx)]),
        torch.from_numpy(idx.copy()),
        torch.from_numpy(ws.qrow[idx]) if qs else torch.full((idx.size,), -1, dtype=torch.long),
        torch.cat(qs) if qs else None,
        mode,
        calls,
    )
