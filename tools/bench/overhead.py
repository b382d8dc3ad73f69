"""Benchmark: the runtime's own time per decoding step, model calls excluded.

Role: measures steps 1-5 of a decoding step minus the engine calls: tree building (the
policy's selection, top-k over the draft logits, ancestor bookkeeping), flattening,
accept/reject and the KV commits of target and draft. The engines here are "null" engines
with a real model's shapes (default SmolLM2-135M: 30 layers, 3 KV heads, head dim 64,
vocabulary 49152) that return precomputed logits instantly, so what is timed is exactly
the runtime's overhead.

    python -m arborspec.tools.bench.overhead --trees chain:4 full:3,2 beam:4,8,8 dynamic:8,6,64 \
        --steps 200 [--vocab 49152] [--threads 1] [--temperature 0.8 [--top-p 0.95]] [--host-topk] [--json OUT]
    python -m arborspec.tools.bench.overhead --batch 8 32 128 --threads 1   # BatchDecoder, vanilla
    python -m arborspec.tools.bench.overhead --batch 128 --temperature 1 --top-p 0.95   # sampled rows

--batch N...: the batched decoder's host time per step (flatten, accept, commit) for N rows of
vanilla decoding (a server above its speculation limit, the GPU corpus generator).
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch

from arborspec.runtime.backends.base import EngineCapabilities, EngineInfo
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.kvcache import CacheSpec
from arborspec.runtime.sampling import SamplingParams
from arborspec.tools.errors import reports_mistakes
from arborspec.tools.options import tool_parser


class HostTopkNullEngine:
    """The same null engine without `forward_topk`: the runtime takes the draft's top-k from
    the full logits rows on the host (what an ONNX Runtime CPU draft without fused top-k costs)."""

    caps = EngineCapabilities()  # max_topk 0: no forward_topk

    def __init__(self, inner):
        self.inner, self.info, self.device = inner, inner.info, inner.device

    def forward(self, *a):
        return self.inner.forward(*a)


class NullEngine:
    """Returns logits from a fixed random bank (peaked so trees get accepted) and writes zeros
    where a real engine writes the new tokens' K/V (the cache tail: so the memory a commit
    gathers from was touched by the engine call, as in real decoding); the slabs have real
    shapes, so KV commits cost what they cost."""

    def __init__(self, vocab=49152, layers=30, kv_heads=3, head_dim=64, seed=0, copy_of=None):
        if copy_of is not None:
            vocab = copy_of.info.vocab_size
        self.info = EngineInfo(vocab, 1 << 20, CacheSpec(layers, kv_heads, head_dim, torch.float32), name="null")
        self.device = torch.device("cpu")
        g = torch.Generator().manual_seed(seed)
        # next-token logits depend on the last token only: a bigram "model", so a draft with
        # the same bank agrees with the target and trees get accepted
        self.bank = copy_of.bank if copy_of is not None else torch.randn(512, vocab, generator=g) * 4

        self._top: dict = {}
        self.caps = EngineCapabilities(max_topk=vocab)

    def forward(self, ids, pos, mask, cache):
        p, t = cache.length, ids.shape[1]
        cache.k[:, p : p + t].zero_()
        cache.v[:, p : p + t].zero_()
        return self.bank[ids % self.bank.shape[0]]

    def forward_topk(self, ids, pos, mask, cache, k, logprobs=False):
        """A draft engine that computes its top-k where its logits are (fused in the ONNX graph,
        on the GPU): precomputed here, so the host sees only [F, k]."""
        if (k, logprobs) not in self._top:
            from arborspec.runtime.drafts.base import topk_of

            t = topk_of(self.bank, k, logprobs)
            self._top[(k, logprobs)] = (t.values, t.indices)
        v, i = self._top[(k, logprobs)]
        p, t = cache.length, ids.shape[1]
        cache.k[:, p : p + t].zero_()
        cache.v[:, p : p + t].zero_()
        r = ids % self.bank.shape[0]
        return v[r], i[r]


def measure(
    tree: str,
    steps: int,
    sp: SamplingParams,
    prompt_len: int = 256,
    mode: str = "tree",
    vocab: int = 49152,
    host_topk: bool = False,
) -> dict:
    target = NullEngine(vocab=vocab)
    draft = NullEngine(copy_of=target)
    if host_topk:
        draft = HostTopkNullEngine(draft)
    dec = SpeculativeDecoder(target, draft, mode=mode, tree=tree, sampling=sp)
    prompt = [i % vocab for i in range(prompt_len)]
    dec.generate(prompt, 16)  # warm-up
    res = dec.generate(prompt, steps * 4, seed=1)
    st = res.stats
    return {
        "tree": tree,
        "steps": st.steps,
        "nodes_per_step": st.tree_nodes / max(st.steps, 1),
        "mean_accepted": st.mean_accepted,
        "overhead_ms_per_step": st.overhead_per_step_ms,
        "tree_build_ms": 1e3 * (st.draft_s - st.draft_model_s) / st.steps,
        "accept_kv_ms": 1e3 * st.accept_kv_s / st.steps,
        "other_ms": 1e3 * st.other_s / st.steps,
    }


def measure_batch(rows: int, new: int = 48, vocab: int = 49152, sampling: SamplingParams | None = None) -> dict:
    """BatchDecoder over the null engine: `rows` sequences of ragged lengths, vanilla, `new`
    tokens each (greedy, or `sampling`: each row its own seed); the host time per step is the
    step's time minus the engine's. The rows run once untimed first: the cache's memory touched,
    as a long-running server's or generator's is (the first touch of each new column's pages was
    most of a step's host time on this VM otherwise)."""
    from arborspec.runtime.batch_decode import BatchDecoder

    target, spent = NullEngine(vocab=vocab), [0.0]

    class Timed:  # the engine's own time, left out of the runtime's
        info, device, caps = target.info, target.device, target.caps

        def forward(self, *a):
            t = time.perf_counter()
            out = target.forward(*a)
            spent[0] += time.perf_counter() - t
            return out

    bd = BatchDecoder(Timed(), None, mode="vanilla", max_batch=rows)
    for timed in (False, True):
        for s in list(bd.seqs):
            bd.remove(s)
        for i in range(rows):
            bd.add(list(range(16 + i % 7)), new, sampling=sampling, seed=i)
        spent[0], steps, t0 = 0.0, 0, time.perf_counter()
        while any(not s.done for s in bd.seqs):
            bd.step()
            steps += 1
    host = time.perf_counter() - t0 - spent[0]
    return {
        "rows": rows,
        "steps": steps,
        "host_ms_per_step": 1e3 * host / steps,
        "host_us_per_row": 1e6 * host / steps / rows,
    }


@reports_mistakes("overhead")
def main(argv=None) -> int:
    p = tool_parser(__doc__)
    p.add_argument(
        "--trees",
        nargs="+",
        default=["chain:4", "full:3,2", "full:2,8", "beam:4,8,8,8", "dynamic:8,6,64", "beam:4,16,16,16,12"],
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--vocab",
        type=int,
        default=49152,
        help="vocabulary of the null models (49152 = SmolLM2; a small one isolates the "
        "tree bookkeeping from the vocabulary-wide top-k/argmax)",
    )
    p.add_argument(
        "--host-topk",
        action="store_true",
        help="the draft engine returns full logits rows and the runtime takes their top-k on the "
        "host (default: the draft engine returns its top-k, as a fused graph or a GPU does)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=None, metavar="N", help="BatchDecoder rows (see above)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from arborspec.runtime.trees import parse_tree_spec

    # a mistake in the arguments is one line, before any measuring
    sp = SamplingParams(a.temperature, top_p=a.top_p)
    for t in [] if a.batch else a.trees:
        parse_tree_spec(t)
    if a.batch:
        rows = [measure_batch(n, vocab=a.vocab, sampling=None if sp.greedy else sp) for n in a.batch]
        print(f"{'rows':>5s} {'steps':>6s} {'host ms/step':>12s} {'us/row':>7s}")
        for r in rows:
            print(f"{r['rows']:5d} {r['steps']:6d} {r['host_ms_per_step']:12.2f} {r['host_us_per_row']:7.1f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "batch": rows}, f, indent=1)
        return 0
    rows = [measure(t, a.steps, sp, vocab=a.vocab, host_topk=a.host_topk) for t in a.trees]
    print(
        f"{'tree':22s} {'nodes':>6s} {'acc/step':>8s} {'overhead ms':>11s} {'tree':>7s} {'accept+kv':>9s} {'other':>7s}"
    )
    for r in rows:
        print(
            f"{r['tree']:22s} {r['nodes_per_step']:6.1f} {r['mean_accepted']:8.2f} {r['overhead_ms_per_step']:11.3f} "
            f"{r['tree_build_ms']:7.3f} {r['accept_kv_ms']:9.3f} {r['other_ms']:7.3f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "machine": platform.processor() or platform.machine(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "vocab": a.vocab,
                    "host_topk": a.host_topk,
                    "temperature": a.temperature,
                    "top_p": a.top_p,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
