"""Structured output on SmolLM2 (the int4 export v24 = `make demo`'s, the EAGLE-3 head, its tuned
tree): 8 extraction requests of our own, each with its JSON schema, greedy, 96 tokens at most;
vanilla and the tuned tree, constrained (response_format json_schema) and not, interleaved in one
process. Reports median tok/s, tokens per target call, whether the tree's tokens equal vanilla's,
and how many answers parse and follow their schema.

    .venv/bin/python benchmarks/structured_2026-11-28/run.py > benchmarks/structured_2026-11-28/result.json
"""

import json
import os
import statistics
import sys

import arborspec
from arborspec.runtime.generator import Generator

E = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24")


def obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}
CASES = [
    ("Tomas Berg is 41 and works as a nurse in Malmo. Give his name, age and job as JSON.", obj({"name": S, "age": I, "job": S})),
    ("Invoice 7731 from Larchwood Ltd totals 412.50 EUR. Extract number, vendor, total and currency.",
     obj({"number": S, "vendor": S, "total": N, "currency": S})),
    ("The meeting on March 3 at 10am in room B2 is about the budget. Extract date, time, room, topic.",
     obj({"date": S, "time": S, "room": S, "topic": S})),
    ("Rate this review as positive or negative, with a score from 1 to 5: 'The soup was cold and late.'",
     obj({"sentiment": {"enum": ["positive", "negative"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("List three fruits that are red, as JSON with a key fruits.", obj({"fruits": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}})),
    ("Pancakes need flour, milk, two eggs and butter. Give the ingredients as a list.", obj({"ingredients": {"type": "array", "items": S}})),
    ("Call Ana Ruiz at 555-0142 or ana@example.org. Extract her name, phone and email.", obj({"name": S, "phone": S, "email": S})),
    ("Is Paris the capital of France? Answer with a boolean and a one-sentence reason.", obj({"answer": {"type": "boolean"}, "reason": S})),
]


def follows(text: str, schema: dict) -> bool:
    try:
        o = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(o, dict) and set(o) == set(schema["properties"])


arborspec.enable_shared_pool()
out = {"export": E, "requests": len(CASES), "max_new_tokens": 96, "rows": {}}
with Generator.from_export(E, mode="vanilla", prefix_cache=False) as van, Generator.from_export(
    E, tree="auto", prefix_cache=False
) as tree:
    for g in (van, tree):  # warm-up, and each schema compiled once (llguidance) before timing
        g.generate(CASES[0][0], 8, chat=True)
        for _, schema in CASES:
            g.grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for constrained in (False, True):
        sp = {"vanilla": [], "tree": []}
        same = valid = 0
        calls = []
        for prompt, schema in CASES:
            kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}} if constrained else {}
            a = van.generate(prompt, 96, chat=True, **kw)
            b = tree.generate(prompt, 96, chat=True, **kw)
            sp["vanilla"].append(a.stats.tokens_per_s)
            sp["tree"].append(b.stats.tokens_per_s)
            same += a.tokens == b.tokens
            valid += follows(a.text, schema)
            calls.append(b.stats.mean_accepted)
        row = {
            "vanilla_tok_s_median": round(statistics.median(sp["vanilla"]), 1),
            "tree_tok_s_median": round(statistics.median(sp["tree"]), 1),
            "speedup_median_of_ratios": round(statistics.median(t / v for t, v in zip(sp["tree"], sp["vanilla"])), 3),
            "tokens_per_target_call": round(statistics.mean(calls), 3),
            "tree_equals_vanilla": f"{same}/{len(CASES)}",
            "answers_that_parse_and_follow_the_schema": f"{valid}/{len(CASES)}",
        }
        out["rows"]["json_schema" if constrained else "unconstrained"] = row
        print(constrained, row, file=sys.stderr)
print(json.dumps(out, indent=1))
