"""What the row-invariant layout costs: verify call time, plain vs laid out, chains and trees.

Role in one decode step: none; it prices step 3 (the target's verify call) under the ONNX
Runtime engine's row-invariant layout (runtime/backends/row_layout.py): a one-row call padded
to two rows, a tree either spread over bands of 16 rows ("bands", one call) or verified as one
chain call per root-to-leaf path ("paths"). Times are the best of `--reps` calls after a
warm-up, at P cached positions.

    python -m arborspec.tools.bench.layout_cost EXPORT_DIR --past 256 --trees "[[0],[1],[0,0]]" full:2,2 chain:4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from arborspec.runtime.backends import row_layout
from arborspec.runtime.backends.onnxruntime import OrtEngine
from arborspec.runtime.errors import ArborspecError
from arborspec.runtime.kvcache import KVCache
from arborspec.tools.tune.tree_dp import tree_ancestors


def tree_inputs(paths: list[list[int]], p: int):
    """ids, positions, mask [1, ...] of root + the rank paths (parents before children)."""
    anc = tree_ancestors(paths)
    t = anc.shape[0]
    mask = torch.cat([torch.ones(t, p, dtype=torch.bool), anc], 1)[None]
    pos = p + anc.sum(1)[None] - 1
    ids = torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(t))
    return ids, pos, mask


def timed(engine, ids, pos, mask, cache: KVCache, p: int) -> float:
    cache.length = p
    t0 = time.perf_counter()
    engine.forward(ids, pos, mask, cache)
    cache.length = p
    return 1e3 * (time.perf_counter() - t0)


def best_of(variants: dict, reps: int) -> dict:
    """{name: best ms} of zero-argument calls, run interleaved (a load spike hits them alike)."""
    for fn in variants.values():
        fn()
    best = {k: float("inf") for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            best[k] = min(best[k], fn())
    return best


def measure(path: Path, past: int, sizes: list[int], trees: list[str], reps: int) -> dict:
    from arborspec.tools.tune.acceptance_sim import spec_paths

    plain = OrtEngine(path, row_invariant=False)
    bands = OrtEngine(path, row_invariant=True)
    bands.tree_layout = "bands"
    by_path = OrtEngine(path, row_invariant=True)
    by_path.tree_layout = "paths"
    cache = KVCache(plain.info.cache, past + 300, 1).zero_()
    res: dict = {"past": past, "chain": {}, "trees": {}}
    for t in sizes:
        ids = torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(t))
        pos = (past + torch.arange(t))[None]
        mask = torch.cat([torch.ones(t, past, dtype=torch.bool), torch.ones(t, t, dtype=torch.bool).tril()], 1)[None]
        res["chain"][t] = best_of(
            {
                "plain_ms": lambda: timed(plain, ids, pos, mask, cache, past),
                "laid_out_ms": lambda: timed(bands, ids, pos, mask, cache, past),
            },
            reps,
        )
    for spec in trees:
        paths = json.loads(spec) if spec.startswith("[") else spec_paths(spec)
        ids, pos, mask = tree_inputs(paths, past)
        anc = row_layout.ancestors(mask, past)
        rows = row_layout.slots(pos[0], anc, past)
        row = best_of(
            {
                f"{k}_ms": (lambda e=e: timed(e, ids, pos, mask, cache, past))
                for k, e in (("plain", plain), ("bands", bands), ("paths", by_path))
            },
            reps,
        )
        row.update(nodes=ids.shape[1], band_rows=None if rows is None else max(rows) + 1)
        row["path_calls"] = len(row_layout.paths(anc))
        res["trees"][spec] = row
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="layout_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--trees", nargs="*", default=["[[0],[1],[0,0]]", "full:2,2", "full:3,2", "full:4,1"])
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # as the decoder's host work runs (step.host_threads)
    try:
        res = measure(a.export_dir / "target.onnx", a.past, [int(x) for x in a.sizes.split(",")], a.trees, a.reps)
    except (ArborspecError, ValueError) as e:
        print(f"layout_cost: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
