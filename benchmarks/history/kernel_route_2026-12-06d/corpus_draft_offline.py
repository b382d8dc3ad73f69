"""Would a suffix draft over the corpus of the target's own outputs (the head's training corpus, 12M
tokens) carry more a call? Offline, over the steps head_suffix_steps.py recorded: at each step, the
longest of the context's last 16/12/8/6/4 tokens found in the corpus, its continuations (the last 32
occurrences) voted into a chain, and the step's tokens taken as max(accepted, the chain's) + 1; the
speed from the cost curve tune measured (P = 256) plus the head's call and host work a step."""

import collections
import glob
import json

import numpy as np

C = np.concatenate(
    [
        np.load(f).reshape(-1)
        for f in sorted(glob.glob("/root/.cache/arborspec/eagle3-corpus/807fdf97bde8c1902484/shards/*/tokens.npy"))
    ]
).astype(np.uint64)
B = np.uint64(1000003)
NS = (16, 12, 8, 6, 4)
idx = {}
for n in NS:
    h = np.zeros(C.size - n + 1, dtype=np.uint64)
    for j in range(n):
        h = h * B + C[j : C.size - n + 1 + j]
    o = np.argsort(h, kind="stable")
    idx[n] = (h[o], o)  # n-gram starting at o[k]


def hsh(seq):
    h = np.uint64(0)
    for t in seq:
        h = h * B + np.uint64(t)
    return h


R = json.load(open("head_suffix_steps.json"))
curve = {1: 9.71, 2: 10.33, 4: 12.77, 8: 18.25, 12: 24.26, 16: 30.06, 24: 41.5, 32: 56.3}


def c(T):
    ks = sorted(curve)
    for a, b in zip(ks, ks[1:]):
        if a <= T <= b:
            return curve[a] + (curve[b] - curve[a]) * (T - a) / (b - a)
    return curve[32] * T / 32


OVER = 1.2 + 0.7  # head call + host, a tree step


def chain2(ctx, min_n, first_share, prob, cap):
    for n in NS:
        if n < min_n or len(ctx) < n:
            continue
        sh, o = idx[n]
        q = hsh(ctx[-n:])
        lo, hi = np.searchsorted(sh, q, "left"), np.searchsorted(sh, q, "right")
        if hi > lo:
            starts = np.sort(o[lo:hi])[-32:] + n
            L = min(cap, n)
            conts = [C[s_ : s_ + L].astype(np.int64).tolist() for s_ in starts if s_ < C.size]
            out = []
            alive = conts
            for d in range(L):
                cnt = collections.Counter(x[d] for x in alive if len(x) > d)
                if not cnt:
                    break
                tk, k = cnt.most_common(1)[0]
                if k / len(conts) < (first_share if d == 0 else prob):
                    break
                out.append(tk)
                alive = [x for x in alive if len(x) > d and x[d] == tk]
            return out
    return []


base_ms = 0
base_tok = 0
for r in R:
    for a in r["steps"]:
        base_ms += c(2) + OVER
        base_tok += a + 1
van = 1 / c(1)  # vanilla tokens a ms (verify only; host ignored alike)
print(
    "actual head+suffix: tok/call %.2f, est. x vanilla %.2f"
    % (base_tok / sum(len(r["steps"]) for r in R), (base_tok / base_ms) / (1 / (c(1) + 0.5)))
)
for min_n, fs, prob, cap in [
    (4, 0.1, 0.1, 24),
    (6, 0.1, 0.1, 24),
    (8, 0.1, 0.1, 24),
    (4, 0.5, 0.5, 24),
    (6, 0.5, 0.5, 24),
    (8, 0.5, 0.5, 24),
    (6, 0.7, 0.5, 8),
    (8, 0.7, 0.7, 8),
    (4, 0.5, 0.5, 4),
    (6, 0.5, 0.5, 6),
    (12, 0.5, 0.5, 12),
]:
    ms = 0
    tok = 0
    rows = 0
    steps = 0
    per = collections.defaultdict(lambda: [0, 0])
    for r in R:
        text = r["prompt_ids"] + r["tokens"]
        P = len(r["prompt_ids"])
        t = 0
        for a in r["steps"]:
            ch = chain2(text[: P + t], min_n, fs, prob, cap)
            truth = r["tokens"][t:]
            ac = 0
            for x, y in zip(ch, truth):
                if x != y:
                    break
                ac += 1
            got = max(a, ac) + 1
            tok += got
            ms += c(2 + len(ch)) + OVER
            rows += len(ch)
            steps += 1
            per[r["kind"]][0] += got
            per[r["kind"]][1] += 1
            t += a + 1
    print(
        f"min_n {min_n:2d} first {fs:.1f} prob {prob:.1f} cap {cap:2d}: tok/call {tok / steps:.2f}, corpus rows {rows / steps:.2f}, est. x vanilla {(tok / ms) / (1 / (c(1) + 0.5)):.2f} | "
        + " ".join(f"{k[:5]}={v[0] / v[1]:.2f}" for k, v in sorted(per.items()))
    )
