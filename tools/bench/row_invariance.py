"""Row invariance of a target graph: does a row's result depend on how a call carries it?

Role in one decode step: none; it checks the property tree verification relies on. Vanilla
decoding computes each token's logits (and the K/V it writes) in its own call; a verify call
computes the same token as one row of T, possibly with siblings between it and its ancestors.
Greedy tree == vanilla holds by construction only if those are bit-identical. This measures,
after a prefix of P tokens, for a reference continuation x_0..x_{n-1} decoded one call per token:

* `t_call`   row k of one causal call of T tokens (T = 2..n), every k;
* `batched`  the same tokens decoded one per call in a batch of two sequences (B = 2, T = 1);
* `gap`      x_1 verified g rows after its parent x_0 (g-1 masked siblings in between), g = 1..;
* `tree`     a random tree holding the continuation as one of its paths, as the decoder sends it.

Each line: the scenario, the largest |logit difference| and |K/V difference| against the
one-token decoding, and whether they are bit-identical.

    python -m arborspec.tools.bench.row_invariance EXPORT_DIR --past 40 --tokens 8
    python -m arborspec.tools.bench.row_invariance EXPORT_DIR --layout raw   # the engine without its layout
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from arborspec.runtime.backends import row_layout
from arborspec.runtime.backends.onnxruntime import OrtEngine
from arborspec.runtime.errors import ArborspecError
from arborspec.runtime.kvcache import KVCache


def prefilled(engine, prefix: torch.Tensor, max_len: int, batch: int = 1) -> KVCache:
    """A cache holding `prefix` [P] (one causal call; P = 0 gives an empty cache)."""
    cache = KVCache(engine.info.cache, max_len, batch).zero_()
    p = prefix.numel()
    if p:
        ids = prefix[None].expand(batch, p).contiguous()
        pos = torch.arange(p)[None].expand(batch, p).contiguous()
        mask = torch.ones(p, p, dtype=torch.bool).tril()[None].expand(batch, p, p).contiguous()
        engine.forward(ids, pos, mask, cache)
        cache.commit(None, p)
    return cache


def clone(cache: KVCache) -> KVCache:
    c = KVCache(cache.spec, cache.max_len, cache.batch)
    c.k.copy_(cache.k)
    c.v.copy_(cache.v)
    c.length = cache.length
    return c


def kv_at(cache: KVCache, positions, row: int = 0) -> torch.Tensor:
    """K and V of the given absolute positions, all layers: [2, L, Hkv, n, D]."""
    idx = torch.as_tensor(positions, dtype=torch.long)
    return torch.stack([cache.k[:, row].index_select(2, idx), cache.v[:, row].index_select(2, idx)])


def tree_call(engine, cache: KVCache, ids, depth, parent):
    """One call over a flattened tree (parents before children) on a copy of `cache`:
    -> (logits [T, V], the copy). depth/parent: per node (parent -1: a root seeing the cache)."""
    c = clone(cache)
    p, t = c.length, len(ids)
    anc = torch.zeros(t, t, dtype=torch.bool)
    for j in range(t):
        anc[j, j] = True
        if parent[j] >= 0:
            anc[j] |= anc[parent[j]]
    mask = torch.cat([torch.ones(t, p, dtype=torch.bool), anc], 1)[None]
    pos = (p + torch.as_tensor(depth, dtype=torch.long))[None]
    logits = engine.forward(torch.as_tensor(ids, dtype=torch.long)[None], pos, mask, c)
    return logits[0], c


def one_by_one(engine, cache: KVCache, ids: list[int]):
    """Vanilla decoding of `ids` one call each: (logits [n, V], the cache after)."""
    c, out = clone(cache), []
    for x in ids:
        p = c.length
        mask = torch.ones(1, 1, p + 1, dtype=torch.bool)
        out.append(engine.forward(torch.tensor([[x]]), torch.tensor([[p]]), mask, c)[0, 0])
        c.commit(None, 1)
    return torch.stack(out), c


class PadOnly:
    """An engine whose one-row calls get a dummy second row, and nothing else (the `pad` layout)."""

    def __init__(self, engine):
        self.engine, self.info = engine, engine.info

    def forward(self, ids, pos, mask, cache):
        if ids.shape != (1, 1) or cache.length == 0:
            return self.engine.forward(ids, pos, mask, cache)
        call = row_layout.padded_call(ids, pos, mask, cache.length, [0])
        return self.engine.forward(*call, cache)[:, :1]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def measure(engine, prefix: torch.Tensor, cont: list[int], gaps: list[int], seed: int = 0) -> list[dict]:
    """The scenarios of the module docstring -> rows {scenario, logits, kv, identical}."""
    n, p = len(cont), prefix.numel()
    max_len = p + 16 * max(gaps + [4 * n]) + 80
    base = prefilled(engine, prefix, max_len)
    ref, ref_cache = one_by_one(engine, base, cont)
    ref_kv = kv_at(ref_cache, range(p, p + n))
    rows = []

    def add(name, lg, lg_ref, kv, kv_ref):
        dl, dk = _diff(lg, lg_ref), _diff(kv, kv_ref)
        rows.append({"scenario": name, "logits": dl, "kv": dk, "identical": dl == 0 and dk == 0})

    for t in range(2, n + 1):
        lg, c = tree_call(engine, base, cont[:t], list(range(t)), list(range(-1, t - 1)))
        add(f"t_call T={t}", lg, ref[:t], kv_at(c, range(p, p + t)), ref_kv[:, :, :, :t])
    # batched: two sequences, one token per call each
    bcache = prefilled(engine, prefix, max_len, batch=2)
    out = []
    for x in cont:
        pos = torch.full((2, 1), bcache.length, dtype=torch.long)
        mask = torch.ones(2, 1, bcache.length + 1, dtype=torch.bool)
        out.append(engine.forward(torch.tensor([[x], [x]]), pos, mask, bcache)[0, 0])
        bcache.commit(None, 1)
    add("batched B=2 T=1", torch.stack(out), ref, kv_at(bcache, range(p, p + n)), ref_kv)
    g = torch.Generator().manual_seed(seed)
    vocab = engine.info.vocab_size
    for gap in gaps:  # x_0, gap-1 siblings of x_1 (children of x_0), then x_1
        sib = torch.randint(0, vocab, (gap - 1,), generator=g).tolist()
        ids = [cont[0]] + sib + [cont[1]]
        lg, c = tree_call(engine, base, ids, [0] + [1] * gap, [-1] + [0] * gap)
        add(f"gap g={gap}", lg[[0, gap]], ref[:2], kv_at(c, [p, p + gap]), ref_kv[:, :, :, :2])
    # a tree (BFS order) with the continuation as one path whose nodes have width-1 siblings
    for width in (2, 3, 4):
        ids, depth, parent, path = [cont[0]], [0], [-1], [0]
        for d in range(1, n):
            for k in range(width):
                ids.append(cont[d] if k == width // 2 else int(torch.randint(0, vocab, (1,), generator=g)))
                depth.append(d)
                parent.append(path[-1])
            path.append(len(ids) - width + width // 2)
        lg, c = tree_call(engine, base, ids, depth, parent)
        add(f"tree width={width} T={len(ids)}", lg[path], ref, kv_at(c, [p + j for j in path]), ref_kv)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="row_invariance", description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--past", type=int, default=40, help="prefix length P (default 40)")
    ap.add_argument("--tokens", type=int, default=8, help="continuation length n (default 8)")
    ap.add_argument("--gaps", default="1,2,3,5,8,15,16,17,31,32,33,48,64")
    ap.add_argument(
        "--layout",
        choices=("raw", "pad", "full"),
        default="full",
        help="raw: the engine without its row-invariant layout; pad: only one-row calls padded to two rows; "
        "full (default): the engine's layout (runtime/backends/row_layout.py)",
    )
    ap.add_argument("--chunk", type=int, default=0, help="override row_layout.CHUNK (an experiment)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # as the decoder's host work runs (step.host_threads)
    try:
        if a.chunk:
            row_layout.CHUNK = a.chunk
        engine = OrtEngine(a.export_dir / "target.onnx", row_invariant=a.layout == "full")
        if a.layout == "pad":
            engine = PadOnly(engine)
        g = torch.Generator().manual_seed(a.seed)
        v = engine.info.vocab_size
        prefix = torch.randint(0, v, (a.past,), generator=g)
        cont = torch.randint(0, v, (a.tokens,), generator=g).tolist()
        rows = measure(engine, prefix, cont, [int(x) for x in a.gaps.split(",")], a.seed)
    except (ArborspecError, ValueError) as e:
        print(f"row_invariance: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['scenario']:24s} logits {r['logits']:.3g}  kv {r['kv']:.3g}  {'==' if r['identical'] else '!='}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
