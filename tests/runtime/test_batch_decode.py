"""Batched decoding (runtime/batch_decode.py, runtime/batch_scheduler.py): one verify call for
B sequences, each with its own tree, cache length, sampling and stop conditions, joining and
leaving between steps. Every sequence equals decoding it alone (greedy, token for token, every
mode and draft kind, torch and ONNX Runtime), sampling stays lossless (chi-square), and the
threaded scheduler behind `Generator(max_batch=N)` gives each caller its own output, frees the
row of a caller that stops early, and reports a bad request to its caller only."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import random_model, tiny_config, truncated

from arborspec.runtime.backends.base import EngineCapabilities
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.bigram import BigramDraft
from arborspec.runtime.drafts.lookup import LookupDraft
from arborspec.runtime.drafts.model import ModelDraft
from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.sampling import SamplingParams


def _prompts(vocab, lengths=(5, 1, 17, 9, 3, 30, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _bigram(vocab, seed=3):
    g = torch.Generator().manual_seed(seed)
    return BigramDraft(None, torch.randn(vocab, vocab, generator=g) * 3, vocab)


def _counting(engine, calls: list):
    """The engine, recording each call's input_ids shape (B, T) in `calls`."""

    class Counting:
        info, device, caps = engine.info, engine.device, EngineCapabilities(row_views=True)

        def forward(self, ids, pos, mask, cache):
            calls.append(tuple(ids.shape))
            return engine.forward(ids, pos, mask, cache)

    return Counting()


CASES = [
    ("vanilla", None, "full:3,2"),
    ("chain", "model", "chain:3"),
    ("tree", "model", "full:3,2"),
    ("tree", "model", "dynamic:3,3,12"),
    ("tree", "model", "beam:3,4"),
    ("tree", "lookup", "full:3,2"),
    ("tree", "bigram", "full:2,3"),
]


def _draft(kind, draft_engine, vocab):
    return {
        None: lambda: None,
        "model": lambda: ModelDraft(draft_engine),
        "lookup": lambda: LookupDraft(vocab),
        "bigram": lambda: _bigram(vocab),
    }[kind]()


@pytest.mark.parametrize("mode,kind,tree", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_batched_greedy_equals_alone_torch(llama_pair, mode, kind, tree):
    target, draft_engine = llama_pair
    v = target.info.vocab_size
    prompts = _prompts(v)
    solo = SpeculativeDecoder(target, _draft(kind, draft_engine, v), mode=mode, tree=tree)
    ref = [solo.generate(p, 20) for p in prompts]
    # 3 rows for 7 prompts: sequences join and leave between steps (continuous batching)
    bd = BatchDecoder(target, _draft(kind, draft_engine, v), mode=mode, tree=tree, max_batch=3)
    got = bd.generate_many(prompts, 20)
    assert [s.tokens for s in got] == [r.tokens for r in ref]
    if mode != "vanilla":
        assert sum(s.stats.steps for s in got) < sum(s.stats.new_tokens for s in got)  # drafts accepted
    if kind == "model":
        # the batched draft (one B-row cache, one call per level) drafts the trees the sequence's
        # own draft would: the same verify steps, in fewer draft calls than sequence-levels
        assert [s.stats.steps for s in got] == [r.stats.steps for r in ref]
        assert bd.draft_batch.calls < sum(s.stats.draft_calls for s in got)


@pytest.mark.parametrize("kind,tree", [("model", "full:3,2"), ("lookup", "full:2,2")])
def test_a_sequence_at_the_end_of_the_context_pauses_the_trees_of_its_batch(kind, tree):
    """A batched call's columns run to the longest row's length + the tree rows: while that would
    pass max_position only the roots are verified and the other rows' drafts defer, then they
    speculate again once the long row has ended; every output equals vanilla decoding alone. (The
    limit is GroupQueryAttention's, pinned in tests/runtime/test_ort_decode.py; torch has none, so this pins
    that the pause and the drafts' deferral keep every row exact.)"""
    m = random_model(tiny_config("llama", max_position=64))
    target, d_eng = TorchEngine(m), TorchEngine(truncated(m, 1))
    v = target.info.vocab_size
    prompts = [_prompts(v, (56,))[0], _prompts(v, (3,), seed=1)[0]]
    vanilla = SpeculativeDecoder(target, None, mode="vanilla")
    want = [vanilla.generate(p, 30) for p in prompts]
    assert [w.stop_reason for w in want] == ["context", "length"]
    bd = BatchDecoder(target, _draft(kind, d_eng, v), mode="tree", tree=tree, max_batch=2)
    got = bd.generate_many(prompts, 30)
    assert [s.tokens for s in got] == [w.tokens for w in want]
    assert [s.stop_reason for s in got] == ["context", "length"]
    assert got[1].stats.steps < 30  # the short row's draft was used, before and after the pause


def test_batched_rows_share_one_draft_call_per_level(llama_pair):
    """4 sequences drafting full:3,2 trees cost 3 draft calls per step (one per level), not 12."""
    target, draft_engine = llama_pair
    calls = []
    bd = BatchDecoder(target, ModelDraft(_counting(draft_engine, calls)), tree="full:3,2", max_batch=4)
    for p in _prompts(target.info.vocab_size, (4, 9, 2, 6)):
        bd.add(p, 8)
    calls.clear()
    bd.step()
    # full:3,2 (depth 3, 2 children per node): the chains, then the 2 and 4 frontier nodes
    assert [c[0] for c in calls] == [4, 4, 4]
    assert calls[1][1] == 2 and calls[2][1] == 4


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_above_the_speculation_limit_drafts_only_stay_in_step(llama_pair, kind):
    """With more sequences than speculate_max_batch only roots are verified, so drafting whole
    trees there is wasted (an EAGLE-3 draft at 8 rows: 67.0 tok/s against 151.4 without one):
    the drafts make no call then (each queues the committed roots: DraftSource.defer), and once
    the batch is small again the remaining sequence drafts full trees that get accepted; every
    sequence equals decoding it alone."""
    target, draft_engine = llama_pair
    v = target.info.vocab_size
    short, long = _prompts(v, (6, 11), seed=5)
    solo = SpeculativeDecoder(target, _draft(kind, draft_engine, v), tree="full:3,2")
    ref = [solo.generate(short, 6).tokens, solo.generate(long, 40).tokens]
    calls = []
    d = ModelDraft(_counting(draft_engine, calls)) if kind == "model" else _draft(kind, draft_engine, v)
    bd = BatchDecoder(target, d, tree="full:3,2", max_batch=2, speculate_max_batch=1)
    a, b = bd.add(short, 6), bd.add(long, 40)
    per_step = []
    while not a.done:
        calls.clear()
        bd.step()
        per_step.append(len(calls))
    bd.remove(a)
    steps_alone = b.stats.steps
    while not b.done:
        bd.step()
    assert a.tokens == ref[0] and b.tokens == ref[1]
    if kind == "model":
        assert per_step and set(per_step) == {0}  # no draft call (full:3,2 makes 3 per step)
    tree_steps = b.stats.steps - steps_alone
    assert b.stats.new_tokens - len(per_step) > tree_steps  # trees accepted once the batch is small


def test_batched_rows_share_one_verify_call(llama_pair):
    """n active sequences cost one target call per step, not n."""
    target, draft_engine = llama_pair
    calls = []
    bd = BatchDecoder(_counting(target, calls), None, mode="vanilla", max_batch=4)
    for p in _prompts(target.info.vocab_size, (4, 4, 4, 4)):
        bd.add(p, 8)
    calls.clear()
    bd.step()
    assert calls == [(4, 1)]


def test_batched_stop_conditions_per_sequence(llama_pair):
    """Own max_new_tokens and EOS per sequence; the finished one leaves, the others go on."""
    target, draft_engine = llama_pair
    prompts = _prompts(target.info.vocab_size, (6, 11))
    solo = SpeculativeDecoder(target, ModelDraft(draft_engine), tree="full:2,2")
    ref = solo.generate(prompts[1], 30).tokens
    eos = ref[7]
    want = solo.generate(prompts[1], 30, eos_token_ids=[eos])
    bd = BatchDecoder(target, ModelDraft(draft_engine), tree="full:2,2", max_batch=2)
    a = bd.add(prompts[0], 5)
    b = bd.add(prompts[1], 30, [eos])
    while bd.seqs:
        for s, _ in bd.step():
            if s.done:
                bd.remove(s)
    assert len(a.tokens) == 5 and a.stop_reason == "length"
    assert b.tokens == want.tokens and b.stop_reason == "eos"


def test_batched_onnxruntime_both_layouts(tmp_path):
    """ONNX Runtime: the GroupQueryAttention graph ("bhsd": n rows of a larger cache by
    address) and the portable graph ("sbhd": unused rows padded) equal unbatched decoding."""
    pytest.importorskip("onnxruntime")
    from conftest import tiny_text_export

    from arborspec.runtime.export_dir import open_export

    for attention in ("gqa", "onnx"):
        d = tiny_text_export(tmp_path / attention, seed=4, attention=attention)
        with open_export(d, "onnxruntime", draft="lookup") as ex:
            v = ex.target.info.vocab_size
            prompts = _prompts(v, (7, 3, 12, 5), seed=2)
            solo = SpeculativeDecoder(ex.target, ex.draft, tree="full:3,2")
            ref = [solo.generate(p, 16).tokens for p in prompts]
            bd = BatchDecoder(ex.target, ex.draft.fork(), tree="full:3,2", max_batch=3)
            assert bd._row_views == (attention == "gqa")
            # GroupQueryAttention batches roots only: trees are verified while one sequence runs
            assert bd.speculate_max_batch == (1 if attention == "gqa" else 3)
            assert [s.tokens for s in bd.generate_many(prompts, 16)] == ref, attention
            # ... and those one-token steps are ragged (each row attends over its own length)
            assert (bd.ragged_steps > 0) == (attention == "gqa")
        with open_export(d, "onnxruntime") as ex:  # the export's layers:1 model draft
            solo = SpeculativeDecoder(ex.target, ex.draft, mode="chain", tree="chain:2")
            ref = [solo.generate(p, 12).tokens for p in prompts]
            bd = BatchDecoder(ex.target, ex.draft.fork(), mode="chain", tree="chain:2", max_batch=4)
            assert [s.tokens for s in bd.generate_many(prompts, 12)] == ref, attention


def test_batched_sampling_is_lossless():
    """The first two sampled tokens of a prompt follow the target's exact distribution when it
    is decoded in batches next to sequences of other lengths (rows with gaps in the cache)."""
    from lossless_util import PROMPT, chi_square_pvalue, exact_two_token_distribution

    cfg = dataclasses.replace(tiny_config("llama", vocab=8, layers=2, hidden=32), tie_embeddings=False)
    m = random_model(cfg, seed=5, scale=2.0)
    target, draft = TorchEngine(m), TorchEngine(truncated(m, 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only add overhead
    sp = SamplingParams(0.8, 0, 0.9)
    exact = exact_two_token_distribution(target, PROMPT, sp)
    n = 1500
    other = [4, 1, 6, 2, 7, 0, 3, 5, 1, 2]
    prompts = [PROMPT if i % 2 == 0 else other[: 2 + i % 8] for i in range(2 * n)]
    bd = BatchDecoder(target, ModelDraft(draft), tree="full:2,3", candidates="sample", max_batch=8)
    try:
        seqs = bd.generate_many(prompts, 2, sampling=sp, seeds=range(2 * n))
    finally:
        torch.set_num_threads(threads)
    counts = np.zeros((8, 8))
    for s in seqs[0::2]:
        counts[s.tokens[0], s.tokens[1]] += 1
    p = chi_square_pvalue(counts, exact)
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    assert sum(s.stats.steps for s in seqs) < sum(len(s.tokens) for s in seqs)  # drafts were used


def test_batch_rejects_bad_input(llama_pair):
    target, draft_engine = llama_pair
    with pytest.raises(InputError, match="max_batch must be an integer >= 1"):
        BatchDecoder(target, None, mode="vanilla", max_batch=0)
    bd = BatchDecoder(target, None, mode="vanilla", max_batch=1)
    with pytest.raises(InputError, match="outside the vocabulary"):
        bd.add([10**6], 4)
    with pytest.raises(InputError, match="2 SamplingParams for 3 prompts"):
        bd.generate_many([[1], [2], [3]], 4, (), [None, SamplingParams(0.7)])
    bd.add([1, 2], 4)
    with pytest.raises(InputError, match="batch full"):
        bd.add([1, 2], 4)
    # a draft declares whether it batches by overriding fork(): one without it is refused up front
    from arborspec.runtime.drafts.base import DraftSource
    from arborspec.runtime.drafts.model import as_draft_source

    class Unforkable(DraftSource):
        kind = "unforkable"
        vocab_size = target.info.vocab_size

        def start(self, root):
            return torch.zeros(self.vocab_size)

    assert not Unforkable().batchable and as_draft_source(draft_engine).batchable
    with pytest.raises(InputError, match="draft unforkable cannot be batched"):
        BatchDecoder(target, Unforkable(), mode="tree", tree="chain:2", max_batch=2)


def test_generator_max_batch_threads(llama_pair):
    """Generator(max_batch=4): 8 threads decode together, each gets its own greedy output;
    a caller that stops early frees its row; a bad prompt fails only its own call."""
    target, draft_engine = llama_pair
    v = target.info.vocab_size
    prompts = _prompts(v, (5, 8, 2, 13, 4, 9, 1, 6), seed=7)
    solo = Generator(target, ModelDraft(draft_engine), tree="full:2,2")
    ref = [solo.generate(p, 12).tokens for p in prompts]
    gen = Generator(target, ModelDraft(draft_engine), tree="full:2,2", max_batch=4)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: gen.generate(p, 12), prompts))
        assert [c.tokens for c in got] == ref
        assert all(c.stats.new_tokens == 12 for c in got)
        sched = gen._batch
        assert sched.batch_sizes / sched.steps > 1.5  # rows really shared verify calls
        # stop early: the row is freed, the next call runs
        it = gen.stream(prompts[0], 200, ids=True)
        next(it)
        it.close()
        assert it.stats is not None and it.stats.new_tokens >= 1  # its stats so far
        for _ in range(200):
            if gen.active == 0:
                break
            threading.Event().wait(0.01)
        assert gen.active == 0
        with pytest.raises(InputError, match="outside the vocabulary"):
            gen.generate([v + 5], 4)
        assert gen.generate(prompts[1], 12).tokens == ref[1]
    finally:
        gen.close()
    with pytest.raises(InputError, match="closed"):
        gen.generate(prompts[0], 4)


def test_cache_grows_between_joins(llama_pair):
    """A cache grown inside a step (a long sequence passing the first allocation) takes new
    rows afterwards; both sequences still equal decoding them alone."""
    target, draft_engine = llama_pair
    long, short = _prompts(target.info.vocab_size, (250, 4), seed=11)
    solo = SpeculativeDecoder(target, ModelDraft(draft_engine), tree="full:2,2")
    ref_long, ref_short = solo.generate(long, 24).tokens, solo.generate(short, 8).tokens
    bd = BatchDecoder(target, ModelDraft(draft_engine), tree="full:2,2", max_batch=2)
    a = bd.add(long, 24)
    first = bd._cache.max_len
    while bd._cache.max_len == first:
        bd.step()
    b = bd.add(short, 8)
    while not (a.done and b.done):
        bd.step()
    assert a.tokens == ref_long and b.tokens == ref_short


@pytest.mark.parametrize("kind", [None, "model"], ids=["vanilla", "model-draft"])
def test_batch_caches_read_only_zeroed_or_written_columns(llama_pair, monkeypatch, kind):
    """Batch caches are zeroed lazily (KVCache.ensure_finite, through sized_cache before every
    call and join): with every new slab full of NaN, batched decoding (target and batched model
    draft, joins, a growth past the first allocation, rows leaving) still equals decoding alone,
    so no call reads a column that was neither zeroed nor written."""
    import arborspec.runtime.kvcache as kv

    target, draft_engine = llama_pair
    v = target.info.vocab_size
    prompts = _prompts(v, (5, 260, 1, 17, 9), seed=4)
    mode, tree = ("vanilla", None) if kind is None else ("tree", "full:3,2")
    solo = SpeculativeDecoder(target, _draft(kind, draft_engine, v), mode=mode, tree=tree)
    ref = [solo.generate(p, 20).tokens for p in prompts]
    init = kv.KVCache.__init__

    def nan_filled(self, *a, **k):
        init(self, *a, **k)
        self.k.fill_(float("nan"))
        self.v.fill_(float("nan"))

    monkeypatch.setattr(kv.KVCache, "__init__", nan_filled)
    bd = BatchDecoder(target, _draft(kind, draft_engine, v), mode=mode, tree=tree, max_batch=3)
    got = bd.generate_many(prompts, 20)
    assert [s.error for s in got] == [None] * len(prompts)
    assert [s.tokens for s in got] == ref
    assert bd._cache.finite < bd._cache.max_len  # zeroed as used, not whole


def test_nan_in_one_row_fails_only_that_sequence(llama_pair):
    """A row whose logits go NaN ends its own sequence with a NumericalError; the sequences
    sharing its verify calls finish with their exact outputs."""
    from arborspec.runtime.errors import NumericalError

    target, _ = llama_pair
    v = target.info.vocab_size
    others = _prompts(v, (5, 4), seed=5)
    ref = [SpeculativeDecoder(target, None, mode="vanilla").generate(p, 10).tokens for p in others]
    seen = {t for p, r in zip(others, ref) for t in p + r}
    poison = next(t for t in range(v) if t not in seen)  # a token only the poisoned sequence feeds
    forward = target.forward

    class Poisoning:
        info, device, caps = target.info, target.device, EngineCapabilities(row_views=True)

        def forward(self, ids, pos, mask, cache):
            logits = forward(ids, pos, mask, cache)
            logits[(ids == poison).any(-1)] = float("nan")
            return logits

    gen = Generator(Poisoning(), None, mode="vanilla", max_batch=3)
    try:
        with ThreadPoolExecutor(3) as pool:
            bad = pool.submit(gen.generate, [poison] * 6, 10)
            good = [pool.submit(gen.generate, p, 10) for p in others]
            with pytest.raises(NumericalError):
                bad.result()
            assert [f.result().tokens for f in good] == ref
        assert gen.active == 0
    finally:
        gen.close()


def test_close_ends_in_flight_streams(llama_pair):
    """Shutting a batched generator down ends every in-flight stream with one error line (no
    hang, no half-open iterator); waiting requests too."""
    target, _ = llama_pair
    gen = Generator(target, None, mode="vanilla", max_batch=2)  # 2 rows: the third request waits
    got, errors = [], []

    def consume(prompt):
        try:
            for chunk in gen.stream(prompt, 400, ids=True):
                got.append(chunk)
        except InputError as e:
            errors.append(str(e))

    gen2 = Generator(target, None, mode="vanilla", max_batch=2)
    gen2.close()
    with pytest.raises(InputError, match="closed"):
        gen2.generate([1, 2], 4)
    threads = [threading.Thread(target=consume, args=([1, 2, 3],)) for _ in range(3)]
    for t in threads:
        t.start()
    while not got:
        threading.Event().wait(0.005)
    gen.close()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 3 and all("closed" in e for e in errors)


def test_max_batch_over_the_engines_profiles_is_one_line(llama_pair):
    """A TensorRT engine's profiles fix its largest B: asking for more is one clear error."""
    target, _ = llama_pair

    class Built:
        info, device, caps = target.info, target.device, EngineCapabilities(max_batch=2)

    with pytest.raises(InputError, match="rebuild it with `arborspec build --max-batch 4`"):
        BatchDecoder(Built(), None, mode="vanilla", max_batch=4)
    assert BatchDecoder(Built(), None, mode="vanilla", max_batch=2).max_batch == 2


@pytest.mark.parametrize("mode,kind", [("vanilla", None), ("tree", "model")])
def test_a_batchs_root_probabilities_in_one_call_draw_what_each_row_alone_draws(llama_pair, monkeypatch, mode, kind):
    """Where the logits live on a GPU, every sampled sequence's root row is warped in one call a
    step (`batched_root_probs`, on there by default). Forced on here on the CPU: the same tokens
    as one row at a time and as each sequence decoded alone with its seed, two sampling settings
    in one batch, and one `probs` call per setting and step for the root rows."""
    import arborspec.runtime.batch_decode as bd_mod

    target, draft_engine = llama_pair
    v = target.info.vocab_size
    prompts = _prompts(v, (5, 1, 17, 9, 3), seed=7)
    sps = [SamplingParams(0.9, top_p=0.8) if i % 2 else SamplingParams(1.2, top_k=20) for i in range(len(prompts))]
    alone = [
        SpeculativeDecoder(target, _draft(kind, draft_engine, v), mode=mode, sampling=sp)
        .generate(p, 12, seed=10 + i)
        .tokens
        for i, (p, sp) in enumerate(zip(prompts, sps))
    ]
    calls = []
    real = bd_mod.probs
    monkeypatch.setattr(bd_mod, "probs", lambda x, sp: calls.append(tuple(x.shape)) or real(x, sp))
    outs = {}
    for batched in (False, True):
        dec = BatchDecoder(target, _draft(kind, draft_engine, v), mode=mode, max_batch=len(prompts))
        assert dec.batched_root_probs is False  # the CPU's default
        dec.batched_root_probs = batched
        seqs = [dec.add(p, 12, (), 10 + i, sampling=sp) for i, (p, sp) in enumerate(zip(prompts, sps))]
        steps = 0
        while any(not s.done for s in dec.seqs):
            dec.step()
            steps += 1
        outs[batched] = [list(s.tokens) for s in seqs]
        dec.close()
        if batched:
            # the first step: one call for each setting's rows (3 and 2), then as sequences finish
            assert sorted(calls[:2]) == [(2, v), (3, v)] and len(calls) <= 2 * steps, calls
        else:
            assert not calls
    assert outs[True] == outs[False] == alone


@pytest.mark.parametrize("mode", ["vanilla", "tree"])
def test_nan_logits_while_sampling_are_a_numerical_error(llama_pair, mode):
    """A sampled walk turns rows into probabilities as it reads them: NaN logits there are the
    guard's NumericalError at the step (was a ValueError from the sampler: a traceback alone,
    and in a batch it ended every sequence)."""
    from arborspec.runtime.errors import NumericalError

    target, draft_engine = llama_pair
    forward = target.forward

    class Broken:
        info, device, caps = target.info, target.device, target.caps

        def forward(self, ids, pos, mask, cache):
            return torch.full_like(forward(ids, pos, mask, cache), float("nan"))

    draft = ModelDraft(draft_engine) if mode == "tree" else None
    dec = SpeculativeDecoder(Broken(), draft, mode=mode, sampling=SamplingParams(0.8, top_p=0.9))
    with pytest.raises(NumericalError, match="NaN in the logits"):
        dec.generate([1, 2, 3], 4)
