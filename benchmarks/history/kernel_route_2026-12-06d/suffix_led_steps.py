"""How often the suffix draft proposes at the root when mixed with the head (min=4), and whether a
step that skipped the head there would lose the head's accepted node: 24 six-kind requests x 128."""

import json

import numpy as np
import torch

import arborspec
from arborspec.runtime.drafts import proposed, suffix

arborspec.enable_shared_pool()
torch.set_num_threads(1)
V24 = "/root/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24"
P = json.load(open("/work/logs/kinds24.json"))["prompts"]
rec = []
cur = {}
orig_merge = proposed.merge


def merge(base, prop, paths=None, lead=1):
    if "n" not in cur:
        cur.update(
            n=prop.n, ptok=int(prop.tokens[0]) if prop.n else None, htok=int(base.tokens[0]) if base.n else None, plen=0
        )
        # chain length of the proposal's first path
        par = prop.parents
        k = 0
        at = -1
        for i in range(prop.n):
            if par[i] == at:
                k += 1
                at = i
        cur["chain"] = k
    return orig_merge(base, prop, paths, lead)


proposed.merge = merge
orig_commit = suffix.SuffixMixDraft.commit


def commit(self, tree, path, features=None):
    toks = tree.tokens[path].tolist() if path.numel() else []
    cur["acc"] = len(toks)
    cur["first"] = toks[0] if toks else None
    rec.append(dict(cur, kind=KIND))
    cur.clear()
    return orig_commit(self, tree, path, features)


suffix.SuffixMixDraft.commit = commit
g = arborspec.Generator.from_export(V24, draft="export+suffix", tree="chain:1")
for p in P:
    KIND = p["category"]
    cur.clear()
    g.generate(p["text"], max_new_tokens=128, ignore_eos=True, chat=bool(p.get("chat")))
json.dump(rec, open("/work/scratch/s31/skipstat.json", "w"))
N = len(rec)
print("steps", N, "tokens", sum(r["acc"] + 1 for r in rec))
for k in (1, 2, 3, 4, 6, 8, 12):
    S = [r for r in rec if r["n"] >= k]
    lost = sum(1 for r in S if r["htok"] is not None and r["first"] == r["htok"] and r["ptok"] != r["htok"])
    agree = sum(1 for r in S if r["ptok"] == r["htok"])
    pacc = sum(1 for r in S if r["first"] is not None and r["first"] == r["ptok"])
    print(
        f"prop>={k}: steps {len(S)} ({len(S) / N:.0%}) head==suffix first {agree} ; suffix first accepted {pacc}; head-only accepted (lost by skip) {lost}; mean acc {np.mean([r['acc'] for r in S]) if S else 0:.2f}"
    )
