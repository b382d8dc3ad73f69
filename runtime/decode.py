"""The decode loop: vanilla, chain and tree speculative decoding around engine calls.

Role: one step is (1) draft a tree level by level (runtime/drafts.py), (2) flatten it into
ids / positions / tree mask (runtime/trees.py), (3) verify it with ONE target call, (4) accept
the longest valid path plus one target token (runtime/accept.py), (5) commit the accepted K/V
with one gather in the target's and the draft's caches and stream the tokens out.

The last committed token (the root) is not yet in the target cache: each verify call runs
[root, nodes...] so the root's K/V and every node's are written together. `vanilla` is the
same loop with an empty tree (one token per target call); `chain` is a depth-K, width-1 tree.
The loop is backend-agnostic: engines follow runtime/backends/base.Engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .accept import accept
from .drafts import CANDIDATE_MODES, BigramDraft, LookupDraft, ModelDraft, draft_tree, tree_capacity

TABLE_DRAFTS = (BigramDraft, LookupDraft)  # draft sources with no model behind them
from .kvcache import KVCache
from .sampling import SamplingParams
from .stats import GenerationStats, Timer
from .trees import ChainTree, Tree, TreePolicy, parse_tree_spec, verify_inputs

MODES = ("vanilla", "chain", "tree")


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats
    stop_reason: str = "length"  # "eos", "length" or "context"


class _ClockedEngine:
    """Adds the time spent inside an engine's forward to a stats field (draft model time)."""

    def __init__(self, engine, stats_ref: list, name: str, sync=None):
        self.engine, self._stats_ref, self._name, self._sync = engine, stats_ref, name, sync
        self.info, self.device = engine.info, engine.device

    def forward(self, *args):
        t0 = time.perf_counter()
        out = self.engine.forward(*args)
        if self._sync:
            self._sync()
        st = self._stats_ref[0]
        setattr(st, self._name, getattr(st, self._name) + time.perf_counter() - t0)
        return out


class SpeculativeDecoder:
    """Embeddable generator.

    target: an Engine; draft: an Engine (neural draft), a BigramDraft or LookupDraft (no model
    calls), or None (vanilla only).
    mode: vanilla | chain | tree; tree: a spec string or TreePolicy (chain mode wants chain:K).
    candidates: topk | sample | sample-unique (how draft children are produced when sampling).
    """

    def __init__(self, target, draft=None, *, mode: str = "tree", tree: str | TreePolicy = "full:3,2",
                 candidates: str = "topk", sampling: SamplingParams | None = None,
                 max_tree_nodes: int | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (expected one of {', '.join(MODES)})")
        if candidates not in CANDIDATE_MODES:
            raise ValueError(f"unknown candidate mode {candidates!r} (expected one of {', '.join(CANDIDATE_MODES)})")
        self.target = target
        self.mode, self.candidates = mode, candidates
        self.sampling = sampling or SamplingParams()
        self.policy: TreePolicy | None = None
        self._stats_ref = [GenerationStats()]
        sync = torch.cuda.synchronize if target.device.type == "cuda" else None
        self._timer_sync = sync
        if mode != "vanilla":
            if draft is None:
                raise ValueError(f"mode {mode} needs a draft (--draft)")
            policy = parse_tree_spec(tree) if isinstance(tree, str) else tree
            if mode == "chain" and not isinstance(policy, ChainTree):
                raise ValueError(f"mode chain needs a chain:K tree spec, got {policy.spec!r}")
            if max_tree_nodes is not None and policy.max_nodes > max_tree_nodes:
                raise ValueError(f"tree {policy.spec} has up to {policy.max_nodes} nodes, over the limit of {max_tree_nodes}")
            if target.info.max_tokens is not None and policy.max_nodes + 1 > target.info.max_tokens:
                raise ValueError(f"tree {policy.spec} needs {policy.max_nodes + 1} tokens per verify call, "
                                 f"over the engine's limit of {target.info.max_tokens}")
            self.policy = policy
            dv = draft.vocab_size if isinstance(draft, TABLE_DRAFTS) else draft.info.vocab_size
            if dv != target.info.vocab_size:
                raise ValueError(f"draft vocabulary ({dv}) differs from the target's ({target.info.vocab_size})")
        if draft is not None and not isinstance(draft, TABLE_DRAFTS):
            draft = ModelDraft(_ClockedEngine(draft, self._stats_ref, "draft_model_s", sync), 1)
        self.draft = draft
        self.keep_draft_probs = False  # keep q for top-k candidates too (analysis, tests)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 64,
                 eos_token_ids: Sequence[int] = (), seed: int = 0) -> GenerationResult:
        out: list[int] = []
        it = self.stream(prompt_ids, max_new_tokens, eos_token_ids, seed)
        for chunk in it:
            out += chunk
        return GenerationResult(out, self.last_stats, self.last_stop_reason)

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int = 64,
               eos_token_ids: Sequence[int] = (), seed: int = 0) -> Iterator[list[int]]:
        """Yields the tokens committed by each step; stats in `self.last_stats` at the end."""
        prompt = self._check_prompt(prompt_ids, max_new_tokens)
        eos = set(int(e) for e in eos_token_ids)
        st = GenerationStats(mode=self.mode, tree=self.policy.spec if self.policy else "",
                             prompt_tokens=len(prompt))
        self._stats_ref[0] = st
        self.last_stats, self.last_stop_reason = st, "length"
        timer = Timer(st, self._timer_sync)
        rng = torch.Generator().manual_seed(int(seed))
        t_start = time.perf_counter()
        tgt = self.target
        extra = (self.policy.max_nodes if self.policy else 0) + 2
        cap = min(len(prompt) + max_new_tokens + extra, tgt.info.max_position + extra)
        cache = KVCache(tgt.info.cache, cap, 1, tgt.device)
        with timer("prefill_s"):
            if len(prompt) > 1:
                self._prefill(prompt[:-1], cache)
                st.target_calls += 1
            if self.draft is not None and self.mode != "vanilla":
                if isinstance(self.draft, ModelDraft):
                    # the draft's scratch holds every node it expands (dynamic trees expand
                    # more nodes than they keep), on top of the committed tokens
                    scratch = tree_capacity(self.policy, self.draft.vocab_size) + 2
                    dcap = min(len(prompt) + max_new_tokens, tgt.info.max_position) + scratch
                    self.draft.cache = KVCache(self.draft.engine.info.cache, dcap, 1, self.draft.engine.device)
                self.draft.reset(prompt[:-1])
        root = prompt[-1]
        produced = 0
        max_pos = tgt.info.max_position
        try:
            while produced < max_new_tokens:
                past = cache.length
                if past >= max_pos:
                    self.last_stop_reason = "context"
                    break
                speculate = self.policy is not None and past + self.policy.depth < max_pos
                with timer("draft_s"):
                    tree = (draft_tree(self.draft, self.policy, root, self.sampling, self.candidates, rng,
                                       self.keep_draft_probs)
                            if speculate else Tree.empty())
                with timer("other_s"):
                    ids, pos, mask = verify_inputs(root, tree, past, tgt.device)
                with timer("verify_s"):
                    logits = tgt.forward(ids, pos, mask, cache)[0]
                with timer("accept_kv_s"):
                    acc = accept(logits, tree, self.sampling, rng)
                    new, stop = self._truncate(acc.tokens, eos, max_new_tokens - produced)
                    # the caches keep every committed token but the last (the next root)
                    path = acc.path[: len(new) - 1]
                    cache.commit(torch.cat([torch.zeros(1, dtype=torch.long), path + 1]), tree.n + 1)
                    if speculate:
                        self.draft.commit(tree, path)
                st.steps += 1
                st.target_calls += 1
                st.draft_calls += tree.draft_calls
                st.tree_nodes += tree.n
                produced += len(new)
                st.new_tokens = produced
                st.accepted_hist[len(new)] = st.accepted_hist.get(len(new), 0) + 1
                st.total_s = time.perf_counter() - t_start
                yield new
                if stop:
                    self.last_stop_reason = stop
                    break
                root = new[-1]
        finally:
            st.total_s = time.perf_counter() - t_start
            st.other_s = max(0.0, st.total_s - st.prefill_s - st.draft_s - st.verify_s - st.accept_kv_s)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _truncate(tokens: list[int], eos: set, room: int) -> tuple[list[int], str | None]:
        """Cut a step's tokens at the first EOS (kept) or at the max-new-tokens budget."""
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[: i + 1]
                return tokens[:room], "eos" if i < room else "length"
        if len(tokens) >= room:
            return tokens[:room], "length"
        return tokens, None

    def _check_prompt(self, prompt_ids, max_new_tokens) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        v = self.target.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < v]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {v})")
        ctx = self.target.info.max_position
        if len(prompt) > ctx:
            raise ValueError(f"prompt of {len(prompt)} tokens is beyond the model's max context of {ctx}")
        return prompt

    def _prefill(self, tokens: list[int], cache: KVCache) -> None:
        dev = self.target.device
        n = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)[None]
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None]
        self.target.forward(ids, pos, mask, cache)
        cache.commit(None, n)
