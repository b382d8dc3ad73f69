"""Tool calling on SmolLM2 (the int4 export v24 = `make demo`'s, the EAGLE-3 head, its tuned
tree): 8 requests of our own against 4 tools, greedy, 128 tokens at most; vanilla and the tuned
tree interleaved in one process, for tool_choice "required" (the answer constrained to calls,
runtime/chat.py) and "auto" (the model decides; its <tool_call> blocks parsed). Reports median
tok/s, tokens per target call, whether the tree's tokens equal vanilla's, how many answers are
calls, and how many of those name the tool the request is about.

    .venv/bin/python benchmarks/history/tool_calls_2026-11-29/run.py [EXPORT_DIR] > benchmarks/history/tool_calls_2026-11-29/result.json
"""

import json
import os
import statistics
import sys

import arborspec
from arborspec.runtime.generator import Generator

E = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24")


def fn(name: str, desc: str, props: dict) -> dict:
    params = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


S = {"type": "string"}
TOOLS = [
    fn("get_weather", "The current weather in a city", {"city": S}),
    fn("convert_currency", "Convert an amount between currencies", {"amount": {"type": "number"}, "from": S, "to": S}),
    fn("send_email", "Send an email", {"to": S, "subject": S, "body": S}),
    fn("add_event", "Add an event to the calendar", {"title": S, "date": S, "time": S}),
]
CASES = [
    ("Is it raining in Bergen right now?", "get_weather"),
    ("How warm is it in Lisbon today?", "get_weather"),
    ("How many yen is 250 US dollars?", "convert_currency"),
    ("Convert 80 euros to Swiss francs, please.", "convert_currency"),
    ("Email Priya at priya@example.org that the report is ready.", "send_email"),
    ("Write to tom@example.com: subject lunch, say I am running late.", "send_email"),
    ("Put the dentist on my calendar for May 4 at 9:30.", "add_event"),
    ("Add a team meeting on Friday at 14:00 to my calendar.", "add_event"),
]

def main() -> None:
    arborspec.enable_shared_pool()
    out = {"export": E, "requests": len(CASES), "max_new_tokens": 128, "rows": {}}
    with Generator.from_export(E, mode="vanilla", prefix_cache=False) as van, Generator.from_export(
        E, tree="auto", prefix_cache=False
    ) as tree:
        for g in (van, tree):  # warm-up; the grammar compiled once before timing
            g.chat([{"role": "user", "content": "hi"}], 8, tools=TOOLS, tool_choice="required")
        for choice in ("required", "auto"):
            sp = {"vanilla": [], "tree": []}
            same = calls = right = 0
            per_call = []
            for prompt, want in CASES:
                msgs = [{"role": "user", "content": prompt}]
                a = van.chat(msgs, 128, tools=TOOLS, tool_choice=choice)
                b = tree.chat(msgs, 128, tools=TOOLS, tool_choice=choice)
                sp["vanilla"].append(a.stats.tokens_per_s)
                sp["tree"].append(b.stats.tokens_per_s)
                per_call.append(b.stats.mean_accepted)
                same += a.tokens == b.tokens
                calls += bool(b.tool_calls)
                right += bool(b.tool_calls) and b.tool_calls[0]["function"]["name"] == want
                out.setdefault("answers", {}).setdefault(choice, []).append(
                    {"prompt": prompt, "calls": [c["function"] for c in b.tool_calls or []], "text": b.text[:200]}
                )
            ratios = [t / v for t, v in zip(sp["tree"], sp["vanilla"])]
            out["rows"][choice] = {
                "vanilla_tok_s": round(statistics.median(sp["vanilla"]), 1),
                "tree_tok_s": round(statistics.median(sp["tree"]), 1),
                "tree_vs_vanilla_median_ratio": round(statistics.median(ratios), 3),
                "tree_tokens_per_call": round(statistics.median(per_call), 2),
                "identical_tokens": f"{same}/{len(CASES)}",
                "answers_with_calls": f"{calls}/{len(CASES)}",
                "calls_naming_the_right_tool": f"{right}/{len(CASES)}",
            }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":  # (its CASES are read by other benchmarks)
    main()
