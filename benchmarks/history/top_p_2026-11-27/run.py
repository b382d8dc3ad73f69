"""top-p sampling speed, the nucleus search (runtime/sampling.py: top_p_filter) against the full
sort it replaced, in one process, alternating, on the demo's int4 export (ONNX Runtime CPU):
vanilla and the demo's tree (export+lookup, tuned), temperature 0.8, top-p 0.95, 5 prompts x
96 tokens, 3 rounds; median decode tok/s. Usage: python benchmarks/history/top_p_2026-11-27/run.py EXPORT"""

import statistics
import sys

import torch

import arborspec
import arborspec.runtime.sampling as S

new_filter = S.top_p_filter


def sort_filter(x, top_p):  # the code before 2026-11-27
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    p = torch.softmax(sorted_x, dim=-1)
    drop_sorted = (torch.cumsum(p, dim=-1) - p) >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


PROMPTS = [
    "Explain in three sentences why the sky looks blue at noon and red at sunset.",
    "Write a short Python function that returns the n-th Fibonacci number iteratively.",
    "List five tips for keeping houseplants alive in a dark apartment.",
    "Summarise the plot of a heist story where the thieves steal a famous painting.",
    "Give me a polite email declining a meeting invitation next Tuesday.",
]
export = sys.argv[1]
res = {}
for draft, tree in (("none", None), ("export+lookup", "auto")):
    with arborspec.Generator.from_export(export, backend="onnxruntime", draft=draft, tree=tree) as gen:
        gen.chat([{"role": "user", "content": PROMPTS[0]}], max_new_tokens=8)  # warm-up
        for rnd in range(3):
            for name, f in (("sort", sort_filter), ("nucleus search", new_filter)):
                S.top_p_filter = f
                toks, secs = 0, 0.0
                for i, p in enumerate(PROMPTS):
                    c = gen.chat([{"role": "user", "content": p}], max_new_tokens=96, temperature=0.8, top_p=0.95, seed=i)
                    toks += c.stats.new_tokens
                    secs += c.stats.decode_s
                res.setdefault((draft, name), []).append(toks / secs)
                print(draft, name, rnd, round(toks / secs, 1), flush=True)
S.top_p_filter = new_filter
for (draft, name), v in res.items():
    print(f"| {draft} | {name} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
