"""How new a corpus's windows are to a head: its top-1 agreement with the target per depth on
windows sampled from each group of shards (by prompt source, or by shard ranges). Windows the
head agrees on as well as on windows it trained on teach it little; windows it agrees on as
little as on the held-out set are new to it. This is how the template stream was found to repeat
itself (docs/drafts-training.md, the fifth session).

Role in one decode step: none; it decides what the corpus should grow with.

    python -m arborspec.tools.train.corpus_novelty --corpus ~/.cache/arborspec/eagle3-corpus/KEY \\
        --groups 0-130 131-163 source:self --windows 24 --threads 1
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from arborspec.tools.errors import reports_mistakes
from arborspec.tools.options import tool_parser


@torch.no_grad()
def window_agreement(head, embed, data, index: np.ndarray, steps: int = 4, batch: int = 4) -> list[float]:
    """Top-1 agreement per depth 1..steps of `head` with the target's greedy token over the
    corpus windows `index` of `data` (eagle3_train.ShardData), by the training-time-test forward
    (the forward decoding computes) in fp32."""
    from arborspec.tools.train.eagle3_train import agrees, ttt_forward

    was = head.training
    head.eval()
    hits, count = np.zeros(steps), 0
    for a in range(0, len(index), batch):
        tk, fe, _, _, t1 = data.batch_at(index[a : a + batch])
        outs = ttt_forward(head, embed, tk, fe, steps)
        for d, logits in enumerate(outs):
            hits[d] += agrees(logits, t1, data.vocab_t, d).sum().item()
        count += tk.shape[0] * outs[0].shape[1]
    head.train(was)
    return [round(float(h / max(count, 1)), 4) for h in hits]


def group_windows(data, spec: str) -> np.ndarray:
    """`A-B` (shards A..B, inclusive) or `source:NAME` (shards of that prompt source) -> window ids."""
    if spec.startswith("source:"):
        return np.flatnonzero(data.sources == spec.split(":", 1)[1])
    a, _, b = spec.partition("-")
    if not (a.isdigit() and (b.isdigit() or b == "")):
        from arborspec.runtime.errors import InputError

        raise InputError(f"group {spec!r}: expected A-B (shard numbers) or source:NAME")
    lo, hi = int(a), min(int(b or a), len(data.offsets) - 2)
    return np.arange(data.offsets[lo], data.offsets[hi + 1]) if lo <= hi else np.arange(0)


@reports_mistakes("corpus_novelty")
def main(argv=None) -> int:
    p = tool_parser(
        __doc__,
        "python -m arborspec.tools.train.corpus_novelty",
        "example: python -m arborspec.tools.train.corpus_novelty --corpus CORPUS --groups source:templates source:self",
    )
    p.add_argument("--corpus", type=Path, required=True, help="a corpus folder (~/.cache/arborspec/eagle3-corpus/KEY)")
    p.add_argument("--head", default="eagle3", help="eagle3 (the shipped head) or a head folder (default eagle3)")
    p.add_argument("--model", default="smollm2-135m", help="the target (default smollm2-135m)")
    p.add_argument("--groups", nargs="+", default=["source:templates", "source:self"], help="A-B or source:NAME")
    p.add_argument("--windows", type=int, default=24, help="windows sampled per group (default 24)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    args = p.parse_args(argv)
    from arborspec.models.registry import load_model
    from arborspec.runtime.errors import ArborspecError
    from arborspec.tools.train.eagle3_heldout import head_to_measure
    from arborspec.tools.train.eagle3_train import ShardData

    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.corpus / "vocab.npy").is_file():
        raise ArborspecError(f"{args.corpus}: not a corpus folder (no vocab.npy)")
    loaded = load_model(args.model)
    head = head_to_measure(args.head, args.model, loaded.config)
    embed = loaded.module.model.embed_tokens.weight.detach().float()
    data = ShardData(args.corpus)
    rng = np.random.default_rng(0)
    out = {}
    for g in args.groups:
        idx = group_windows(data, g)
        pick = np.sort(rng.choice(idx, min(args.windows, len(idx)), replace=False)) if len(idx) else idx
        out[g] = {"windows": int(len(pick)), "top1_per_depth": window_agreement(head, embed, data, pick)}
        print(f"{g}: {len(pick)} of {len(idx)} windows, top-1 per depth {out[g]['top1_per_depth']}", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
