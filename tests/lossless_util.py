"""Helpers for the lossless chi-square tests (shared by the torch and ONNX Runtime suites)."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from arborspec.runtime import accept as accept_mod
from arborspec.runtime import step as step_mod
from arborspec.runtime.accept import Acceptance
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.kvcache import KVCache
from arborspec.runtime.sampling import SamplingParams, probs

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


def seed_rule_accept(logits, tree, sp, rng, root_probs=None, hooks=None):
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
        ok = accept_mod.coin(min(1.0, float(p[x] / q[x])), rng) if q[x] > 0 else False
        parent_ok = par < 0 or bool(accepted[par])
        accepted[i] = ok and parent_ok
        if not ok:
            res = torch.clamp(p - q, min=0)
            res = res / res.sum() if res.sum() > 0 else p
            resampled[i] = accept_mod.sample(res, rng)
    if bool(accepted.any()):
        deepest = int(torch.argmax(torch.where(accepted, tree.depth, -1)))
        path = tree.anc[deepest].nonzero().flatten()
        bonus = accept_mod.sample(p_rows[deepest + 1], rng)
        return Acceptance(path, tree.tokens[path].tolist() + [bonus])
    first = [i for i in range(n) if int(tree.parents[i]) < 0]
    return Acceptance(torch.zeros(0, dtype=torch.long), [resampled[first[-1]]])


class use_seed_rule:
    """Context manager: run the decode loop with the seed's accept rule."""

    def __enter__(self):
        self._orig = step_mod.accept
        step_mod.accept = seed_rule_accept

    def __exit__(self, *exc):
        step_mod.accept = self._orig


# ----------------------------------------------------------------------------------------------
# Exact output distributions: the decoder's random draws enumerated instead of sampled.
#
# Every random draw of the decoder goes through three primitives (runtime/sampling.py): `coin`
# (the accept rule's uniform test), `sample` (the bonus / corrected token) and `draw_candidates`
# (sampled tree children). `Enumeration` replaces them by choices it controls and re-runs the
# decoder once per outcome of the draws that matter, so the probability of every output comes
# from the code under test, not from counting samples. Draws that cannot change the output (the
# candidates drawn under a node the accept walk never reaches) stay at their first outcome: the
# accept walk reads only the children of the root and of accepted nodes, whose tokens and draft
# rows depend only on their ancestors (tree masks), so summing over those draws multiplies the
# output's probability by 1. Where the module of a primitive's caller moves, change it here.

from collections import defaultdict  # noqa: E402
from itertools import permutations, product  # noqa: E402

from arborspec.runtime.drafts import tree_builder as drafting_mod  # noqa: E402

# (module, attribute) of every call site of a random primitive, and of the accept walk
PRIMITIVE_SITES = {"coin": [accept_mod], "sample": [accept_mod], "draw_candidates": [drafting_mod]}
ACCEPT_SITE = (accept_mod, "accept_sampling")


def _alternatives_of_row(q: torch.Tensor, k: int, unique: bool):
    """The outcomes of drawing k candidates from one row q [V]: [(tokens, probability)]."""
    qd = q.double()
    qd = qd / qd.sum()
    support = [int(i) for i in torch.nonzero(qd > 0).flatten()]
    if not unique:
        return [(list(t), float(np.prod([qd[i] for i in t]))) for t in product(support, repeat=k)]
    zeros = [i for i in range(q.numel()) if qd[i] == 0]  # Gumbel-top-k puts q = 0 last
    out = []
    for t in permutations(support, min(k, len(support))):
        pr, left = 1.0, 1.0
        for i in t:
            pr *= float(qd[i]) / left
            left -= float(qd[i])
        out.append((list(t) + zeros[: k - len(t)], pr))
    return out


class _Run:
    """One execution: the keys it asked for (in order), their outcome probabilities, and the
    keys the output depends on."""

    def __init__(self, assign: dict, focus):
        self.assign, self.focus = assign, focus
        self.order: list = []
        self.probs: dict = {}
        self.relevant: set = set()
        self.rngs: dict = {}  # id(rng) -> ordinal of first use (stable across executions)
        self.step: dict = defaultdict(int)  # rng ordinal -> accept calls so far
        self.count: dict = defaultdict(int)  # (rng, step, kind) -> draws so far
        self._keep = []  # the rngs themselves, so their ids stay unique during the execution

    def _key(self, rng, kind):
        if id(rng) not in self.rngs:
            self.rngs[id(rng)] = len(self.rngs)
            self._keep.append(rng)
        r = self.rngs[id(rng)]
        s = self.step[r]
        i = self.count[(r, s, kind)]
        self.count[(r, s, kind)] += 1
        return (r, s, kind, i)

    def choose(self, key, alts):
        """alts [(value, probability)] -> the assigned (or first) value."""
        self.order.append(key)
        self.probs[key] = [pr for _, pr in alts]
        if kind_is_accept(key) and (self.focus is None or key[0] == self.focus):
            self.relevant.add(key)
        return alts[self.assign.get(key, 0)][0]

    # the primitives
    def coin(self, prob, rng):
        prob = min(1.0, max(0.0, float(prob)))
        alts = [(v, pr) for v, pr in ((True, prob), (False, 1.0 - prob)) if pr > 0]
        return self.choose(self._key(rng, "a"), alts)

    def sample(self, p, rng):
        pd = p.double()
        pd = pd / pd.sum()
        alts = [(int(i), float(pd[i])) for i in torch.nonzero(pd > 0).flatten()]
        return self.choose(self._key(rng, "a"), alts)

    def draw_candidates(self, q, k, rng, unique):
        rows = [self.choose(self._key(rng, "q"), _alternatives_of_row(row, k, unique)) for row in q]
        return torch.tensor(rows, dtype=torch.long).reshape(q.shape[0], k)

    def observe(self, tree, rng, acc):
        """After an accept walk: the draft rows it read (root's and accepted nodes' children)."""
        r = self.rngs.get(id(rng))
        if r is None:  # a step without any random draw so far
            self.rngs[id(rng)] = r = len(self.rngs)
            self._keep.append(rng)
        s = self.step[r]
        if tree.n and (self.focus is None or r == self.focus):
            kids = tree.children()
            for v in [-1] + [int(i) for i in acc.path]:
                if kids[v + 1] and int(tree.qrow[kids[v + 1][0]]) >= 0:
                    self.relevant.add((r, s, "q", int(tree.qrow[kids[v + 1][0]])))
        self.step[r] += 1


def kind_is_accept(key) -> bool:
    return key[2] == "a"


class Enumeration:
    """Context manager: within it, `distribution(run)` returns the exact distribution of
    run()'s (hashable) result under the decoder's randomness, as {result: probability}.

    focus: with several random generators in one run (a batch: one per sequence), enumerate
    only the draws of the focus-th generator to appear; the others keep their first outcome."""

    def __init__(self, focus: int | None = None, max_runs: int = 200_000):
        self.focus, self.max_runs = focus, max_runs
        self.runs = 0
        self._cur: _Run | None = None

    def __enter__(self):
        self._saved = []
        for name, mods in PRIMITIVE_SITES.items():
            for m in mods:
                self._saved.append((m, name, getattr(m, name)))
                setattr(m, name, lambda *a, _n=name, **kw: getattr(self._cur, _n)(*a, **kw))
        m, name = ACCEPT_SITE
        walk = getattr(m, name)
        self._saved.append((m, name, walk))

        def observed(logits, tree, sp, rng, *rest):
            acc = walk(logits, tree, sp, rng, *rest)
            self._cur.observe(tree, rng, acc)
            return acc

        setattr(m, name, observed)
        return self

    def __exit__(self, *exc):
        for m, name, orig in reversed(self._saved):
            setattr(m, name, orig)

    def _execute(self, run, assign) -> tuple:
        self.runs += 1
        if self.runs > self.max_runs:
            raise RuntimeError(f"more than {self.max_runs} executions: make the case smaller")
        self._cur = _Run(assign, self.focus)
        out = run()
        cur, self._cur = self._cur, None
        return out, cur

    def distribution(self, run, stop=None) -> dict:
        """stop: called with the partial distribution every 20 outcomes; True ends the
        enumeration early (the partial distribution is returned: a lower bound per output)."""
        dist: dict = defaultdict(float)
        stack = [({}, 1.0, None)]
        leaves = 0
        while stack:
            if stop is not None and leaves % 20 == 19 and stop(dist):
                break
            assign, weight, done = stack.pop()
            out, cur = done if done is not None else self._execute(run, assign)
            key = next((k for k in cur.order if k in cur.relevant and k not in assign), None)
            if key is None:
                dist[out] += weight
                leaves += 1
                continue
            for j, pr in enumerate(cur.probs[key]):
                stack.append(({**assign, key: j}, weight * pr, (out, cur) if j == 0 else None))
        return dict(dist)


def reference_penalties(row: torch.Tensor, prompt, out, sp: SamplingParams) -> torch.Tensor:
    """The request's penalties and logit bias on one row of logits, written plainly from their
    definitions (runtime/penalties.py's docstring), token by token in Python: the reference the
    runtime's vectorised, tree-path version is checked against. out: the tokens generated so far."""
    x = row.float().clone()
    for t, b in sp.logit_bias:  # the bias first (transformers' and vLLM's order)
        x[t] += b
    r = sp.repetition_penalty
    for t in set(prompt) | set(out):  # HF's repetition penalty: prompt and output
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):  # OpenAI's presence and frequency penalties: output only
        x[t] -= sp.presence_penalty + sp.frequency_penalty * list(out).count(t)
    return x


def plain_next_logits(engine, seq) -> torch.Tensor:
    """The target's logits after `seq`, from one causal call over all of it (no cache reuse)."""
    n = len(seq)
    cache = KVCache(engine.info.cache, n, 1)
    logits = engine.forward(
        torch.tensor([seq]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], cache
    )
    return logits[0, -1]


def exact_target_joint(engine, prompt, sp: SamplingParams, m: int) -> dict:
    """P(x_1..x_m) of the warped target (after the request's penalties, `reference_penalties`,
    where it has any), by enumeration of its support: {tuple: probability}."""

    def next_probs(seq, out):
        row = plain_next_logits(engine, seq)
        if sp.processes_logits:
            row = reference_penalties(row, prompt, out, sp)
        return probs(row, sp).double()

    level = {(): 1.0}
    for _ in range(m):
        nxt = {}
        for seq, pr in level.items():
            p = next_probs(list(prompt) + list(seq), seq)
            for x in torch.nonzero(p > 0).flatten().tolist():
                nxt[seq + (x,)] = pr * float(p[x])
        level = nxt
    return level


def marginal(dist: dict, m: int) -> dict:
    out: dict = defaultdict(float)
    for seq, pr in dist.items():
        out[tuple(seq[:m])] += pr
    return dict(out)


def complete_with_target(step: dict, target_joint: dict, m: int) -> dict:
    """The m-token distribution of: one speculative step (its outputs `step`, of any length),
    then the target alone for the tokens still missing. Equal to the target's joint iff the
    step is lossless (for these m tokens)."""
    prefix = {k: marginal(target_joint, k) for k in range(m + 1)}
    out: dict = defaultdict(float)
    for y, pr in step.items():
        y = tuple(y)
        if len(y) >= m:
            out[y[:m]] += pr
            continue
        base = prefix[len(y)].get(y, 0.0)
        if base == 0:  # the step emitted something the target never would: keep it visible
            out[y + (-1,) * (m - len(y))] += pr
            continue
        for x, px in target_joint.items():
            if x[: len(y)] == y:
                out[x] += pr * px / base
    return dict(out)


def excess(partial: dict, want: dict) -> float:
    """sum of max(0, partial - want): a lower bound of TV(full, want) for any partial
    distribution (probabilities still to come only add to it)."""
    return sum(max(0.0, pr - want.get(k, 0.0)) for k, pr in partial.items())


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


class memoized_forward:
    """Context manager: `module`'s forward answers repeated calls (same inputs, same past K/V)
    from a table, with the outputs the first call returned. The enumeration re-runs the decoder
    once per outcome and most of its model calls repeat; the answers are bitwise the same."""

    def __init__(self, *modules):
        self.modules = modules

    def __enter__(self):
        for mod in self.modules:
            table: dict = {}
            orig = mod.forward

            def forward(*args, _orig=orig, _table=table):
                key = tuple(
                    (a.dtype, tuple(a.shape), a.cpu().contiguous().numpy().tobytes())
                    if isinstance(a, torch.Tensor)
                    else a
                    for a in args
                )
                if key not in _table:
                    _table[key] = _orig(*args)
                return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in _table[key])

            mod.forward = forward
        return self

    def __exit__(self, *exc):
        for mod in self.modules:
            del mod.forward


# ----------------------------------------------------------------------------------------------
# The draft kinds of the exact tests, built in one place (their modules may move).

DRAFT_KINDS = ("model", "lookup", "eagle3", "mixed")


def make_draft(kind: str, target_module, folder, vocab: int):
    """A draft source of `kind` for a tiny target module (the eagle3 and mixed kinds need the
    module's `feature_layers` set and write a random EAGLE-3 checkpoint under `folder`)."""
    from conftest import truncated

    from arborspec.runtime.drafts.lookup import LookupDraft
    from arborspec.runtime.drafts.model import ModelDraft

    if kind == "model":
        return ModelDraft(TorchEngine(truncated(target_module, 1)))
    if kind == "lookup":
        return LookupDraft(vocab, max_ngram=2)
    from arborspec.runtime.drafts.spec import SuffixOptions
    from arborspec.runtime.drafts.suffix import SuffixDraft, SuffixMixDraft

    suffix = SuffixDraft(vocab, SuffixOptions(nodes=3, alpha=2.0, min=1))  # the PROMPT repeats "1 3"
    if kind == "suffix":
        return suffix
    if kind == "model+suffix":
        return SuffixMixDraft(ModelDraft(TorchEngine(truncated(target_module, 1))), suffix)
    from test_eagle3 import _draft as eagle3_draft

    head = eagle3_draft(target_module, folder, draft_vocab=vocab - 2, seed=2, scale=0.3)
    if kind == "eagle3":
        return head
    if kind == "eagle3+suffix":
        return SuffixMixDraft(head, suffix)
    from arborspec.runtime.drafts.mixed import LookupMixDraft

    return LookupMixDraft(head, LookupDraft(vocab, max_ngram=2))


def draft_modules(draft) -> list:
    """The torch modules a draft source runs (what `memoized_forward` wraps)."""
    out = []
    for src in (draft, getattr(draft, "base", None)):
        eng = getattr(src, "engine", None)
        for name in ("module", "head"):
            mod = getattr(eng, name, None)
            if isinstance(mod, torch.nn.Module) and all(mod is not o for o in out):
                out.append(mod)
    return out


def first_step(dec, prompt, n: int) -> tuple:
    """The tokens of a decoder's first step (up to n)."""
    it = dec.stream(prompt, n)
    try:
        return tuple(next(it))
    finally:
        it.close()
