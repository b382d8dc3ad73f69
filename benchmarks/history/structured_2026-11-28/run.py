"""Structured output on SmolLM2 (the int4 export v24 = `make demo`'s, the EAGLE-3 head, its tuned
tree): 8 extraction requests of our own, each with its JSON schema, greedy, 96 tokens at most;
vanilla and the tuned tree, constrained (response_format json_schema) and not, interleaved in one
process. Reports median tok/s, tokens per target call, whether the tree's tokens equal vanilla's,
and how many answers parse and follow their schema.

    .venv/bin/python benchmarks/history/structured_2026-11-28/run.py [EXPORT_DIR] [--llamacpp] > benchmarks/history/structured_2026-11-28/result.json

--llamacpp: llama.cpp (llama-cpp-python, tools/bench/peers.LlamaCppRunner) on the same GGUF, fed
the same prompt ids, greedy, with its own structured output (the GBNF grammar it makes of each
schema), interleaved request by request with ours.
"""

import json
import os
import statistics
import sys

import arborspec
from arborspec.runtime.generator import Generator

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
E = ARGS[0] if ARGS else os.path.expanduser("~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24")
LLAMACPP = "--llamacpp" in sys.argv


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


def main() -> None:
    arborspec.enable_shared_pool()
    out = {"export": E, "requests": len(CASES), "max_new_tokens": 96, "rows": {}}
    peer = None
    if LLAMACPP:
        from arborspec.tools.bench.peers import LlamaCppRunner, peer_threads

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "prefix_cache_2026-11-28"))
        from chat_turns import gguf_path

        peer = LlamaCppRunner(gguf_path(), peer_threads(), 2048, lookup=False)
        out["llamacpp_gguf"] = gguf_path()
    with Generator.from_export(E, mode="vanilla", prefix_cache=False) as van, Generator.from_export(
        E, tree="auto", prefix_cache=False
    ) as tree:
        for g in (van, tree):  # warm-up, and each schema compiled once (llguidance) before timing
            g.generate(CASES[0][0], 8, chat=True)
            for _, schema in CASES:
                g.grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        for constrained in (False, True):
            sp = {"vanilla": [], "tree": [], "llama.cpp": []}
            same = valid = peer_valid = 0
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
                if peer is not None:
                    ids = van.encode_prompt(van.tokenizer.apply_chat([{"role": "user", "content": prompt}]))
                    r = peer.run("llama.cpp", ids, 96, van.eos_token_ids, 0.0, 0, json_schema=schema if constrained else None)
                    sp["llama.cpp"].append(r["tokens_per_s"])
                    peer_valid += follows(van.tokenizer.decode(r["tokens"], skip_special_tokens=True), schema)
            row = {
                "vanilla_tok_s_median": round(statistics.median(sp["vanilla"]), 1),
                "tree_tok_s_median": round(statistics.median(sp["tree"]), 1),
                "speedup_median_of_ratios": round(statistics.median(t / v for t, v in zip(sp["tree"], sp["vanilla"])), 3),
                "tokens_per_target_call": round(statistics.mean(calls), 3),
                "tree_equals_vanilla": f"{same}/{len(CASES)}",
                "answers_that_parse_and_follow_the_schema": f"{valid}/{len(CASES)}",
            }
            if peer is not None:
                row["llamacpp_tok_s_median"] = round(statistics.median(sp["llama.cpp"]), 1)
                row["tree_vs_llamacpp_median_of_ratios"] = round(
                    statistics.median(t / p for t, p in zip(sp["tree"], sp["llama.cpp"])), 3
                )
                row["llamacpp_answers_that_parse_and_follow_the_schema"] = f"{peer_valid}/{len(CASES)}"
            out["rows"]["json_schema" if constrained else "unconstrained"] = row
            print(constrained, row, file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":  # (its CASES are read by other benchmarks)
    main()
