"""Penalised speculation on SmolLM2 (the int4 export v24 = `make demo`'s, the EAGLE-3 head and its
tuned tree): vanilla vs the tuned tree, without and with the request's penalties, 8 packaged chat
prompts x 64 tokens, greedy, interleaved in one process; median tok/s and whether the tree's
tokens equal vanilla's under the same penalties.

    .venv/bin/python benchmarks/history/penalties_2026-11-28/run.py [EXPORT_DIR] > benchmarks/history/penalties_2026-11-28/result.json
"""

import json
import os
import statistics
import sys

import arborspec
from arborspec.runtime.generator import Generator

E = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24")
PROMPTS = [p["text"] for p in json.load(open("tools/data/prompts.json"))["prompts"][:8]]
SETTINGS = {
    "none": {},
    "repetition 1.2": {"repetition_penalty": 1.2},
    "presence 0.5 + frequency 0.5": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
}

arborspec.enable_shared_pool()
out = {"export": E, "prompts": len(PROMPTS), "max_new_tokens": 64, "rows": {}}
with Generator.from_export(E, mode="vanilla", prefix_cache=False) as van, Generator.from_export(
    E, tree=os.environ.get("TREE", "auto"), prefix_cache=False
) as tree:
    for g in (van, tree):  # warm-up
        g.generate(PROMPTS[0], 8, chat=True)
    for name, kw in SETTINGS.items():
        speeds = {"vanilla": [], "tree": []}
        same, calls = 0, []
        for p in PROMPTS:
            a = van.generate(p, 64, chat=True, **kw)
            b = tree.generate(p, 64, chat=True, **kw)
            speeds["vanilla"].append(a.stats.tokens_per_s)
            speeds["tree"].append(b.stats.tokens_per_s)
            same += a.tokens == b.tokens
            calls.append(b.stats.mean_accepted)
        ratio = statistics.median(t / v for t, v in zip(speeds["tree"], speeds["vanilla"]))
        out["rows"][name] = {
            "vanilla_tok_s_median": round(statistics.median(speeds["vanilla"]), 1),
            "tree_tok_s_median": round(statistics.median(speeds["tree"]), 1),
            "speedup_median_of_ratios": round(ratio, 3),
            "tokens_per_target_call": round(statistics.mean(calls), 3),
            "tree_equals_vanilla": f"{same}/{len(PROMPTS)}",
        }
        print(name, out["rows"][name], file=sys.stderr)
print(json.dumps(out, indent=1))
