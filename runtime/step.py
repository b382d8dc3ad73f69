"""The steps both decoders share: SpeculativeDecoder (runtime/decode.py, one sequence) and
BatchDecoder (runtime/batch_decode.py, a batch) run the same five steps through these.

Step 0 `open_sequence` (a request checked: `check_prompt`, `check_logprobs`, `seeded_rng`, and
made a `SequenceState`); step 1 where a grammar decides `forced_chain`, else the draft's tree
when it fits the context (`tree_fits`); step 3 `verify` (ONE target call); step 4 `settle`
(accept, cut at the end ids / budget by `truncate`, the tokens' log-probs: `step_result`,
`token_logprobs`; the prompt's: `prompt_scorer`); step 5 for the draft `tell_draft`. Around a
whole generation, `host_threads` (torch's threads for the host work while an engine runs).
"""

from __future__ import annotations

import operator
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .accept import NO_HOOKS, RowHooks, accept
from .errors import InputError
from .guards import check_logits
from .penalties import RowProcessing, history_for
from .request import GenerationRequest, GenerationResult, StepResult
from .sampling import SamplingParams
from .stats import GenerationStats
from .trees import Tree


@contextmanager
def host_threads(engine):
    """torch's intra-op threads for the decoder's host-side work (sampling, accept, tree
    building) while `engine` runs: its `host_threads` (ONNX Runtime on CPU: 1, as its own
    thread pool owns the cores; ARBORSPEC_HOST_THREADS overrides, 0 leaves torch alone), the
    caller's setting restored afterwards. Why one: torch's own threads, woken between ONNX
    Runtime calls, compete with ONNX Runtime's pool for the same cores, and the host work
    (sampling over the vocabulary) runs several times slower than on one thread (figures:
    benchmarks/history/measurements.md, "Figures moved out of docstrings")."""
    n = engine.caps.host_threads
    old = torch.get_num_threads()
    if not n or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# a grammar's forced tokens (structured output, tool calls) are verified as one chain in place of
# the drafted tree when there are at least MIN_FORCED of them, at most MAX_FORCED a step
MIN_FORCED, MAX_FORCED = 2, 16


@dataclass(eq=False)
class SequenceState:
    """Where one sequence of either decoder stands between steps: its request as the steps read
    it (sampling, random generator, the ids that end it, its penalties / grammar) and what it has
    produced. Made by `open_sequence`, advanced by each step's StepResult (`advance`)."""

    request: GenerationRequest
    prompt: list[int]
    sampling: SamplingParams
    rng: torch.Generator
    eos: set
    stats: GenerationStats
    root: int = 0  # the last committed token, not yet in the target's cache
    produced: int = 0
    done: bool = False
    stop_reason: str = "length"
    tokens: list = field(default_factory=list)
    logprobs: int | None = None  # top log-probs asked for (None: none)
    token_logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # with prompt_logprobs=k: the prompt's (prompt_scorer)
    history: RowProcessing | None = None  # its penalties / grammar along each row's path (None: none)
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def room(self) -> int:
        """Tokens the answer may still take."""
        return self.request.max_new_tokens - self.produced

    def advance(self, step: StepResult, tree: Tree) -> None:
        """Step 5's bookkeeping: the step's tokens (and log-probs) appended, its stats recorded."""
        self.tokens += step.tokens
        self.token_logprobs += step.logprobs
        self.produced += len(step.tokens)
        self.root = step.tokens[-1]
        self.stats.record_step(tree.n, tree.draft_calls, len(step.tokens), time.perf_counter() - self.t_start)
        if step.stop_reason:
            self.done, self.stop_reason = True, step.stop_reason

    def result(self) -> GenerationResult:
        """The generation so far (its lists are the sequence's own: they grow with it)."""
        lps = self.token_logprobs if self.logprobs is not None else None
        return GenerationResult(self.tokens, self.stats, self.stop_reason, lps, self.prompt_logprobs)


def open_sequence(cls, request: GenerationRequest, decoder, sampling: SamplingParams):
    """Step 0 of either decoder: a request checked (one-line errors) and made a sequence of `cls`
    (a SequenceState) for `decoder` (its target's info, mode and tree policy); `sampling`: the
    decoder's default where the request has none -> (the sequence; the prefill's on_logits
    callback for the prompt's log-probs, or None)."""
    info, policy = decoder.target.info, decoder.policy
    prompt = check_prompt(info, request.prompt, request.max_new_tokens)
    on_logits, prompt_lps = prompt_scorer(prompt, check_logprobs(request.prompt_logprobs))
    sp = request.sampling or sampling
    eos = {int(e) for e in request.eos_token_ids or ()}
    st = GenerationStats(mode=decoder.mode, tree=policy.spec if policy else "", prompt_tokens=len(prompt))
    seq = cls(request, prompt, sp, seeded_rng(request.seed), eos, st, root=prompt[-1])
    seq.history = history_for(sp, prompt, info.vocab_size, eos)
    seq.logprobs, seq.prompt_logprobs = check_logprobs(request.logprobs), prompt_lps
    return seq, on_logits


# ---------------------------------------------------------------------- the steps both decoders share
def tree_fits(policy, length: int, max_position: int) -> bool:
    """Whether a tree of `policy` may be verified after `length` committed tokens: its rows sit at
    columns [length, length + nodes + 1), and GroupQueryAttention's rotary cache ends at
    max_position (ONNX Runtime refuses a call past it, although the tree's positions stay below)."""
    return policy is not None and length + policy.max_nodes + 1 <= max_position


def seeded_rng(seed) -> torch.Generator:
    """A request's random generator (its sampled draws and accept coins), seeded with `seed`: an
    integer in torch's range [-2**63, 2**64); one InputError line for anything else."""
    try:
        s = operator.index(seed)
    except TypeError:
        raise InputError(f"seed must be an integer, got {seed!r}") from None
    if not -(2**63) <= s < 2**64:
        raise InputError(f"seed must lie in [-2**63, 2**64), got {s}")
    return torch.Generator().manual_seed(s)


MAX_LOGPROBS = 20  # alternatives a token's log-probs may list (OpenAI's top_logprobs limit)


def check_logprobs(k) -> int | None:
    """None (no log-probs) or the number of alternatives, 0..MAX_LOGPROBS; one InputError line else."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise InputError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
    return k


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[tuple]:
    """Step 4's by-product for a caller that asked for log-probs: each new token's log-prob under
    the target's distribution at the row that predicted it (`rows` [n, V]: the verify call's raw
    logits, no temperature or top-k/p, as OpenAI and vLLM report) and the k most likely tokens
    there -> [(token, logprob, [(token, logprob), ...]), ...]."""
    lp = torch.log_softmax(rows.float(), -1).cpu()
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    top = lp.topk(k, -1) if k else None
    return [
        (t, chosen[j], list(zip(top.indices[j].tolist(), top.values[j].tolist())) if k else [])
        for j, t in enumerate(tokens)
    ]


def prompt_scorer(prompt: list[int], k: int | None):
    """The prompt's log-probs as the prefill computes its rows (a caller that asked for
    prompt_logprobs=k) -> (an on_logits callback for causal_prefill, or None; the list it fills:
    [(first token, None, [])] as it has no row, then token_logprobs' entries for the others)."""
    if k is None:
        return None, None
    out = [(prompt[0], None, [])]

    def on_logits(s: int, rows: torch.Tensor) -> None:  # row j predicts prompt[s + j + 1]
        out.extend(token_logprobs(rows, prompt[s + 1 : s + 1 + len(rows)], k))

    return on_logits, out


def check_prompt(info, prompt_ids, max_new_tokens) -> list[int]:
    """A request's prompt as a list of ids, checked against the engine's `info` (one-line errors)."""
    try:
        prompt = [int(t) for t in prompt_ids]
    except (TypeError, ValueError):
        raise InputError("prompt ids must be integers") from None
    if not prompt:
        raise InputError("empty prompt: give at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    v = info.vocab_size
    bad = [t for t in prompt if not 0 <= t < v]
    if bad:
        raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {v})")
    if len(prompt) > info.max_position:
        raise InputError(f"prompt of {len(prompt)} tokens is beyond the model's max context of {info.max_position}")
    return prompt


def forced_chain(history, room: int, past: int, info, cap: int) -> Tree | None:
    """Step 1 where a grammar decides: the tokens the sequence's grammar forces next (a JSON
    schema's keys and punctuation, a tool call's opening; `history`: its penalties.RowProcessing)
    as a chain in place of the drafted tree, when there are at least MIN_FORCED; at most `cap`,
    the answer's budget `room` - 1 and what the context and the engine's call hold. Every one is
    accepted unless the constrained target tokenizes the same text otherwise: exact either way,
    the verify call decides. None: draft as usual."""
    if history is None:
        return None
    k = min(cap, room - 1, info.max_position - past - 2)
    if info.max_tokens is not None:
        k = min(k, info.max_tokens - 1)
    forced = history.forced()[: max(k, 0)]
    return Tree.chain(forced) if len(forced) >= MIN_FORCED else None


def tell_draft(draft, root: int, tree: Tree, path, keep: list[int], feats) -> None:
    """Step 5 for the draft: it keeps the accepted path of a tree it drafted (`commit`); a forced
    chain it did not draft reaches it as committed tokens (`defer`: the root and the accepted
    nodes, each with its verify row's features `feats[keep[j]]`), run at its next start."""
    if not tree.forced:
        draft.commit(tree, path, feats)
        return
    for j, t in enumerate([root] + tree.tokens[path].tolist()):
        draft.defer(int(t), feats[keep[j] : keep[j] + 1] if feats is not None else None)


def verify(engine, ids, pos, mask, cache, features: bool):
    """Step 3: ONE target call over the flattened trees -> (logits [B, T, V], the target's
    features [B, T, F] when the draft reads them, else None)."""
    if features:
        return engine.forward_features(ids, pos, mask, cache)
    return engine.forward(ids, pos, mask, cache), None


def settle(logits, tree: Tree, seq: SequenceState, name: str, root_probs=None, root=None) -> StepResult:
    """Step 4 for one sequence: accept over its rows `logits` [>= tree.n + 1, V] (checked
    finite where read) with the sequence's sampling, random generator and history, cut at its
    end ids / token budget -> StepResult (new tokens, the accepted path to commit: node indices,
    root excluded, the last token left out as the next root, stop reason or None; the tokens'
    log-probs when the request asked). name: the engine's, for a non-finite row's error.
    root_probs: the root row's warped probabilities when the caller computed them already (a
    batch's, in one call on its device). root: (argmax, finite) of the root row of a call
    without a tree, when the caller reduced it already (guards.root_reductions: a batch's rows at
    once); `logits` are read then only to name a non-finite row's fault. With a history (the
    request has penalties, a logit bias or structured output: each row read is processed along
    its path; the new tokens join it) the caller's root_probs / root argmax are of unprocessed
    rows, and not used."""
    sampling, history, step_no = seq.sampling, seq.history, seq.stats.steps + 1
    process = None
    if history is not None:
        process, root_probs = history.process, None
        if root is not None and root[1]:
            root = None  # a finite root row: the walk reads it, processed
    if root is not None:
        if tree.n:
            raise ValueError("settle: root reductions are for calls without a tree")
        if not root[1]:
            check_logits(logits[:1], None, step_no, name)  # raises, naming NaN or Inf
        if sampling.greedy:
            new, stop = truncate([root[0]], seq.eos, seq.room)
            return step_result(logits, new, NO_PATH, stop, seq.logprobs)
    check = None
    if not sampling.greedy and root is None:  # the sampled walk checks each row as it reads it
        check = lambda row: check_logits(row[None], None, step_no, name)  # noqa: E731
    hooks = RowHooks(check, process) if check is not None or process is not None else NO_HOOKS
    acc = accept(logits[: tree.n + 1], tree, sampling, seq.rng, root_probs, hooks)
    if sampling.greedy:  # the rows the greedy walk read: the accepted path's and the next token's
        check_logits(logits, [0] + [i + 1 for i in acc.path.tolist()], step_no, name)
    new, stop = truncate(acc.tokens, seq.eos, seq.room)
    if history is not None:
        history.extend(new)
    return step_result(logits, new, acc.path[: len(new) - 1], stop, seq.logprobs)


def step_result(logits, tokens: list[int], path, stop: str | None, k: int | None) -> StepResult:
    """A step's StepResult, with its tokens' log-probs from their rows of `logits` when k is set."""
    step = StepResult(tokens, path, stop)
    if k is not None:
        step.logprobs = token_logprobs(logits[step.keep], tokens, k)
    return step


NO_PATH = torch.zeros(0, dtype=torch.long)  # the accepted path of a call without a tree


def truncate(tokens: list[int], eos: set, room: int) -> tuple[list[int], str | None]:
    """Cut a step's tokens at the first EOS (kept) or at the max-new-tokens budget."""
    for i, t in enumerate(tokens):
        if t in eos:
            tokens = tokens[: i + 1]
            return tokens[:room], "eos" if i < room else "length"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None
