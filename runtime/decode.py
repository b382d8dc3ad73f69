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
per thread (runtime/generator.Generator serialises calls with a lock). The steps it shares with
the batched decoder (runtime/batch_decode.py: open a sequence, forced chains, verify, settle,
tell the draft) are runtime/step.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .decoder_config import DecoderConfig, Opened, resolve_config
from .drafts.base import tree_capacity
from .drafts.model import as_draft_source
from .drafts.tree_builder import DraftOptions, TreeWorkspace, draft_tree
from .errors import InputError
from .governor import TREE, VANILLA, SpeculationGovernor
from .kvcache import KVCache, PrefixCache
from .request import GenerationRequest, GenerationResult, StepResult, as_request
from .sampling import SamplingParams
from .stats import Timer
from .step import (  # noqa: F401 - MAX_LOGPROBS, check_logprobs: re-exported (generator.py, tools/commands/generate.py)
    MAX_FORCED,
    MAX_LOGPROBS,
    NO_PATH,
    SequenceState,
    check_logprobs,
    forced_chain,
    host_threads,
    open_sequence,
    settle,
    tell_draft,
    tree_fits,
    verify,
)
from .tree_plan import Prefill, VerifyBuffers, causal_prefill
from .trees import ChainTree, Tree, TreePolicy, parse_tree_spec


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
        mode = resolve_config(cfg, Opened(has_draft=draft is not None)).mode  # no mode: tree with a draft, else vanilla
        candidates, max_tree_nodes = cfg.candidates, cfg.max_tree_nodes
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
        seq.governor = SpeculationGovernor() if policy is not None and self.config.governed else None
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
        t0 = time.perf_counter()
        speculate = tree_fits(policy, past, tgt.info.max_position)  # the context's last tokens: none
        arm = seq.governor.choose() if speculate and seq.governor is not None else TREE
        with timer("draft_s"):
            forced = forced_chain(seq.history, seq.room, past, tgt.info, MAX_FORCED) if speculate else None
            held = speculate and arm == VANILLA and forced is None  # the governor: no tree this step
            tree = forced or (self._draft(seq) if speculate and not held else Tree.empty())
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
            if held:  # no draft call this step: the root joins the draft's queue for its next start
                self.draft.defer(seq.root, feats[0, :1] if feats is not None else None)
            elif speculate:
                tell_draft(self.draft, seq.root, tree, step.path, keep, feats[0] if feats is not None else None)
        seq.advance(step, tree)
        if speculate and seq.governor is not None and not forced:
            caught_up = arm == TREE and seq.draft_behind  # the draft read the prompt or held roots first
            seq.governor.observe(arm, len(step.tokens), time.perf_counter() - t0, charged=not caught_up)
            seq.stats.held_steps = seq.governor.held
        if speculate:
            seq.draft_behind = held
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
class _Sequence(SequenceState):
    """The unbatched decoder's sequence: with its step timer."""

    timer: Timer | None = None
    model_s0: float = 0.0  # the draft's model time when it started
    governor: SpeculationGovernor | None = None  # whether each step drafts (runtime/governor.py)
    draft_behind: bool = True  # the draft's next call catches up first (the prompt, held roots)
