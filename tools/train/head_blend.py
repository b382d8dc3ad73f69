"""Two EAGLE-3 heads blended weight by weight, each blend measured on the held-out set, the best
one written in the public layout (for `train-draft --install-head`, which measures it against the
shipped head again and installs it only if it beats it).

Why: a CPU fine-tune of a head trained on a GPU takes batches of 4 windows where the GPU took 32;
its updates are noisier, and its held-out agreement dipped below the start before it learnt from
the new text (runs 17, 19 and 20). A weight-space blend of the start and the fine-tuned head
(WiSE-FT, Wortsman et al. 2022: (1 - a) * start + a * tuned) keeps what the new text taught while
averaging part of that noise away; the held-out set chooses `a` among a few values.

Role in one decode step: none; it makes the draft of step 1.

    python -m arborspec.tools.train.head_blend --model smollm2-135m --start eagle3 \\
        --tuned ~/.cache/arborspec/train/smollm2-135m-eagle3-n20 --alphas 0.3 0.5 0.7 --out /tmp/blend
    arborspec train-draft --model smollm2-135m --out /tmp/blend --install-head /tmp/blend
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import atomic_write_json
from arborspec.tools.errors import reports_mistakes


def blend(start, tuned, alpha: float):
    """(1 - alpha) * start + alpha * tuned, weight by weight, as a new head (start's class and
    config). The heads must share their shapes and draft vocabulary (d2t / t2d: not blended)."""
    import copy

    a, b = start.state_dict(), tuned.state_dict()
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        raise InputError("the two heads differ in shape: blend heads of one target and one draft vocabulary")
    out = {}
    for k, v in a.items():
        if v.is_floating_point() and not k.startswith("rotary"):
            out[k] = (1.0 - alpha) * v.float() + alpha * b[k].float()
        elif torch.equal(v, b[k]):
            out[k] = v
        else:
            raise InputError(f"the two heads differ in {k} (another draft vocabulary): they cannot be blended")
    head = copy.deepcopy(start).float()
    head.load_state_dict(out)
    return head


def best_blend(start, tuned, alphas: list[float], measure) -> tuple[float, object, list[dict]]:
    """Every blend measured (alpha 0 is `start`, 1 is `tuned`, both always among them); ->
    (alpha, head, rows) for the blend `eagle3_heldout.ranks_above` ranks first with `start`'s
    measure as the start: the first that beats it by the install rule, then the higher mean."""
    from arborspec.tools.train.eagle3_heldout import ranks_above

    rows, best = [], None
    for a in sorted({0.0, 1.0, *alphas}):
        head = blend(start, tuned, a)
        res = measure(head)
        rows.append({"alpha": a, **res})
        if a == 0.0:
            base = res
        if best is None or ranks_above(res, best[2], base):
            best = (a, head, res)
    return best[0], best[1], rows


@reports_mistakes("head_blend")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.train.head_blend",
        description=__doc__.split("\n\n")[0],
        epilog="example:\n" + "\n".join(__doc__.rstrip().split("\n")[-3:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="the heads' target (e.g. smollm2-135m)")
    p.add_argument("--start", required=True, help="the head the fine-tune started from (`eagle3`: the shipped one)")
    p.add_argument("--tuned", type=Path, required=True, help="the fine-tuned head (a train-draft --out folder)")
    p.add_argument(
        "--alphas", type=float, nargs="+", default=[0.3, 0.5, 0.7], help="weights of the tuned head (0.3 0.5 0.7)"
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the best blend (public EAGLE-3 layout)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    args = p.parse_args(argv)
    if any(not 0.0 <= a <= 1.0 for a in args.alphas):
        raise InputError("--alphas must lie in [0, 1]")
    if not (args.tuned / "model.safetensors").is_file():
        raise InputError(f"--tuned {args.tuned}: no model.safetensors there (a public-layout EAGLE-3 head)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from arborspec.models.registry import load_model
    from arborspec.tools.train.eagle3_heldout import TUNED, head_to_measure, heldout_measure
    from arborspec.tools.train.eagle3_train import save_public

    loaded = load_model(args.model)
    start = head_to_measure(args.start, args.model, loaded.config)
    tuned = head_to_measure(str(args.tuned), args.model, loaded.config)
    alpha, head, rows = best_blend(start, tuned, args.alphas, heldout_measure(loaded, args.threads))
    for r in rows:
        print(
            f"alpha {r['alpha']:.2f}: held-out top-1 per depth {r['top1_agreement_per_depth']} "
            f"(mean {np.mean(r['top1_agreement_per_depth']):.4f}), tuned tree {r['tokens_per_step'][TUNED]}"
        )
    try:
        report = json.loads((args.tuned / "training.json").read_text())
    except (OSError, ValueError):
        report = {}
    chosen = next(r for r in rows if r["alpha"] == alpha)
    meta = {k: v for k, v in chosen.items() if k != "alpha"}
    report.update(
        {
            "heldout_tuned": report.get("heldout"),
            "heldout": meta,
            "blend": {"start": args.start, "tuned": str(args.tuned), "alpha": alpha, "measured": rows},
        }
    )
    save_public(head, args.out, {"arborspec_training": {"heldout": meta, "blend_alpha": alpha}})
    atomic_write_json(args.out / "training.json", report, indent=1)
    print(f"wrote {args.out}: the blend of alpha {alpha:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
