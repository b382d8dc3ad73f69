"""A grammar's forced tokens verified as one chain (runtime/decode.forced_chain) on SmolLM2 (the
int4 export v24 = `make demo`'s, the EAGLE-3 head, its tuned tree): the 8 extraction requests of
benchmarks/history/structured_2026-11-28 with their JSON schemas (96 tokens) and the 8 tool-call requests
of benchmarks/history/tool_calls_2026-11-29 with tool_choice "required" (128 tokens), and the same schemas
with llguidance's fixed separators ("x-guidance": no free whitespace), greedy; per request,
interleaved in one process: vanilla, the tree without forced chains (decode.MIN_FORCED set out of
reach: the decoder before this change) and the tree with them. Reports median tok/s, the median of
per-request ratios to vanilla, target calls, and whether all three give the same tokens.

    .venv/bin/python benchmarks/history/forced_chains_2026-11-29/run.py [EXPORT_DIR] > benchmarks/history/forced_chains_2026-11-29/result.json
"""

import importlib.util
import json
import os
import statistics
import sys

import arborspec
import arborspec.runtime.step as decode  # MIN_FORCED / MAX_FORCED: runtime/step.py since issue 63
from arborspec.runtime.generator import Generator

HERE = os.path.dirname(os.path.abspath(__file__))
E = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24")


def cases_of(folder: str, name: str):
    """A sibling benchmark's run.py as a module (its CASES / TOOLS; its run is behind __main__)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "..", folder, "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


structured = cases_of("structured_2026-11-28", "structured")
tools = cases_of("tool_calls_2026-11-29", "tools")
MIN = decode.MIN_FORCED
FIXED = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}

arborspec.enable_shared_pool()
out = {"export": E, "min_forced": MIN, "max_forced": decode.MAX_FORCED, "rows": {}}
with Generator.from_export(E, mode="vanilla", prefix_cache=False) as van, Generator.from_export(
    E, tree="auto", prefix_cache=False
) as tree:
    for g in (van, tree):  # warm-up; every grammar compiled once before timing
        g.chat([{"role": "user", "content": "hi"}], 8, tools=tools.TOOLS, tool_choice="required")
        for _, schema in structured.CASES:
            for sc in (schema, schema | FIXED):
                g.grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": sc}})
    jobs = {
        "json_schema": [
            (lambda g, p=p, s=s: g.generate(p, 96, chat=True, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": s}}))
            for p, s in structured.CASES
        ],
        # the same schemas with llguidance's fixed separators (", " and ": ", no free whitespace)
        "json_schema_fixed_separators": [
            (lambda g, p=p, s=s: g.generate(p, 96, chat=True, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": s | FIXED}}))
            for p, s in structured.CASES
        ],
        "tool_calls_required": [
            (lambda g, p=p: g.chat([{"role": "user", "content": p}], 128, tools=tools.TOOLS, tool_choice="required"))
            for p, _ in tools.CASES
        ],
    }
    for kind, runs in jobs.items():
        rows = {"vanilla": [], "tree, no forced chains": [], "tree, forced chains": []}
        calls = {k: [] for k in rows}
        same = 0
        for job in runs:
            a = job(van)
            decode.MIN_FORCED = 10**9
            b = job(tree)
            decode.MIN_FORCED = MIN
            c = job(tree)
            for k, r in zip(rows, (a, b, c)):
                rows[k].append(r.stats.tokens_per_s)
                calls[k].append(r.stats.steps)
            same += a.tokens == b.tokens == c.tokens
        out["rows"][kind] = {
            k: {
                "tok_s": round(statistics.median(v), 1),
                "vs_vanilla_median_ratio": round(statistics.median(x / y for x, y in zip(v, rows["vanilla"])), 3),
                "target_calls": sum(calls[k]),
            }
            for k, v in rows.items()
        } | {"identical_tokens": f"{same}/{len(runs)}"}
print(json.dumps(out, indent=1))
