"""The decode loop: vanilla, chain and tree speculative decoding around engine calls.

Role: one step is (1) draft a tree level by level (runtime/drafts/tree_builder.py, through the
draft source's interface, runtime/drafts/base.py; where a request's grammar forces the next
tokens, they are the tree instead: `forced_chain`), (2) flatten it into ids / positions / tree mask in the
preallocated verify buffers (runtime/tree_plan.py), (3) verify it with ONE target call, (4)
accept the longest valid path plus one target token (runtime/accept.py), (5) commit the
accepted K/V with one gather in the target's cache, tell the draft source which path won,
and stream the tokens out.

The last committed token (the root) is not yet in the target cache: each verify call runs
[root, nodes...] so the root's K/V and every node's are written together. `vanilla` is the
same loop with an empty tree (one token per target call); `chain` is a depth-K, width-1 tree.
The loop is backend-agnostic (engines follow runtime/backends/base.Engine) and draft-agnostic
(sources follow runtime/drafts/base.DraftSource). A decoder runs one sequence at a time: use one
per thread (runtime/generator.Generator serialises calls with a lock).
"""

from __future__ import annotations

import operator
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .accept import NO_HOOKS, RowHooks, accept
from .decoder_config import DecoderConfig
from .drafts.base import tree_capacity
from .drafts.model import as_draft_source
from .drafts.tree_builder import DraftOptions, TreeWorkspace, draft_tree
from .errors import InputError
from .guards import check_logits
from .kvcache import KVCache, PrefixCache
from .penalties import RowProcessing, history_for
from .request import GenerationRequest, GenerationResult, StepResult, as_request
from .sampling import SamplingParams
from .stats import GenerationStats, Timer
from .tree_plan import Prefill, VerifyBuffers, causal_prefill
from .trees import ChainTree, Tree, TreePolicy, parse_tree_spec


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


class SpeculativeDecoder:
    """Generates from token ids with a target engine and an optional draft.

    target: an Engine; draft: a DraftSource (ModelDraft, BigramDraft, LookupDraft, ...), an
    Engine (wrapped in a ModelDraft), or None (vanilla only).
    config (runtime/decoder_config.py): mode vanilla | chain | tree; tree a spec string or
    TreePolicy (chain mode wants chain:K); candidates topk | sample | sample-unique (how draft
    children are produced when sampling), None: the tree's own choice (a tuned file's, `tune
    --temperature`), else topk.
    """

    def __init__(
        self, target, draft=None, config: DecoderConfig | None = None, *, sampling: SamplingParams | None = None, **options
    ):
        """config: a DecoderConfig (its mode, tree, candidates, max_tree_nodes, prefix_cache);
        options: its fields as keywords, over `config` (SpeculativeDecoder(t, d, tree="chain:4")).
        sampling: the SamplingParams of a call whose request has none (default greedy)."""
        cfg = self.config = DecoderConfig.of(config, options, "SpeculativeDecoder")
        mode, candidates, max_tree_nodes = cfg.mode or "tree", cfg.candidates, cfg.max_tree_nodes
        self.target = target
        self.mode, self.candidates = mode, candidates or "topk"
        self.sampling = sampling or SamplingParams()
        self.policy: TreePolicy | None = None
        self._timer_sync = torch.cuda.synchronize if target.device.type == "cuda" else None
        draft = as_draft_source(draft)
        if mode != "vanilla":
            if draft is None:
                raise InputError(f"mode {mode} needs a draft (--draft)")
            tree = cfg.tree_spec
            policy = parse_tree_spec(tree) if isinstance(tree, str) else tree
            if mode == "chain" and not isinstance(policy, ChainTree):
                raise InputError(f"mode chain needs a chain:K tree spec, got {policy.spec!r}")
            policy = draft.widen(policy)  # room for a tree the draft proposes itself (drafts/proposed.py)
            if max_tree_nodes is not None and policy.max_nodes > max_tree_nodes:
                raise InputError(
                    f"tree {policy.spec} has up to {policy.max_nodes} nodes, over the limit of {max_tree_nodes}"
                )
            if target.info.max_tokens is not None and policy.max_nodes + 1 > target.info.max_tokens:
                raise InputError(
                    f"tree {policy.spec} needs {policy.max_nodes + 1} tokens per verify call, "
                    f"over the engine's limit of {target.info.max_tokens}"
                )
            self.policy = policy
            if candidates is None:  # a tuned tree's own choice for sampled steps
                self.candidates = policy.candidates or "topk"
            tv = target.info.vocab_size
            if draft.token_map is None and draft.vocab_size != tv:
                raise InputError(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({tv})")
            if draft.token_map is not None and int(draft.token_map.max()) >= tv:
                raise InputError(f"draft token map points outside the target vocabulary ({tv})")
            if draft.needs_target_features and not target.info.n_features:
                raise InputError(
                    f"draft {draft.kind} reads target features, but the "
                    "target engine has no feature output (re-export the target for it)"
                )
        self.draft = draft
        self.keep_draft_probs = False  # keep q for top-k candidates too (analysis, tests)
        self._vbuf = VerifyBuffers(target.device)
        self._cache: KVCache | None = None  # the target's cache, reused by the next generation
        self._ws = TreeWorkspace(tree_capacity(self.policy, target.info.vocab_size)) if self.policy else None
        self._seq: _Sequence | None = None  # the sequence `start` began, advanced by `step`
        # a prompt that starts like the last one prefills only the rest (kvcache.PrefixCache);
        # by default where that is exact: a row-invariant target
        self.prefix_cache = target.caps.row_invariant if cfg.prefix_cache is None else bool(cfg.prefix_cache)
        # a draft keeps what it can for a repeated start (its own cache: the output stays exact
        # either way) unless the caller asked for cold requests (prefix_cache=False: a benchmark)
        self.cold = cfg.prefix_cache is False
        self._prefix = PrefixCache()

    @property
    def needs_features(self) -> bool:
        """Whether the verify calls must return the target's features (an EAGLE-3 draft reads them)."""
        return self.policy is not None and self.draft.needs_target_features

    # ------------------------------------------------------------------ public API
    # each takes a GenerationRequest (runtime/request.py) or its fields: the short form
    # generate(prompt_ids, max_new_tokens=64, eos_token_ids=(), seed=0, logprobs=None, ...)
    def generate(self, request, *args, **kw) -> GenerationResult:
        """One whole generation -> its GenerationResult (tokens, stats, stop reason, log-probs)."""
        chunks = self.stream(request, *args, **kw)
        for _ in chunks:
            pass
        return chunks.result

    def stream(self, request, *args, **kw) -> "DecodeStream":
        """The tokens committed by each step, as an iterator; its `result` is the generation's
        GenerationResult (final once the iterator is exhausted or closed). With logprobs=k (>= 0)
        the result's `logprobs` list each token's log-prob and the k most likely there; with
        prompt_logprobs=k its `prompt_logprobs` the prompt's, from the prefill."""
        return DecodeStream(self, as_request(request, *args, **kw))

    def start(self, request, *args, **kw) -> "_Sequence":
        """Begin a sequence: check the request, prefill all of the prompt but its last token (the
        first root) into the target's cache, reset the draft. Then call `step()` until it returns
        no tokens; `stream()` does both."""
        seq, on_logits = open_sequence(_Sequence, as_request(request, *args, **kw), self, self.sampling)
        self._seq, prompt, st = seq, seq.prompt, seq.stats
        tgt, draft, policy = self.target, self.draft, self.policy
        seq.timer = Timer(st, self._timer_sync)
        seq.model_s0 = draft.model_s if draft is not None else 0.0
        extra = (policy.max_nodes if policy else 0) + 2
        top = tgt.info.max_position + extra
        cap = min(len(prompt) + seq.max_new_tokens + extra, top)
        with seq.timer("prefill_s"):
            cache = self._cache = self._prefix.room(self._cache, tgt.info.cache, cap, tgt.device, top)
            feats, calls, st.cached_tokens = self.prefill_prompt(prompt, cache, on_logits)
            st.target_calls += calls
            if policy is not None:
                draft.prepare(policy, min(len(prompt) + seq.max_new_tokens, tgt.info.max_position))
                if self.cold:
                    draft.forget()
                draft.reset(prompt[:-1], feats)
        return seq

    def step(self) -> StepResult:
        """One decode step of the started sequence: (1) draft a tree, (2) flatten it, (3) verify
        it with one target call, (4) accept, (5) commit the target's and the draft's caches.
        -> its StepResult; no tokens once the sequence is over (`stop_reason` says why)."""
        seq, tgt, policy, cache = self._seq, self.target, self.policy, self._cache
        if seq is None or seq.done:
            return StepResult([], NO_PATH, seq.stop_reason if seq is not None else None)
        past, timer = cache.length, seq.timer
        if past >= tgt.info.max_position:
            seq.done, seq.stop_reason = True, "context"
            return StepResult([], NO_PATH, "context")
        speculate = tree_fits(policy, past, tgt.info.max_position)  # the context's last tokens: none
        with timer("draft_s"):
            forced = forced_chain(seq.history, seq.room, past, tgt.info, MAX_FORCED) if speculate else None
            tree = forced or (self._draft(seq) if speculate else Tree.empty())
        # flattening lands in other_s (the runtime's own time), the call in verify_s
        ids, pos, mask = self._vbuf.fill(seq.root, tree, past)
        with timer("verify_s"):
            logits, feats = verify(tgt, ids, pos, mask, cache, self.needs_features)
        with timer("accept_kv_s"):
            self._vbuf.release()
            step = settle(logits[0], tree, seq, tgt.info.name)
            keep = step.keep  # the rows that predicted the new tokens
            # the caches keep every committed token but the last (the next root)
            cache.commit(keep, tree.n + 1)
            if self.prefix_cache:  # root and accepted nodes committed: a next prompt that repeats them reuses them
                self._prefix.extend([seq.root] + step.tokens[:-1], feats[0, keep] if feats is not None else None)
            if speculate:
                tell_draft(self.draft, seq.root, tree, step.path, keep, feats[0] if feats is not None else None)
        seq.advance(step, tree)
        return step

    def cached_prefix(self, ids: list[int]) -> int:
        """How many of `ids`' first tokens (but its last) the cache holds for a next prompt."""
        return self._prefix.match(list(ids[:-1])) if self.prefix_cache else 0

    def prefill_prompt(self, prompt: list[int], cache: KVCache, on_logits=None, kept: PrefixCache | None = None):
        """All of `prompt` but its last token (the first root) into `cache`, but the tokens a
        previous prefill left there (`prefix_cache`; not with on_logits: the prompt's log-probs
        need every row) -> (the target features of prompt[:-1] when the draft reads them, else
        None; target calls made; prompt tokens reused). kept: what `cache` holds (default: this
        decoder's own record; the batched decoder keeps one per slot)."""
        kept = kept or self._prefix
        keep = kept.begin(cache, prompt[:-1], self.prefix_cache and on_logits is None, self.needs_features)
        feats, calls = self.prefill(prompt[keep:-1], cache, on_logits)
        return kept.end(prompt[:-1], feats), calls, keep

    def prefill(self, tokens: list[int], cache: KVCache, on_logits=None):
        """Run `tokens` (a prompt but its last token) as causal calls of at most `prefill_chunk`
        tokens (a 4k-token prompt in one call builds a 4k x 4k attention; in chunks each call
        sees only its own rows). Returns (the target features of those tokens [n, F] when the
        draft reads them, else None; the number of target calls). on_logits: causal_prefill's
        (prompt_scorer's, for the prompt's log-probs)."""
        if not tokens:
            return None, 0
        how = Prefill(self.prefill_chunk, self.needs_features, self._vbuf.mask)
        return causal_prefill(self.target, tokens, cache, how, on_logits)

    prefill_chunk = 512  # tokens per prefill call (long prompts run as several causal chunks)

    # ------------------------------------------------------------------ helpers
    def _draft(self, seq: "_Sequence") -> Tree:
        opts = DraftOptions(
            self.candidates, seq.rng, self.keep_draft_probs, self._ws, self.target.info.vocab_size, seq.history
        )
        return draft_tree(self.draft, self.policy, seq.root, seq.sampling, opts)

    def _finish(self, seq: "_Sequence") -> None:
        """A sequence's closing stats: total time, time inside draft engines, the rest."""
        st = seq.stats
        st.total_s = time.perf_counter() - seq.t_start
        if self.draft is not None:
            st.draft_model_s = self.draft.model_s - seq.model_s0
        st.other_s = max(0.0, st.total_s - st.prefill_s - st.draft_s - st.verify_s - st.accept_kv_s)


class DecodeStream:
    """One generation's token chunks (lists of ids) as SpeculativeDecoder.stream's steps commit
    them; `result`: its GenerationResult so far (None before the first chunk is asked for), final
    once the iterator is exhausted or closed. The decoder's sequence starts at the first chunk."""

    def __init__(self, decoder: SpeculativeDecoder, request: GenerationRequest):
        self.request = request
        self._seq: SequenceState | None = None
        self._chunks = self._run(decoder)

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        return next(self._chunks)

    def close(self) -> None:
        """End the generation here (a caller that stops early)."""
        self._chunks.close()

    @property
    def result(self) -> GenerationResult | None:
        return self._seq.result() if self._seq is not None else None

    def _run(self, dec: SpeculativeDecoder) -> Iterator[list[int]]:
        with host_threads(dec.target):
            self._seq = dec.start(self.request)
            try:
                while True:
                    new = dec.step().tokens
                    if not new:
                        break
                    yield new
            finally:
                dec._finish(self._seq)


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


@dataclass(eq=False)
class _Sequence(SequenceState):
    """The unbatched decoder's sequence: with its step timer."""

    timer: Timer | None = None
    model_s0: float = 0.0  # the draft's model time when it started


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
