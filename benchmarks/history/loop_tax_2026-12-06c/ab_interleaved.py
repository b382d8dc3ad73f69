"""Interleaved A/B over the 24 six-kind prompts: configs = (label, export, options)."""

import collections
import json
import statistics
import sys

import torch

import arborspec

arborspec.enable_shared_pool()
torch.set_num_threads(1)
V24 = "/root/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24"
P = json.load(open("/work/logs/kinds24.json"))["prompts"]
CFG = {
    "vanilla": (V24, dict(draft="none", mode="vanilla")),
    "v24 head": (V24, dict(tree="chain:1")),
    "v24 head+sfx": (V24, dict(draft="export+suffix", tree="chain:1")),
    "h4 head": ("/work/exp/e-h4", dict(tree="chain:1")),
    "h4 head+sfx": ("/work/exp/e-h4", dict(draft="export+suffix", tree="chain:1")),
    "kv8 head": ("/work/exp/e-kv8", dict(tree="chain:1")),
    "kv8 head+sfx": ("/work/exp/e-kv8", dict(draft="export+suffix", tree="chain:1")),
    "head+sfx mem": (V24, dict(draft="export+suffix:mem=65536", tree="chain:1")),
    "sfx mem": (V24, dict(draft="suffix:mem=65536", tree="chain:1")),
    "sfx": (V24, dict(draft="suffix", tree="chain:1")),
}
for _a in sys.argv[2:]:
    if (_a.startswith("export+suffix") or _a.startswith("suffix")) and _a not in CFG:
        CFG[_a] = (V24, dict(draft=_a, tree="chain:1"))
names = sys.argv[2:] or list(CFG)
rounds = int(sys.argv[1])
ref = {}
res = collections.defaultdict(list)
kind_tc = collections.defaultdict(lambda: collections.defaultdict(list))
tot = collections.defaultdict(lambda: [0, 0.0, 0])
for r in range(rounds):
    gens = {n: arborspec.Generator.from_export(CFG[n][0], **CFG[n][1]) for n in names}  # fresh memory each round
    for i, p in enumerate(P):
        order = names[(i + r) % len(names) :] + names[: (i + r) % len(names)]
        for n in order:
            c = gens[n].generate(p["text"], max_new_tokens=128, ignore_eos=True, chat=bool(p.get("chat")))
            s = c.stats
            t = tot[(n, r)]
            t[0] += s.new_tokens
            t[1] += s.total_s - s.prefill_s
            t[2] += s.steps
            kind_tc[n][p["category"]].append((s.new_tokens, s.steps))
            if p["id"] in ref and ref[p["id"]] != list(c.tokens):
                print("MISMATCH", n, p["id"])
            ref.setdefault(p["id"], list(c.tokens))
    for n in names:
        t = tot[(n, r)]
        res[n].append(t[0] / t[1])
    print(
        f"round {r}: " + "  ".join(f"{n} {res[n][-1]:.1f} ({res[n][-1] / res[names[0]][-1]:.3f}x)" for n in names),
        flush=True,
    )
print("== medians")
for n in names:
    kinds = {k: sum(a for a, b in v) / sum(b for a, b in v) for k, v in kind_tc[n].items()}
    print(
        f"{n:14s} {statistics.median(res[n]):6.1f} tok/s  per kind tok/call: "
        + " ".join(f"{k}={v:.2f}" for k, v in sorted(kinds.items()))
    )
