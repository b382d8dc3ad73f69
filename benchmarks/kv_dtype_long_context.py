"""Vanilla decoding at long context on ONNX Runtime CPU: exports side by side (e.g. the fp32 and
the `--kv-dtype fp16` cache), each repeat alternating between them, median time to first token
and decode tok/s.

    python benchmarks/kv_dtype_long_context.py --export fp32=DIR32 --export fp16=DIR16 \
        --prompt-tokens 4000 --max-new-tokens 64 --repeats 3 --json-out benchmarks/kv_dtype_long_context.json

The prompt is a paragraph repeated and cut to exactly --prompt-tokens ids of the first export's
tokenizer (all exports must share it); greedy; the lookup-free vanilla loop (draft none).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting the one "
    "hundred and twelve steps as his father had taught him, checking the brass fittings, trimming "
    "the wick and polishing the great lens until it caught the last of the sunlight. Ships passed "
    "far out on the grey water, and he wrote each one in the logbook with the time, the heading "
    "and the weather: wind from the north-west, a light swell, rain expected before midnight. "
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)

    from arborspec.runtime.generator import Generator

    gens = {}
    for spec in args.export:
        label, _, d = spec.partition("=")
        gens[label] = (d, Generator.from_export(d, draft="none"))
    tok = next(iter(gens.values()))[1].tokenizer
    n = 1
    while len(ids := tok.encode(PARAGRAPH * n)) < args.prompt_tokens:
        n *= 2
    ids = ids[: args.prompt_tokens]
    for _, g in gens.values():  # warm-up: sessions, the reused target cache at full size
        g.generate(ids, 4)
    runs = {label: [] for label in gens}
    for r in range(args.repeats):
        for label, (_, g) in gens.items():
            t0 = time.perf_counter()
            c = g.generate(ids, args.max_new_tokens)
            wall = time.perf_counter() - t0
            st = c.stats
            runs[label].append(
                {
                    "ttft_s": st.ttft_s,
                    "tokens_per_s": st.tokens_per_s,
                    "new_tokens": st.new_tokens,
                    "wall_s": wall,
                    "loadavg": os.getloadavg()[0],
                    "tokens": c.tokens,
                }
            )
            print(
                f"{label} run {r}: first token {st.ttft_s:.2f} s, decode {st.tokens_per_s:.2f} tok/s "
                f"({st.new_tokens} tokens), load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    out = {
        "prompt_tokens": len(ids),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "exports": {label: d for label, (d, _) in gens.items()},
        "median": {
            label: {
                "ttft_s": statistics.median(x["ttft_s"] for x in rs),
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
            }
            for label, rs in runs.items()
        },
        "runs": runs,
    }
    labels = list(gens)
    out["same_tokens"] = all(runs[labels[0]][0]["tokens"] == runs[x][0]["tokens"] for x in labels)
    for label, m in out["median"].items():
        print(f"{label}: median first token {m['ttft_s']:.2f} s, median decode {m['tokens_per_s']:.2f} tok/s")
    print(f"same greedy tokens across exports: {out['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    for _, g in gens.values():
        g.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
