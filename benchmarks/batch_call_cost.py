"""What a batched verify call costs: one target call of B rows x T = 1 token over P cached
columns (every row attends over all P: rows share the cache's columns), median of N calls, for
docs/serving.md, "Batched decoding".

    python benchmarks/batch_call_cost.py --export-dir DIR [--batches 1,4,8] [--pasts 128,2048] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from arborspec.runtime.export_dir import open_export
from arborspec.runtime.kvcache import KVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--pasts", default="128,2048")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    with open_export(a.export_dir, "onnxruntime", draft="none") as ex:
        eng = ex.target
        for p in [int(x) for x in a.pasts.split(",")]:
            for b in [int(x) for x in a.batches.split(",")]:
                cache = KVCache(eng.info.cache, p + 1, b).zero_()
                cache.length = p
                ids = torch.ones(b, 1, dtype=torch.long)
                pos = torch.full((b, 1), p, dtype=torch.long)
                mask = torch.ones(b, 1, p + 1, dtype=torch.bool)
                times = []
                for i in range(a.calls + 2):
                    t0 = time.perf_counter()
                    eng.forward(ids, pos, mask, cache)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                ms = 1e3 * statistics.median(times)
                rows.append({"B": b, "P": p, "ms_per_call": ms, "ms_per_row": ms / b})
                print(f"P={p:5d} B={b}: {ms:7.1f} ms per call, {ms / b:6.1f} ms per row", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"export_dir": a.export_dir, "layout": eng.kv_layout, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
