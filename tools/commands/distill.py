"""`python -m arborspec.tools.commands.distill`: distil a small Llama draft from the target, or
evaluate drafts (--eval).

Role in one decode step: none; the command line of tools/train/distill_draft.py (training),
tools/train/distill_eval.py (evaluation) and tools/train/distill_corpus.py (data).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from arborspec.runtime.decoder_config import DEFAULT_CHAIN, DEFAULT_TREE
from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import atomic_write_json
from arborspec.tools.errors import reports_mistakes
from arborspec.tools.train import distill_draft as distill_draft
from arborspec.tools.train.distill_draft import DistillOptions, distill
from arborspec.tools.train.distill_eval import (
    DraftTrial,
    eval_prompt_ids,
    evaluate_drafts,
    markdown_table,
    simulate_drafts,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.commands.distill",
        description=distill_draft.__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=distill_draft.__doc__.split("\n\n", 2)[2],
    )
    p.add_argument("--model", default="smollm2-135m", help="target (registry name or path; llama family)")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers (default 1)")
    p.add_argument(
        "--init",
        choices=["target", "random"],
        default="target",
        help="initialise the draft's layers from target layers 0..K-1 (default) or randomly",
    )
    p.add_argument("--out", help="output folder (default ~/.cache/arborspec/drafts/NAME-distilled-LK)")
    p.add_argument("--prompts", help="prompts file (default tools/data/prompts.json when present)")
    p.add_argument("--n-eval", type=int, default=8, help="held-out prompts (never in the corpus)")
    p.add_argument("--corpus", help="corpus JSON file to use/write (default: cached by settings)")
    p.add_argument("--corpus-tokens", type=int, default=12288, help="generated tokens in the corpus")
    p.add_argument("--gen-len", type=int, default=128, help="tokens per generated continuation")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature after the greedy round")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--topk", type=int, default=64, help="target log-probs kept per position for the KL")
    p.add_argument("--ce-weight", type=float, default=0.2, help="weight of the CE on the target's tokens")
    p.add_argument("--time-budget-min", type=float, default=50.0, help="stop training after this much wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--quiet", action="store_true")
    e = p.add_argument_group("evaluation (--eval: no training)")
    e.add_argument("--eval", action="store_true", help="compare drafts' mean accepted length on held-out prompts")
    e.add_argument(
        "--drafts",
        default="bigram,layers:2,layers:4",
        help="comma-separated drafts for --eval (layers:K, bigram, or model folders)",
    )
    e.add_argument(
        "--trees",
        default=f"{DEFAULT_TREE};{DEFAULT_CHAIN}",
        help=f"semicolon-separated tree specs for --eval (default '{DEFAULT_TREE};{DEFAULT_CHAIN}'; "
        "'vanilla' = no draft, static:FILE.json for a tuned tree)",
    )
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument(
        "--simulate",
        action="store_true",
        help="count greedy steps from teacher-forced draft ranks (fast, exact for chain/full/static "
        "trees) instead of running the decode loop; no tok/s",
    )
    e.add_argument("--json-out", help="write the --eval rows as JSON here")
    return p


@reports_mistakes("distill_draft")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval:
        from arborspec.models.registry import load_model

        tok = load_model(args.model).tokenizer
        prompts = eval_prompt_ids(tok, args.prompts, args.n_eval)
        if not prompts:
            raise InputError(
                "no held-out prompts to evaluate on (the model has no tokenizer and the "
                "prompts file has no 'ids' entries)"
            )
        drafts = [os.path.expanduser(d.strip()) for d in args.drafts.split(",") if d.strip()]
        trees = [t.strip() for t in args.trees.split(";") if t.strip()]
        run = simulate_drafts if args.simulate else evaluate_drafts
        rows = run(DraftTrial(args.model, drafts, prompts, trees, args.max_new_tokens, not args.quiet))
        print(markdown_table(rows))
        if args.json_out:
            atomic_write_json(args.json_out, rows, indent=1)
        return 0
    if args.steps < 1 or args.seq_len < 2 or args.batch < 1 or args.corpus_tokens < 1:
        raise InputError("--steps, --batch and --corpus-tokens must be >= 1 and --seq-len >= 2")
    distill(DistillOptions.from_namespace(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
