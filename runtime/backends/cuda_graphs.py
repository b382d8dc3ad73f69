"""Static-shape calls of the PyTorch backend, replayed as CUDA graphs on a GPU.

Role in one decode step: the torch backend's verify call (and each call of a torch draft, and
each call of a torch EAGLE-3 head: step 1, drafting) on a GPU. Eager PyTorch spends its time launching kernels there: a call of a 1B Llama
costs about the same at every T from 1 to 128, and the same call captured once and replayed costs
a fraction of that (benchmarks/history/RESULTS-2026-11.md, "GPU"). A graph replays fixed shapes and addresses, so each call is made
static before it runs:

* the past is the cache's whole slab [0, S) (S = the cache's capacity, its addresses fixed), and
  the mask hides [P, S): a hidden key gets exp(finfo.min - max) = 0 weight, so the probabilities
  are those of attending over [0, P). The slab past P is zeroed once per cache, so the hidden
  keys are finite (torch.empty may hold NaN patterns, and 0 * NaN is NaN);
* T is padded up to a bucket (1, 2, 4, ..., 128); a padded row reads position P and sees only
  itself; its logits and K/V are dropped (they never reach the slab, so a bucket may reach past
  the slab's end: only the T real rows need room there);
* the call's rows (a target's ids; a head's token embeddings and hidden states), positions and
  mask are copied into the entry's buffers, the graph replays, and the T real rows of its outputs
  are read back; the new K/V go to [P, P+T) as on the eager path.

One entry per (cache slab, batch rows, T bucket), captured at its first use (a few eager
warm-up calls, then the capture) and its replay timed. Calls the buckets do not cover (long
prefills) run eagerly. A call goes to the cheapest captured bucket that holds it, not always the
smallest: cuBLAS's fp32 kernel for 8 rows made SmolLM2's replay slower at T = 8 than at T = 32
on the H100 (benchmarks/history/RESULTS-2026-11.md, "GPU: the third session").
`capture=False` runs the same static calls eagerly: that is what the CPU tests check, the graph
only replays it. Exactness is the eager path's: in fp32 a row's logits can differ in the last
bits between T buckets (other matrix kernels), as they can between eager calls of other T.
"""

from __future__ import annotations

import torch

from ..kvcache import KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_SLABS = 4  # caches whose entries are kept (a decoder reuses its cache; a server has a few)


class _Entry:
    """The buffers (and the graph) of one static call shape."""

    def __init__(self, cache: KVCache, tb: int, n_layers: int, rows: tuple):
        b, s = cache.k.shape[2], cache.k.shape[1]
        dev = cache.k.device
        self.s = s
        self.rows = [torch.zeros(b, tb, *r.shape[2:], dtype=r.dtype, device=dev) for r in rows]
        self.pos = torch.zeros(b, tb, dtype=torch.long, device=dev)
        self.mask = torch.zeros(b, tb, s + tb, dtype=torch.bool, device=dev)
        self.diag = torch.arange(tb, device=dev)
        self.past = []
        for i in range(n_layers):
            self.past += [cache.k[i], cache.v[i]]  # the whole slab [S, B, Hkv, D]: fixed addresses
        self.graph = None
        self.out = None
        self.ms: float | None = None  # a replay's measured milliseconds (captured entries)

    def fill(self, rows: tuple, pos, mask, p: int) -> None:
        t, s = pos.shape[1], self.s
        for buf, r in zip(self.rows, rows):
            buf.zero_()  # padded rows: token 0, or zero embeddings and hidden states (finite)
            buf[:, :t] = r
        self.pos.fill_(p)
        self.pos[:, :t] = pos
        m = self.mask
        m.zero_()
        m[:, self.diag, s + self.diag] = True  # every row sees itself (padded rows only that)
        m[:, :t, :p] = mask[:, :, :p]
        m[:, :t, s : s + t] = mask[:, :, p:]


class StaticCalls:
    """The static calls of one module (see the module docstring): module(*rows, positions, mask,
    *past K/V of each layer) -> outputs per row [B, T, ..] with the new K/V of each layer [T, B, H, D]
    from output `kv_first` on (a target: logits, K/V.., features; an EAGLE-3 head: logits, hidden
    states, K, V). `run` -> (the per-row outputs, new K/V [L, T, B, H, D] x 2) for the T real rows,
    or None when no bucket holds T (the caller runs the eager call)."""

    def __init__(
        self, module: torch.nn.Module, n_layers: int, capture: bool = True, buckets=BUCKETS, kv_first: int = 1
    ):
        self.module, self.n_layers, self.capture, self.buckets = module, n_layers, capture, tuple(buckets)
        self.kv_first = kv_first
        self.entries: dict = {}
        self.captured = 0  # graphs captured so far (the GPU test reads it)
        self.replays = 0
        self.routed = 0  # calls replayed at a larger bucket than the smallest that holds them
        self.eager = 0  # calls no bucket held, run on the eager path (bench_gpu reports them)

    def bucket(self, t: int) -> int | None:
        return next((b for b in self.buckets if b >= t), None)

    @staticmethod
    def _slab(cache: KVCache) -> tuple:
        return (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape), tuple(cache.k.stride()))

    def _route(self, slab: tuple, tb: int) -> int:
        """tb, or a larger bucket captured on this slab whose replay measured cheaper."""
        timed = {b: e.ms for b in self.buckets if (e := self.entries.get((*slab, b))) and e.ms is not None}
        if tb not in timed:
            return tb
        return min((b for b in timed if b >= tb), key=lambda b: (timed[b], b))

    @staticmethod
    def _time(e: _Entry) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e.graph.replay()
        start.record()
        for _ in range(3):
            e.graph.replay()
        end.record()
        end.synchronize()
        e.ms = start.elapsed_time(end) / 3

    def _entry(self, cache: KVCache, slab: tuple, tb: int, rows: tuple) -> _Entry:
        key = (*slab, tb)
        e = self.entries.get(key)
        if e is None:
            slabs = list(dict.fromkeys(k[:4] for k in self.entries))
            if key[:4] not in slabs:  # a slab seen for the first time
                if len(slabs) >= MAX_SLABS:  # entries hold their slab alive: forget the oldest
                    self.entries = {k: v for k, v in self.entries.items() if k[:4] != slabs[0]}
                cache.k[:, cache.length :].zero_()  # hidden keys must be finite (module docstring)
                cache.v[:, cache.length :].zero_()
            e = self.entries[key] = _Entry(cache, tb, self.n_layers, rows)
        return e

    def _call(self, e: _Entry):
        return self.module(*e.rows, e.pos, e.mask, *e.past)

    def _capture(self, e: _Entry) -> None:
        side = torch.cuda.Stream(e.pos.device)
        side.wait_stream(torch.cuda.current_stream(e.pos.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: lazy initialisation and allocator state before the capture
                self._call(e)
        torch.cuda.current_stream(e.pos.device).wait_stream(side)
        e.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(e.graph):
            e.out = self._call(e)
        self.captured += 1

    def run(self, rows: tuple, pos, mask, cache: KVCache):
        t = pos.shape[1]
        tb = self.bucket(t)
        if cache.spec.layout != "sbhd" or tb is None or cache.length + t > cache.max_len:
            self.eager += 1
            return None
        slab = self._slab(cache)
        routed = self._route(slab, tb)
        self.routed += routed != tb
        e = self._entry(cache, slab, routed, rows)
        e.fill(rows, pos, mask, cache.length)
        if not self.capture:
            out = self._call(e)
        else:
            if e.graph is None:
                self._capture(e)
                self._time(e)
            e.graph.replay()
            self.replays += 1
            out = e.out
        a, z = self.kv_first, self.kv_first + 2 * self.n_layers
        kv = out[a:z]
        # copies: a graph's outputs are overwritten by its next replay, the caller may keep them
        per_row = tuple(x[:, :t].clone() for x in (*out[:a], *out[z:]))
        return per_row, torch.stack([k[:t] for k in kv[0::2]]), torch.stack([v[:t] for v in kv[1::2]])
