"""The shipped head's history, one row per installed run, oldest first: read from its
`training.json`, where every `--install` nests the record of the head it replaced under
`replaced`. Each row: held-out top-1 agreement with the target at depths 1-4 before and after
the run and the tuned tree's tokens per step (on the same held-out set, `eagle3_heldout`),
the training's CPU-minutes (GPU runs: minutes on the GPU) and the corpus it trained on. This is
the head's curve per CPU-hour (the draft-head issue asks for it); `--plot` draws it.

Role in one decode step: none; it reports how step 1's draft head got where it is.

    python -m arborspec.tools.train.head_history --model smollm2-135m --plot benchmarks/history/eagle3_head_history.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arborspec.tools.errors import reports_mistakes


def runs(report: dict) -> list[dict]:
    """The installed runs of a head's training.json, oldest first, each a flat row. A record
    without a held-out measure before and after on the held-out prompt set (the first head's,
    measured on its own windows) ends the chain."""
    rows = []
    rec = report
    while rec and rec.get("heldout_before") and rec.get("heldout"):
        before, after = rec["heldout_before"], rec["heldout"]
        gpu = any("--device cuda" in c for c in rec.get("commands") or [rec.get("command", "")])
        corpus = rec.get("corpus") or {}
        rows.append(
            {
                "device": "gpu" if gpu else "cpu",
                "batches": rec.get("batches"),
                "train_minutes": rec.get("cpu_minutes") if not gpu else rec.get("minutes"),
                "corpus_tokens": corpus.get("tokens"),
                "corpus_build_hours": round((corpus.get("generation_s", 0) + corpus.get("features_s", 0)) / 3600, 2),
                "before": before["top1_agreement_per_depth"],
                "after": after["top1_agreement_per_depth"],
                "tree_before": _tree(before),
                "tree_after": _tree(after),
                "positions": after.get("positions"),
            }
        )
        rec = rec.get("replaced")
    rows.reverse()
    for i, r in enumerate(rows):  # training CPU-hours so far (GPU minutes left out of the CPU total)
        prev = rows[i - 1]["cpu_hours_total"] if i else 0.0
        r["cpu_hours_total"] = round(prev + (r["train_minutes"] or 0) / 60 * (r["device"] == "cpu"), 2)
    return rows


def _tree(measure: dict) -> float | None:
    """The tuned tree's tokens per step in a held-out measure (its key names the tree)."""
    tps = measure.get("tokens_per_step") or {}
    return next((v for k, v in tps.items() if k.startswith("tuned")), None)


def table(rows: list[dict]) -> str:
    """A markdown table of the rows."""
    lines = [
        "| run | device | batches | training min | corpus tokens (build h) | depth 1-4 after | depth-1 gain | "
        "tuned tree tok/step | training CPU-h so far |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        after = " / ".join(f"{a:.3f}" for a in r["after"])
        corpus = f"{r['corpus_tokens']:,} ({r['corpus_build_hours']})" if r["corpus_tokens"] else "-"
        lines.append(
            f"| {i} | {r['device']} | {r['batches']} | {r['train_minutes']} | {corpus} | {after} | "
            f"{r['after'][0] - r['before'][0]:+.3f} | {r['tree_before']} -> {r['tree_after']} | {r['cpu_hours_total']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Held-out agreement per depth against training CPU-hours so far (a GPU run: a step at no
    CPU cost), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from arborspec.runtime.fileio import atomic_write

    x = [0.0] + [r["cpu_hours_total"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for d in range(4):
        y = [rows[0]["before"][d]] + [r["after"][d] for r in rows]
        ax.plot(x, y, marker="o", label=f"depth {d + 1}")
    for r in rows:
        if r["device"] == "gpu":
            ax.annotate("GPU run", (r["cpu_hours_total"], r["after"][0]), textcoords="offset points", xytext=(4, 6))
    ax.axhline(0.70, color="grey", ls="--", lw=1)
    ax.text(x[0], 0.705, "goal at depth 1", color="grey", fontsize=8)
    ax.set_xlabel("training CPU-hours (one core), cumulative")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.set_title(f"EAGLE-3 head, installed runs ({rows[-1]['positions']} held-out positions)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


@reports_mistakes("head_history")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.train.head_history",
        description=__doc__.split("\n\n")[0],
        epilog="example: python -m arborspec.tools.train.head_history --model smollm2-135m --json",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="smollm2-135m", help="the model whose shipped head to read (default)")
    src.add_argument("--training-json", type=Path, help="a head's training.json instead")
    p.add_argument("--plot", type=Path, metavar="PNG", help="also draw the curve into this PNG")
    p.add_argument("--json", action="store_true", help="the rows as JSON instead of a table")
    args = p.parse_args(argv)
    from arborspec.runtime.errors import InputError

    path = args.training_json
    if path is None:
        from arborspec.models.eagle3 import SHIPPED_HEADS, eagle3_folder

        if args.model not in SHIPPED_HEADS:
            raise InputError(f"no EAGLE-3 head is shipped for {args.model!r} (shipped: {', '.join(SHIPPED_HEADS)})")
        path = eagle3_folder("eagle3", args.model) / "training.json"
    if not path.is_file():
        raise InputError(f"no training.json at {path}")
    try:
        report = json.loads(path.read_text())
    except ValueError as e:
        raise InputError(f"{path} is not JSON: {e}") from None
    rows = runs(report)
    if not rows:
        raise InputError(f"{path} records no installed run measured on the held-out set")
    if args.plot is not None:
        plot(rows, args.plot)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
