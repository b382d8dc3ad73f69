"""Batched decoding: one verify call for B sequences, each with its own tree and cache length.

Role in one decode step: the same five steps as runtime/decode.py (shared: runtime/step.py), for
every active sequence at once. (1) each sequence drafts its own tree through its own draft source (a `fork()` of the
decoder's draft: table drafts share their tables, model drafts their engine; the target's
verify is the batched call); (2) the trees are flattened into one [n, T] call, T the largest
tree + 1: a shorter tree's padding rows see only themselves and are never accepted; (3) ONE
target call verifies all n sequences; (4) each sequence accepts with its own sampling
parameters and random generator (the same draws as decoding it alone); (5) one gather commits
every sequence's accepted path in its own cache row.

Cache rows: the n active sequences occupy batch rows 0..n-1 of one preallocated cache. All rows
share the column space: row b's committed tokens are [0, len_b), the engines' P is max(len_b),
and each row's mask hides the gap [len_b, P) that a longer row leaves. A sequence joins between
steps (its prompt is prefilled alone into a one-row scratch cache and copied into a free row) and
leaves between steps (the last row moves into its place): continuous batching.

Greedy decoding of a sequence gives exactly what decoding it alone gives (up to floating-point
ties: a batched call sums in another order), and sampling stays lossless: per sequence the
accept rule and the random draws are those of runtime/decode.py (runtime/step.py's settle).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from .decode import SpeculativeDecoder
from .decoder_config import DecoderConfig
from .drafts.base import tree_capacity
from .drafts.model import as_draft_source
from .drafts.tree_builder import DraftOptions, TreeWorkspace, answer, tree_builder
from .errors import InputError, NumericalError
from .guards import root_reductions
from .kvcache import KVCache, PrefixCache, release_row, sized_cache
from .request import GenerationRequest, as_request
from .sampling import SamplingParams, probs
from .step import SequenceState, forced_chain, host_threads, open_sequence, settle, tell_draft, tree_fits, verify
from .tree_plan import padded_call, write_tree
from .trees import Tree


@dataclass(eq=False)
class BatchSequence(SequenceState):
    """One sequence of a batch: its request and where it stands (step.SequenceState), its
    draft source, its cache row."""

    draft: object = None
    row: int = -1
    length: int = 0  # committed positions in its cache row
    ws: TreeWorkspace | None = None
    error: BaseException | None = None  # set when its row's logits were not finite
    kept_feats: list | None = None  # with prefix reuse and a draft that reads features: its committed rows'
    slot: int = 0  # the kept-conversation slot it joined from (BatchDecoder._slots), where it is kept again


@dataclass(eq=False)
class VerifiedCall:
    """One batched verify call as each row's steps 4-5 read it (BatchDecoder._settle)."""

    logits: torch.Tensor  # [n_rows, T, V]
    feats: torch.Tensor | None  # the target's features [n_rows, T, F] when the draft reads them
    past: int  # P: where the rows were written (but ragged)
    ragged: bool  # each one-token row written at its own length
    roots_only: bool  # no tree was drafted: the drafts defer the root
    share: tuple  # (draft s, verify s): each sequence's share of the step's time
    root_probs: dict  # {id(sequence): its root row's warped probabilities} (BatchDecoder._root_probs)
    best: torch.Tensor | None = None  # a call without trees: every row's argmax ...
    finite: torch.Tensor | None = None  # ... and finiteness (guards.root_reductions)
    moves: list = field(default_factory=list)  # (row, dst0, src positions): one gather for all rows


class BatchDecoder:
    """Decodes up to `max_batch` sequences together, one verify call per step for all.

    target: an Engine; draft: a DraftSource with `fork()` (ModelDraft, BigramDraft,
    LookupDraft, Eagle3Draft), an Engine, or None; mode/tree/candidates as SpeculativeDecoder.
    Not thread-safe: one thread calls add / step / remove (runtime/batch_scheduler.py)."""

    def __init__(self, target, draft=None, config: DecoderConfig | None = None, **options):
        """config: a DecoderConfig (runtime/decoder_config.py), options its fields as keywords
        over it: mode, tree, candidates, max_tree_nodes and prefix_cache as SpeculativeDecoder's
        (prefix_cache: the joining prompts' prefill into the scratch cache); max_batch (None: 8).
        speculate_max_batch: verify trees only while at most this many sequences are active;
        above it only the roots are verified (vanilla, T = 1) and the drafts make no call: each
        queues the committed root (DraftSource.defer) and runs its queue at its next start.
        Drafting whole trees there halved the throughput of an EAGLE-3 draft at 8 rows (67.0 vs
        151.4 tok/s without a draft). Default:
        no limit where the target batches trees (`engine.caps.batched_trees`), else 1 (ONNX Runtime's GroupQueryAttention CPU kernel rejects
        B > 1 with T > 1 after a prefix: "batch_size must be 1 when sequence_length > 1 and past
        context is given")."""
        cfg = self.config = DecoderConfig.of(config, options, "BatchDecoder")
        max_batch = 8 if cfg.max_batch is None else cfg.max_batch
        engine_b = target.caps.max_batch  # a TensorRT engine's profiles fix B
        if max_batch > 1 and engine_b is not None and max_batch > engine_b:
            raise InputError(
                f"max-batch {max_batch} is over the engine's B <= {engine_b}: rebuild it with "
                f"`arborspec build --max-batch {max_batch}` or batch at most {engine_b}"
            )
        draft = as_draft_source(draft)
        # one unbatched decoder validates mode / tree / draft and prefills joining sequences
        self._solo = SpeculativeDecoder(target, draft, cfg)
        self.target, self.draft, self.policy = target, draft, self._solo.policy
        self.mode, self.candidates, self.max_batch = self._solo.mode, self._solo.candidates, max_batch
        if self.policy is not None and not getattr(draft, "batchable", False):
            raise InputError(f"draft {getattr(draft, 'kind', type(draft).__name__)} cannot be batched (no fork())")
        self.needs_features = self._solo.needs_features
        self._row_views = target.caps.row_views
        self._ragged = target.caps.ragged_rows
        self.ragged_steps = 0  # steps whose one-token rows each attended over their own length
        # sampled rows' root probabilities in one call a step (`_root_probs`) where the logits
        # live on a device; on the CPU `probs` works row by row in any case (sampling._probs_rows),
        # so each row is warped where the accept walk reads it
        self.batched_root_probs = target.device.type != "cpu"
        speculate_max_batch = cfg.speculate_max_batch
        if speculate_max_batch is None:
            speculate_max_batch = max_batch if target.caps.batched_trees else 1
        self.speculate_max_batch = speculate_max_batch
        self.seqs: list[BatchSequence] = []  # active, seqs[i].row == i
        # a draft that declares a batch driver (a model draft whose engine batches trees) drafts
        # every sequence with one call per level
        # (runtime/drafts/batched.py); other sources draft each sequence through its own fork()
        self.draft_batch = None
        self._spare_drafts: list = [draft] if draft is not None else []
        if self.policy is not None:
            self.draft_batch = draft.batch_driver(max_batch)  # declared by the draft (DraftSource)
        if self.draft_batch is not None:
            self._spare_drafts = []
        self._cache: KVCache | None = None
        # kept conversations, one per batch row: each a one-row cache (a joining sequence is
        # prefilled in one) and what it holds, a finished sequence's prompt and answer
        # (kvcache.PrefixCache); a prompt joins from the slot that holds most of its start
        self._slots = [PrefixCache() for _ in range(max_batch if self._solo.prefix_cache else 1)]
        self._slot_used = [0] * len(self._slots)  # when each slot was last used (least recent: reused)
        self._clock = 0
        self._extra = (self.policy.max_nodes if self.policy else 0) + 2

    # ------------------------------------------------------------------ joining / leaving
    # every method that touches the cache runs in inference mode (a cache made in one must
    # only be updated in one)
    @torch.inference_mode()
    def add(self, request, *args, **kw) -> BatchSequence:
        """Prefill a new sequence into a free row (between steps): a GenerationRequest (its
        `sampling` None: greedy) or its fields (runtime/request.py; the short form
        add(prompt_ids, max_new_tokens, eos_token_ids, seed, sampling=...)). Raises InputError
        when the batch is full or the request is invalid. logprobs, prompt_logprobs: as
        SpeculativeDecoder.stream's (`token_logprobs`, `prompt_logprobs` of the returned sequence)."""
        if len(self.seqs) >= self.max_batch:
            raise InputError(f"batch full ({self.max_batch} sequences)")
        seq, on_logits = open_sequence(BatchSequence, as_request(request, *args, **kw), self, SamplingParams())
        tgt, prompt, st = self.target, seq.prompt, seq.stats
        top = tgt.info.max_position + self._extra
        cap = min(len(prompt) + seq.max_new_tokens + self._extra, top)
        seq.slot, src, share = self._pick_slot(prompt)
        kept = self._slots[seq.slot]
        scratch = kept.room(kept.cache, tgt.info.cache, cap, tgt.device, top)
        if share and (self._slots[src].n_feats >= share or not self.needs_features):
            scratch.take_row(self._slots[src].cache, 0, share)  # the shared start, copied (a memcpy)
            kept.adopt(scratch, *self._slots[src].head(share))
        feats, calls, st.cached_tokens = self._solo.prefill_prompt(prompt, scratch, on_logits, kept)
        st.target_calls += calls
        if self._solo.prefix_cache and self.needs_features:  # its rows' features, for remove()
            seq.kept_feats = [feats] if feats is not None else []
        if self.policy is not None:
            if self._spare_drafts:
                seq.draft = self._spare_drafts.pop()
            else:
                seq.draft = self.draft_batch.handle() if self.draft_batch else self.draft.fork()
            seq.draft.prepare(self.policy, min(len(prompt) + seq.max_new_tokens, tgt.info.max_position))
            if self._solo.cold:
                seq.draft.forget()
            seq.draft.reset(prompt[:-1], feats)
            seq.ws = TreeWorkspace(tree_capacity(self.policy, tgt.info.vocab_size))
        seq.row = len(self.seqs)
        self._ensure(max(self._cache.length if self._cache else 0, scratch.length) + self._extra)
        self._cache.load_row(seq.row, scratch, scratch.length)
        seq.length = scratch.length
        self.seqs.append(seq)
        self._cache.length = max(s.length for s in self.seqs)
        st.prefill_s = time.perf_counter() - seq.t_start
        return seq

    @torch.inference_mode()
    def remove(self, seq: BatchSequence) -> None:
        """Free a sequence's row (finished or cancelled); the last row moves into its place."""
        if seq not in self.seqs:
            return
        if seq.done and seq.error is None and self._solo.prefix_cache:
            self._keep_row(seq)
        release_row(self.seqs, seq, self._cache)
        if seq.draft is not None:  # reused by the next sequence that joins
            seq.draft.leave()  # e.g. its row of the batched draft cache
            self._spare_drafts.append(seq.draft)
            seq.draft = None

    def cached_prefix(self, ids: list[int]) -> int:
        """As SpeculativeDecoder.cached_prefix: the most of `ids`' start (but its last) a kept
        conversation holds."""
        if not self._solo.prefix_cache:
            return 0
        return max((k.match(list(ids[:-1])) for k in self._slots if k.cache is not None), default=0)

    def kept_for(self, ids: list[int]) -> PrefixCache:
        """The kept conversation that holds most of `ids`' start."""
        return max(self._slots, key=lambda k: k.match(list(ids)) if k.cache is not None else -1)

    def _pick_slot(self, prompt: list[int]) -> tuple[int, int, int]:
        """The kept-conversation slot a joining prompt is prefilled in -> (that slot, the slot
        that holds most of its start, how many of its tokens to copy from there first). A prompt
        that continues all of a kept conversation (a chat's next turn) takes its slot; any other
        takes the least recently used one, with the start it shares (a system prompt) copied in:
        no kept conversation is overwritten for a shared start."""
        self._clock += 1
        held = [k.match(prompt[:-1]) if k.cache is not None else 0 for k in self._slots]
        best = max(range(len(held)), key=lambda i: (held[i], self._slot_used[i]))
        if held[best] > 0 and held[best] == len(self._slots[best].tokens):
            dst, share = best, 0  # a continuation: prefilled where it is kept
        else:
            dst = min(range(len(held)), key=self._slot_used.__getitem__)
            share = held[best] if dst != best else 0  # in place, begin() keeps what it shares
        self._slot_used[dst] = self._clock
        return dst, best, share

    def _keep_row(self, seq: BatchSequence) -> None:
        """A finished sequence's committed rows (its prompt and answer but the last token) into the
        slot it joined from, so that the next prompt that starts with them (a chat's next turn)
        joins with a prefill of the rest only (kvcache.PrefixCache); as the unbatched decoder keeps them."""
        n, tgt = seq.length, self.target
        if self.needs_features and (seq.kept_feats is None or sum(len(f) for f in seq.kept_feats) != n):
            return  # features missing: the draft could not start from this row
        kept = self._slots[seq.slot]
        cache = kept.room(kept.cache, tgt.info.cache, n + self._extra, tgt.device, tgt.info.max_position + self._extra)
        cache.take_row(self._cache, seq.row, n)
        kept.adopt(cache, (seq.prompt + seq.tokens)[:n], seq.kept_feats or [])
        self._clock += 1
        self._slot_used[seq.slot] = self._clock

    def _ensure(self, need: int) -> None:
        """A cache of max_batch rows with room for `need` positions (grown by doubling)."""
        c = self.target
        top = c.info.max_position + self._extra
        self._cache = sized_cache(self._cache, c.info.cache, need, self.max_batch, c.device, top)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[tuple[BatchSequence, list[int]]]:
        """One decode step for every active sequence (see `_step`), torch's host threads set for
        the target (step.host_threads)."""
        with host_threads(self.target):
            return self._step()

    @torch.inference_mode()
    def _step(self) -> list[tuple[BatchSequence, list[int]]]:
        """One decode step for every active sequence: -> [(sequence, its new tokens)]. A sequence
        that finished has `done` set (the caller removes it); one whose logits were NaN/Inf also
        has `error` set (a NumericalError) and no tokens from this step. The steps are
        runtime/decode.py's (runtime/step.py): (1) draft (each sequence's tree_builder, in lockstep), (2) flatten
        (tree_plan.write_tree, one row each), (3) verify (step.verify, ONE call), (4) accept
        (step.settle per row), (5) commit (one gather for all rows, each draft its path)."""
        seqs = [s for s in self.seqs if not s.done]
        if not seqs:
            return []
        tgt, policy = self.target, self.policy
        t0 = time.perf_counter()
        # a sequence too close to the end of the context for a tree (step.tree_fits) decodes
        # without one from then on; and the call's columns run to the longest row's length + the
        # rows, so while no tree fits there only the roots are verified (the drafts defer, as above
        # the speculation limit)
        mp = tgt.info.max_position
        speculated = [tree_fits(policy, s.length, mp) for s in seqs]
        roots_only = (
            len(seqs) > self.speculate_max_batch  # no drafting: drafts defer (see __init__)
            or not tree_fits(policy, max(s.length for s in seqs), mp)
        )
        trees = drafted = [Tree.empty()] * len(seqs) if roots_only else self._draft_trees(seqs, speculated)
        t_draft = time.perf_counter() - t0
        ids, pos, mask, view, ragged = self._flatten(seqs, trees)
        t1 = time.perf_counter()
        dev = tgt.device
        logits, feats = verify(tgt, ids.to(dev), pos.to(dev), mask.to(dev), view, self.needs_features)
        root_probs = self._root_probs(seqs, logits) if self.batched_root_probs else {}
        share = (t_draft / len(seqs), (time.perf_counter() - t1) / len(seqs))
        call = VerifiedCall(logits, feats, self._cache.length, ragged, roots_only, share, root_probs)
        if ids.shape[1] == 1:
            # a call without trees (every vanilla step): every row's argmax and finiteness at once,
            # where the logits are (a 128-row step on an H100 spent ~0.2 ms a row on the host)
            call.best, call.finite = root_reductions(logits)
        out = [(s, self._settle(s, call, *row)) for s, row in zip(seqs, zip(trees, drafted, speculated))]
        self._cache.commit_rows(call.moves)
        self._cache.length = max(s.length for s in self.seqs)
        return out

    def _flatten(self, seqs: list[BatchSequence], trees: list[Tree]):
        """Step 2 for the batch: one [n_rows, T] call, T the largest tree + 1, row b sequence b's
        tree (tree_plan.write_tree) over its own cache length; padding rows (and unused batch
        rows) see only themselves. -> ids, pos, mask, the cache view, whether the call is ragged."""
        n_rows = len(self.seqs) if self._row_views else self.max_batch
        t = max(tr.n for tr in trees) + 1
        p = max(s.length for s in self.seqs)
        self._ensure(p + t)
        cache = self._cache
        cache.length = p
        ids, pos, mask = padded_call(n_rows, t, p)
        # one token per row on a graph that reads each row's length from its mask: row b's root
        # sees [0, len_b] and is written at len_b (no gap attended, nothing to move after)
        ragged = t == 1 and self._ragged
        self.ragged_steps += ragged
        if t == 1:  # roots only (every vanilla step): every row at once
            r, root, length = torch.tensor([(s.row, s.root, s.length) for s in seqs], dtype=torch.long).unbind(1)
            ids[r, 0], pos[r, 0] = root, length
            cols = torch.arange(p + 1)
            # row b sees [0, len_b) and itself: at column P, or (ragged) at its own length
            mask[r, 0] = cols <= length[:, None] if ragged else (cols < length[:, None]) | (cols == p)
        else:
            for s, tree in zip(seqs, trees):
                b, n = s.row, tree.n + 1
                write_tree(ids[b], pos[b], mask[b, :n, p : p + n], s.root, tree, s.length)
                pos[b, n:] = s.length
                mask[b, :, : s.length] = True
        view = cache.rows(n_rows) if n_rows != cache.batch else cache
        return ids, pos, mask, view, ragged

    def _root_probs(self, seqs: list[BatchSequence], logits: torch.Tensor) -> dict:
        """Step 4's first rows for the whole batch where the logits are: every sampled sequence's
        root-row probabilities (warped: temperature, top-k, top-p), one `probs` call per sampling
        setting, copied to the host together -> {id(sequence): [V]}. One row at a time, a 128-row
        sampled batch spent 111 ms a step on the host (0.87 ms a row, tools/bench/overhead.py
        --batch 128 --temperature 1 --top-p 0.95): the GPU corpus's sampled requests."""
        groups: dict = {}
        for s in seqs:
            if not s.sampling.greedy and s.history is None:  # (penalised rows: the walk processes them)
                groups.setdefault(s.sampling, []).append(s)
        out = {}
        for sp, group in groups.items():
            rows = torch.tensor([s.row for s in group], device=logits.device)
            p = probs(logits[rows, 0], sp).cpu()
            out.update((id(s), p[i]) for i, s in enumerate(group))
        return out

    def _settle(self, s: BatchSequence, call: VerifiedCall, tree: Tree, drafted_tree: Tree, spec: bool):
        """Steps 4-5 for one sequence (its row of the verify call): accept (step.settle), queue
        its cache gather in `call.moves`, tell its draft, record its stats. -> its new tokens
        ([] with `error` set when its logits were not finite: the rest of the batch goes on).
        spec: whether its draft follows it (a tree fits its context); drafted_tree: the tree its
        draft drafted (`tree`, or the empty one of a roots-only call)."""
        b, st = s.row, s.stats
        # where this step's rows were written: at P, or at the row's own length (ragged)
        base = s.length if call.ragged else call.past
        root = (call.best[b], call.finite[b]) if call.best is not None else None
        try:
            step = settle(
                call.logits[b], tree, s, self.target.info.name, root_probs=call.root_probs.get(id(s)), root=root
            )
        except NumericalError as e:
            s.done, s.stop_reason, s.error = True, "error", e
            return []
        keep, feats = step.keep, call.feats
        call.moves.append((b, s.length, [base + j for j in keep]))
        if s.kept_feats is not None and feats is not None:
            s.kept_feats.append(feats[b, keep])
        if spec and call.roots_only:  # no tree was drafted: the draft queues the root for its next start
            s.draft.defer(s.root, feats[b, :1] if feats is not None else None)
        elif spec:  # the draft keeps its accepted path (a forced chain's tokens: deferred to it)
            rows = feats[b, : tree.n + 1] if feats is not None else None
            tell_draft(s.draft, s.root, drafted_tree, step.path, keep, rows)
        s.length += len(keep)
        st.draft_s += call.share[0]
        st.verify_s += call.share[1]
        s.advance(step, tree)
        if not s.done and s.length >= self.target.info.max_position:
            s.done, s.stop_reason = True, "context"
        return step.tokens

    def _draft_trees(self, seqs: list[BatchSequence], speculated: list[bool]) -> list[Tree]:
        """Every sequence's tree, its level loop driven in lockstep with the others': per level
        one DraftCall from each sequence still drafting, answered together (one engine call with
        a batched model draft, else by each sequence's own source)."""
        trees = [Tree.empty() for _ in seqs]
        builders, calls = {}, {}
        v = self.target.info.vocab_size
        for i, (s, spec) in enumerate(zip(seqs, speculated)):
            # a grammar's forced tokens instead of a drafted tree (step.forced_chain), no wider
            # than the policy's trees: the call's width is every row's
            forced = (
                forced_chain(
                    s.history, s.max_new_tokens - s.produced, s.length, self.target.info, self.policy.max_nodes
                )
                if spec
                else None
            )
            if forced is not None:
                trees[i] = forced
            elif spec:
                opts = DraftOptions(self.candidates, s.rng, False, s.ws, v, s.history)
                builders[i] = tree_builder(s.draft, self.policy, s.root, s.sampling, opts)
                calls[i] = None
        while calls:
            live = list(calls)
            if self.draft_batch is not None and calls[live[0]] is not None:
                answers = self.draft_batch.answer([(seqs[i].draft, calls[i]) for i in live])
            else:
                answers = [None if calls[i] is None else answer(seqs[i].draft, calls[i]) for i in live]
            calls = {}
            for i, a in zip(live, answers):
                try:
                    calls[i] = next(builders[i]) if a is None else builders[i].send(a)
                except StopIteration as done:
                    trees[i] = done.value
        return trees

    # ------------------------------------------------------------------ whole batches
    def generate_many(
        self,
        prompts: Seq[Seq[int]],
        max_new_tokens: int = 64,
        eos_token_ids: Seq[int] = (),
        sampling: SamplingParams | None | Seq[SamplingParams | None] = None,
        seeds: Seq[int] | None = None,
    ) -> list[BatchSequence]:
        """Decode every prompt, at most max_batch at a time, joining as rows free up (the
        continuous batching a server does); -> the finished sequences, in prompt order.
        sampling: one SamplingParams (None: greedy) for every prompt, or a list, one per prompt
        (greedy and sampled rows decoded together)."""
        seeds = list(seeds) if seeds is not None else [0] * len(prompts)
        per_row = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(per_row) != len(prompts):
            raise InputError(f"sampling: {len(per_row)} SamplingParams for {len(prompts)} prompts")
        todo = list(range(len(prompts)))
        done: dict[int, BatchSequence] = {}
        owner: dict[int, int] = {}
        while todo or self.seqs:
            while todo and len(self.seqs) < self.max_batch:
                i = todo.pop(0)
                req = GenerationRequest(prompts[i], max_new_tokens, eos_token_ids, seeds[i], sampling=per_row[i])
                owner[id(self.add(req))] = i
            for s, _ in self.step():
                if s.done:
                    self.remove(s)
                    done[owner[id(s)]] = s
        return [done[i] for i in range(len(prompts))]

    def close(self) -> None:
        self._cache, self._slots = None, [PrefixCache() for _ in self._slots]
        for d in self._spare_drafts + [s.draft for s in self.seqs]:
            if d is not None and d is not self.draft:
                d.close()  # a fork: its own buffers only, never the shared engine
        self.seqs, self._spare_drafts = [], []
