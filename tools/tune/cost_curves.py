"""Measured cost curves: a verify call's time c(T) and a draft level's time d(F) on a backend.

Role in one decode step: none at run time; measures what steps 1 and 3 cost, for `tune`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Sequence

import torch

from arborspec.runtime.step import host_threads


def sample_sizes(max_size: int) -> list[int]:
    base = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    return sorted({s for s in base if s <= max_size} | {max_size})


def decoder_threads(engine):
    """The torch threads the decoder runs its host work on beside `engine` (runtime/step.host_threads:
    1 beside ONNX Runtime on the CPU), for timing its calls as the decoder makes them: torch's own
    threads, woken by the host work between calls, otherwise compete with ONNX Runtime's pool and
    overcharge every row past the first (figures: benchmarks/RESULTS.md, "The decode loop's tax").
    An engine without capabilities (an EAGLE-3 head): the caller's setting (tune sets the target's)."""
    return host_threads(engine) if getattr(engine, "caps", None) is not None else nullcontext()


def _sync_of(engine):
    dev = getattr(engine, "device", None)
    return torch.cuda.synchronize if dev is not None and getattr(dev, "type", "") == "cuda" else None


def _time_sizes(calls: dict, reps: int, sync=None) -> dict:
    """{size: ms}: every call warmed up, then timed `reps` times in round-robin rounds (so a
    burst of load from other processes hits all sizes alike); the minimum per size (the
    least-disturbed run), then made non-decreasing in size (a slower small call is noise:
    it is capped by the cost of the next larger size)."""
    times: dict = {s: [] for s in calls}
    for fn in calls.values():
        fn()
    if sync:
        sync()
    for _ in range(reps):
        for s, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            times[s].append(time.perf_counter() - t0)
    out = {s: 1e3 * min(ts) for s, ts in times.items()}
    run = float("inf")
    for s in sorted(out, reverse=True):
        run = min(run, out[s])
        out[s] = run
    return dict(sorted(out.items()))


def _call_curve(engine, sizes: Sequence[int], past: int, reps: int, run) -> dict:
    """{T: ms} of the call `run(ids, pos, mask, cache, gen)` returns (a zero-argument function),
    with T new tokens after `past` cached positions of `engine`'s cache (zeros: the cost does not
    depend on them); `gen` is the size's seeded generator, for any further random inputs."""
    from arborspec.runtime.kvcache import KVCache

    past = max(0, min(past, engine.info.max_position - max(sizes) - 1))
    cache = KVCache(engine.info.cache, past + max(sizes) + 1, 1, engine.device)
    cache.k.zero_()  # finite values in the past the calls read (not the allocator's leftovers)
    cache.v.zero_()
    dev = engine.device
    calls = {}
    for t in sizes:
        g = torch.Generator().manual_seed(t)
        ids = torch.randint(0, engine.info.vocab_size, (1, t), generator=g).to(dev)
        pos = (torch.arange(t) + past)[None].to(dev)
        mask = torch.ones(1, t, past + t, dtype=torch.bool, device=dev)
        fn = run(ids, pos, mask, cache, g)

        def call(fn=fn):
            cache.length = past
            fn()

        calls[int(t)] = call
    with decoder_threads(engine):
        return _time_sizes(calls, reps, _sync_of(engine))


def engine_cost_curve(engine, sizes: Sequence[int], past: int = 256, reps: int = 5, progress=None) -> dict:
    """{T: ms} of one engine call with T new tokens after `past` cached positions."""
    return _call_curve(
        engine, sizes, past, reps, lambda ids, pos, mask, cache, g: lambda: engine.forward(ids, pos, mask, cache)
    )


def draft_cost_curve(draft, sizes: Sequence[int], past: int = 256, reps: int = 5, progress=None) -> dict:
    """{F: ms} of one draft level call over F frontier nodes (an engine call, or a table gather)."""
    from arborspec.runtime.drafts.bigram import BigramDraft
    from arborspec.runtime.drafts.lookup import LookupDraft

    if isinstance(draft, LookupDraft):  # a table lookup per node, no model
        probe = draft.fork()
        g = torch.Generator().manual_seed(0)
        probe.reset(torch.randint(0, 64, (past,), generator=g).tolist())  # a small alphabet: every n-gram hits
        tail = probe.ctx[-probe.max_n :]
        return _time_sizes({int(f): (lambda f=f: probe._topk([tail] * f, 8, True)) for f in sizes}, reps)
    if getattr(draft, "lookup", None) is not None:  # a mixed draft: its model's calls (lookup: ~0.1 ms)
        base = draft.base
        if not getattr(base, "needs_target_features", False) and hasattr(base, "engine"):
            base = base.engine  # a ModelDraft: its engine's level call
        return draft_cost_curve(base, sizes, past, reps, progress)
    if getattr(draft, "needs_target_features", False):
        return head_cost_curve(draft.engine, sizes, past, reps)  # an EAGLE-3 head
    if isinstance(draft, BigramDraft):
        calls = {}
        for f in sizes:
            toks = torch.randint(0, draft.vocab_size, (f,), generator=torch.Generator().manual_seed(f))
            calls[int(f)] = lambda toks=toks: draft._rows(toks)
        return _time_sizes(calls, reps)
    if not hasattr(draft, "info") and hasattr(draft, "engine"):
        draft = draft.engine  # a ModelDraft (an export's layers:K draft): its engine's level call
    return engine_cost_curve(draft, sizes, past, reps, progress)


def head_cost_curve(head, sizes: Sequence[int], past: int = 256, reps: int = 5) -> dict:
    """{F: ms} of one EAGLE-3 head level over F nodes (each a token with a hidden state) after
    `past` cached draft positions: `forward_hidden`, the call a tree level makes."""

    def run(ids, pos, mask, cache, g):
        hid = torch.randn(1, ids.shape[1], head.hidden_size, generator=g).to(head.device)
        return lambda: head.forward_hidden(ids, hid, pos, mask, cache)

    return _call_curve(head, sizes, past, reps, run)
