"""Sampled acceptance of an EAGLE-3 head per depth on the held-out set, and its calibration.

alpha_d = sum_x min(p_T(x), q(x)): the chance that a draft token sampled from q at depth d is
accepted by the target sampling at temperature T (teacher-forced along the held-out responses,
the head's own hidden states below depth 1, as `eagle3_heldout.depth_ranks` unrolls it); q is
the head's distribution at temperature T x tau mapped onto the target's ids. tau < 1 sharpens
the head. Beside it, the top-k candidates' rule (the default, `--candidates topk`): a
deterministic candidate x is accepted with p_T(x), so depth d of a chain accepts with
p_T(argmax q) and a first level of the two top candidates with p_T(x1) + p_T(x2). Output:
sampled_acceptance.txt beside this file (2026-11-27, ninth session; the top-k rows and
sampled_acceptance_run11.txt, the head of run 11, eleventh session).

    .venv/bin/python benchmarks/history/eagle3_revocab_2026-11-27/sampled_acceptance.py [HEAD_SPEC]

HEAD_SPEC: `eagle3` (the shipped head, default) or `eagle3:FOLDER`. Needs the held-out folder a
`train-draft` run builds in the user cache (~/.cache/arborspec/eagle3-heldout/<key>).
"""

import sys
from pathlib import Path

import numpy as np
import torch

from arborspec.models.eagle3 import eagle3_folder, load_eagle3
from arborspec.models.registry import load_model
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.kvcache import KVCache
from arborspec.tools.train.eagle3_train import ttt_forward

TAUS = [0.65, 0.7, 0.75, 0.8, 1.0]
DEPTHS = 4


def main() -> None:
    torch.set_num_threads(2)
    folders = sorted((Path.home() / ".cache/arborspec/eagle3-heldout").glob("*/heldout.json"))
    if not folders:
        sys.exit("sampled_acceptance: no held-out folder (run arborspec train-draft once)")
    folder = folders[0].parent
    m = load_model("smollm2-135m").module.eval()
    embed = m.model.embed_tokens.weight.detach()
    tokens, spans = np.load(folder / "tokens.npy"), np.load(folder / "spans.npy")
    feats = np.load(folder / "features.npy", mmap_mode="r")
    n_rows, w = tokens.shape
    eng = TorchEngine(m)
    spec = sys.argv[1] if len(sys.argv) > 1 else "eagle3"
    head = load_eagle3(eagle3_folder(spec, "smollm2-135m"), m.config).float().eval()
    tmap = head.token_map().long()
    acc = {t: {tau: np.zeros((DEPTHS, 2)) for tau in TAUS} for t in (0.8, 1.0)}
    top = {t: np.zeros((DEPTHS, 3)) for t in acc}  # sum p_T(top-1 of q), sum p_T(top-2 of q), n
    with torch.inference_mode():
        for i in range(n_rows):
            ids = torch.from_numpy(tokens[i : i + 1].astype(np.int64))
            causal = torch.ones(w, w, dtype=torch.bool).tril()[None]
            target = eng.forward(ids, torch.arange(w)[None], causal, KVCache(eng.info.cache, w + 1, 1))[0].float()
            outs = ttt_forward(head, embed, ids, torch.from_numpy(feats[i : i + 1].astype(np.float32)), DEPTHS)
            start, end = int(spans[i, 0]), int(spans[i, 1])
            for d, logits in enumerate(outs):
                # entry j at depth d drafts the token at j + 2 + d; the target predicts it at j + 1 + d
                js = torch.tensor([j for j in range(logits.shape[1]) if max(start, start + d) <= j + 2 + d < end])
                if len(js) == 0:
                    continue
                for t in acc:
                    p = torch.softmax(target[js + 1 + d] / t, -1)
                    best2 = tmap[logits[0, js].topk(2, -1).indices]
                    pk = p.gather(1, best2)
                    top[t][d] += [float(pk[:, 0].sum()), float(pk.sum()), len(js)]
                    for tau in TAUS:
                        q = torch.zeros(len(js), m.config.vocab_size)
                        q[:, tmap] = torch.softmax(logits[0, js] / (t * tau), -1)
                        acc[t][tau][d] += [float(torch.minimum(p, q).sum()), len(js)]
    for t in acc:
        for tau in TAUS:
            a = acc[t][tau][:, 0] / acc[t][tau][:, 1]
            print(
                f"T={t} tau={tau}: alpha per depth {np.round(a, 4).tolist()}  chain-4 expected {1 + np.cumprod(a).sum():.4f}"
            )
        a1, a2 = top[t][:, 0] / top[t][:, 2], top[t][:, 1] / top[t][:, 2]
        print(
            f"T={t} topk: p_T(top-1) per depth {np.round(a1, 4).tolist()}  chain-4 expected "
            f"{1 + np.cumprod(a1).sum():.4f}; p_T(top-1) + p_T(top-2) per depth {np.round(a2, 4).tolist()}"
        )


if __name__ == "__main__":
    main()
