"""The torch backend's static-shape calls (runtime/backends/cuda_graphs.py), run eagerly on the CPU
(`cuda_graphs="static"`): the computation a CUDA graph captures and replays on a GPU
(tests/tools/test_gpu.py replays it there). Each call pads T to a bucket and attends over the cache's
whole slab with the unused part hidden; these tests pin that this changes nothing a decoder sees."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_model, tiny_config

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.lookup import LookupDraft
from arborspec.runtime.errors import DeviceError
from arborspec.runtime.kvcache import KVCache

PROMPT = [1, 5, 7, 9, 3, 11, 5, 7, 9, 3]


def _tree_mask(t: int, p: int, parents: list[int]) -> torch.Tensor:
    m = torch.zeros(1, t, p + t, dtype=torch.bool)
    m[0, :, :p] = True
    for i in range(t):
        j = i
        while j >= 0:
            m[0, i, p + j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_static_call_equals_the_eager_call_and_writes_the_same_cache(family):
    m = random_model(tiny_config(family), seed=1)
    eager, static = TorchEngine(copy.deepcopy(m)), TorchEngine(copy.deepcopy(m), cuda_graphs="static")
    ca, cb = (KVCache(e.info.cache, 64, 1) for e in (eager, static))
    cb.k.fill_(float("nan"))  # what torch.empty may hold: hidden keys must not leak NaN
    cb.v.fill_(float("nan"))
    g = torch.Generator().manual_seed(0)
    for t, parents in ((7, list(range(-1, 6))), (1, [-1]), (5, [-1, 0, 0, 1, 2]), (3, [-1, -1, -1])):
        p = ca.length
        ids = torch.randint(0, m.config.vocab_size, (1, t), generator=g)
        depth = [0] * t
        for i, q in enumerate(parents):
            depth[i] = depth[q] + 1 if q >= 0 else 0
        pos = torch.tensor([depth]) + p
        mask = _tree_mask(t, p, parents)
        la, lb = eager.forward(ids, pos, mask, ca), static.forward(ids, pos, mask, cb)
        assert lb.shape == la.shape and torch.isfinite(lb).all()
        # equal up to float32 reassociation (other matrix shapes), relative to the logits' scale
        tol = 1e-5 * float(la.abs().max())
        torch.testing.assert_close(lb, la, rtol=0, atol=tol)
        assert int((lb.argmax(-1) != la.argmax(-1)).sum()) == 0
        torch.testing.assert_close(cb.k[:, p : p + t], ca.k[:, p : p + t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cb.v[:, p : p + t], ca.v[:, p : p + t], rtol=1e-5, atol=1e-5)
        ca.length = cb.length = p + t  # commit all of them
    # one entry per bucket used (7 -> 8, 1, 5 -> 8, 3 -> 4), on one slab
    assert sorted(k[-1] for k in static.static.entries) == [1, 4, 8]
    assert static.static.captured == 0  # eager static calls on the CPU: nothing captured


@pytest.mark.parametrize("spec", ["chain:4", "full:3,2", "dynamic:3,4,10"])
def test_static_calls_decode_the_same_tokens(spec):
    """Greedy decoding through static calls, target and draft: tree == its vanilla == the eager
    vanilla, token for token, with a layers:1 draft and with lookup."""
    from arborspec.export.export_folder import truncated_draft

    m = random_model(tiny_config("llama", max_position=256), seed=2)
    ref = SpeculativeDecoder(TorchEngine(copy.deepcopy(m)), mode="vanilla").generate(PROMPT, 32).tokens
    target = TorchEngine(copy.deepcopy(m), cuda_graphs="static")
    assert SpeculativeDecoder(target, mode="vanilla").generate(PROMPT, 32).tokens == ref
    mode = "chain" if spec.startswith("chain") else "tree"
    for draft in (
        TorchEngine(truncated_draft(copy.deepcopy(m), 1), cuda_graphs="static"),
        LookupDraft(m.config.vocab_size),
    ):
        r = SpeculativeDecoder(target, draft, mode=mode, tree=spec).generate(PROMPT, 32)
        assert r.tokens == ref, (spec, type(draft).__name__)
    assert len({k[-1] for k in target.static.entries}) > 1  # several T buckets were used


def test_long_calls_fall_back_to_the_eager_path_and_graphs_need_cuda():
    m = random_model(tiny_config("llama"), seed=3)
    eng = TorchEngine(m, cuda_graphs="static")
    cache = KVCache(eng.info.cache, 300, 1)
    t = 200  # no bucket holds it (a long prefill)
    ids = torch.randint(0, m.config.vocab_size, (1, t))
    out = eng.forward(ids, torch.arange(t)[None], torch.ones(1, t, t, dtype=torch.bool).tril(), cache)
    assert out.shape == (1, t, m.config.vocab_size) and not eng.static.entries
    ref = TorchEngine(copy.deepcopy(m)).forward(
        ids, torch.arange(t)[None], torch.ones(1, t, t, dtype=torch.bool).tril(), KVCache(eng.info.cache, 300, 1)
    )
    torch.testing.assert_close(out, ref)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="CUDA device"):
            TorchEngine(copy.deepcopy(m), cuda_graphs=True)


def test_cuda_graphs_flag_off_the_torch_cuda_path_is_one_error_line(capsys):
    from arborspec.tools.commands.cli import main

    for extra in (["--model", "smollm2-135m"], ["--export-dir", "nowhere", "--device", "cuda"]):
        rc = main(["generate", *extra, "--prompt", "hi", "--cuda-graphs", "--max-new-tokens", "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "--cuda-graphs needs --backend torch on a CUDA --device" in err[0], err


def test_batched_decoding_through_static_calls_equals_each_prompt_alone():
    """BatchDecoder over static-call engines (batch rows: one entry per row count, on the
    batch cache's slab): every sequence equals its own eager vanilla decode."""
    from arborspec.export.export_folder import truncated_draft
    from arborspec.runtime.batch_decode import BatchDecoder

    m = random_model(tiny_config("llama", max_position=256), seed=2)
    prompts = [[1, 5, 7, 9, 3, 11] * 2, [4, 4, 8, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1], [2, 3]]
    ref = [SpeculativeDecoder(TorchEngine(copy.deepcopy(m)), mode="vanilla").generate(p, 24).tokens for p in prompts]
    for kind in ("layers:1", "lookup"):
        target = TorchEngine(copy.deepcopy(m), cuda_graphs="static")
        if kind == "lookup":
            draft = LookupDraft(m.config.vocab_size)
        else:
            draft = TorchEngine(truncated_draft(copy.deepcopy(m), 1), cuda_graphs="static")
        dec = BatchDecoder(target, draft, mode="tree", tree="full:2,2", max_batch=3)
        got = [list(s.tokens) for s in dec.generate_many(prompts, 24, [], None, [0] * len(prompts))]
        assert got == ref, kind
        assert len({k[2][2] for k in target.static.entries}) > 1  # entries for several row counts


def test_a_bucket_may_reach_past_the_slab_end():
    """A call whose T fits the cache but whose padded bucket does not (a 65-row dynamic tree padded
    to 128 near the end of a sequence) stays static: padded rows never reach the slab. It used to
    fall back to the eager path (on the H100 the dynamic:8,6,64 tree then ran at eager speed under
    CUDA graphs, benchmarks/history/RESULTS-2026-11.md)."""
    m = random_model(tiny_config("llama"), seed=4)
    eager, static = TorchEngine(copy.deepcopy(m)), TorchEngine(copy.deepcopy(m), cuda_graphs="static")
    ca, cb = (KVCache(e.info.cache, 20, 1) for e in (eager, static))
    ids = torch.randint(0, m.config.vocab_size, (1, 14))
    causal = torch.ones(1, 14, 14, dtype=torch.bool).tril()
    for e, c in ((eager, ca), (static, cb)):
        e.forward(ids, torch.arange(14)[None], causal, c)
        c.length = 14
    t, parents = 5, [-1, 0, 0, 1, 2]  # bucket 8: 14 + 8 > 20, 14 + 5 <= 20
    pos = torch.tensor([[14, 15, 15, 16, 16]])
    la = eager.forward(ids[:, :t], pos, _tree_mask(t, 14, parents), ca)
    before = static.static.eager
    lb = static.forward(ids[:, :t], pos, _tree_mask(t, 14, parents), cb)
    assert static.static.eager == before and any(k[-1] == 8 for k in static.static.entries)
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-5 * float(la.abs().max()))
    torch.testing.assert_close(cb.k[:, 14:19], ca.k[:, 14:19], rtol=1e-5, atol=1e-5)
    # a dynamic tree through to the end of its sequence: every call static, tokens == vanilla
    m2 = random_model(tiny_config("llama", max_position=256), seed=2)
    ref = SpeculativeDecoder(TorchEngine(copy.deepcopy(m2)), mode="vanilla").generate(PROMPT, 32).tokens
    target = TorchEngine(copy.deepcopy(m2), cuda_graphs="static")
    r = SpeculativeDecoder(target, LookupDraft(m2.config.vocab_size), mode="tree", tree="dynamic:3,4,16").generate(
        PROMPT, 32
    )
    assert r.tokens == ref and target.static.eager == 0


def test_a_call_goes_to_the_cheapest_measured_bucket_that_holds_it():
    """Replays are timed at capture (a GPU); a call then takes the cheapest captured bucket that
    holds it (fp32 on the H100: 32 rows cost less than 8). Costs injected here (the CPU captures
    nothing): a 3-token call with bucket 8 measured cheaper than 4 and 16 runs padded to 8, and its
    logits and K/V equal the eager call's; without measurements it takes the smallest bucket."""
    from arborspec.runtime.backends.cuda_graphs import MAX_SLABS, StaticCalls, _Entry

    m = random_model(tiny_config("llama"), seed=5)
    eager, static = TorchEngine(copy.deepcopy(m)), TorchEngine(copy.deepcopy(m), cuda_graphs="static")
    ca, cb = (KVCache(e.info.cache, 64, 1) for e in (eager, static))
    ids = torch.randint(0, m.config.vocab_size, (1, 3))
    pos, mask = torch.tensor([[0, 1, 1]]), _tree_mask(3, 0, [-1, 0, 0])
    slab = StaticCalls._slab(cb)
    static.forward(ids, pos, mask, cb)
    assert static.static.routed == 0 and [k[-1] for k in static.static.entries] == [4]
    entries = static.static.entries
    for tb, ms in ((8, 1.0), (16, 1.5)):  # entries of larger buckets on this slab, as a GPU would time them
        entries[(*slab, tb)] = _Entry(cb, tb, static.static.n_layers, (ids,))
        entries[(*slab, tb)].ms = ms
    entries[(*slab, 4)].ms = 2.0
    lb = static.forward(ids, pos, mask, cb)
    la = eager.forward(ids, pos, mask, ca)
    assert static.static.routed == 1
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-5 * float(la.abs().max()))
    torch.testing.assert_close(cb.k[:, :3], ca.k[:, :3], rtol=1e-5, atol=1e-5)
    # the timings live with their slab's entries: a new slab keeps them, the oldest of
    # MAX_SLABS + 1 slabs loses both
    others = [KVCache(static.info.cache, 64 + i, 1) for i in range(1, MAX_SLABS + 1)]
    static.forward(ids, pos, mask, others[0])
    assert entries[(*slab, 8)].ms == 1.0
    static.forward(ids, pos, mask, cb)
    assert static.static.routed == 2  # still routed after another slab joined
    for c in others[1:]:
        static.forward(ids, pos, mask, c)
    assert not any(k[:4] == slab for k in static.static.entries)


class _CacheOnCuda0(KVCache):
    """A CPU cache that reports what a cache made on a GPU reports: cuda:0."""

    device = property(lambda self: torch.device("cuda", 0))


def test_a_cuda_engine_keeps_its_cache_from_one_generation_to_the_next(monkeypatch):
    """An engine made with device="cuda" and the cache it made (on cuda:0) are on one device. The
    old check compared torch.device("cuda") with cuda:0 (unequal in torch), so on the H100 every
    generate() allocated a new cache and captured new CUDA graphs for it: 6 captures while timed
    on vanilla (benchmarks/history/RESULTS-2026-11.md, "GPU: the fourth session"). Checked here without a GPU."""
    from arborspec.runtime.kvcache import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    spec = TorchEngine(random_model(tiny_config("llama"), seed=1)).info.cache
    cache = _CacheOnCuda0(spec, 64, 1)
    assert cache.fits(spec, 64, 1, "cuda") and cache.fits(spec, 32, 1, torch.device("cuda"))
    assert not cache.fits(spec, 64, 1, "cpu") and not cache.fits(spec, 65, 1, "cuda")


class _FakeCuda:
    """Stand-ins for the torch.cuda calls of a capture (streams, graphs, timing events), so the
    capture path runs on the CPU: a "graph" replays nothing, its outputs are the captured call's."""

    class Graph:
        def replay(self):
            pass

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 3.0

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass


def test_the_capture_path_runs_on_the_cpu_with_stand_ins(monkeypatch):
    """The GPU-only lines of cuda_graphs.py (capture on a side stream, time the replays) run with
    stand-ins for torch.cuda: a renamed buffer there failed only on a GPU before (an entry's `ids`
    became `rows`; the capture still read `e.ids`). One call: captured, timed, its outputs (the
    captured call's) equal the eager call's."""
    import contextlib

    from arborspec.runtime.backends.cuda_graphs import StaticCalls

    fake = _FakeCuda
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", fake.Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    m = random_model(tiny_config("llama"), seed=2)
    eager = TorchEngine(copy.deepcopy(m))
    static = StaticCalls(eager.module, m.config.n_layers, capture=True)
    ca, cb = (KVCache(eager.info.cache, 64, 1) for _ in range(2))
    ids = torch.randint(0, m.config.vocab_size, (1, 3))
    pos, mask = torch.tensor([[0, 1, 2]]), _tree_mask(3, 0, [-1, 0, 1])
    with torch.inference_mode():
        (logits,), new_k, _ = static.run((ids,), pos, mask, cb)
    assert static.captured == 1 and static.replays == 1
    assert [e.ms for e in static.entries.values()] == [1.0]  # 3 replays timed at 3.0 ms in all
    la = eager.forward(ids, pos, mask, ca)
    torch.testing.assert_close(logits, la, rtol=0, atol=1e-5 * float(la.abs().max()))
    torch.testing.assert_close(new_k, ca.k[:, :3], rtol=1e-5, atol=1e-5)
