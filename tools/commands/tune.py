"""`arborspec tune`: pick the static tree that maximises tokens/s on this backend (Sequoia).

Role: measures the backend's verify cost curve c(T), the draft's per-level cost d(F) and the
draft's positional acceptance on calibration prompts, runs Sequoia's tree DP over node
budgets and depths, replays the decoding loop to count each tree's tokens per step, re-times
the best few in the decoding loop itself, and writes the winner as a static tree spec: EXPORT_DIR/tree_auto.json
(or the user cache for --model runs), which `--tree auto` in generate and bench picks up.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from arborspec.runtime.errors import InputError, MissingFileError
from arborspec.tools.commands.options import add_seed_arg, command_parser
from arborspec.tools.engines import add_model_args, models_key, open_models
from arborspec.tools.options import QUIET_HELP

EXAMPLE = """examples:
  arborspec tune --model smollm2-135m --draft layers:2 --plot tune.png
  arborspec tune --export-dir ~/.cache/arborspec/exports/smollm2 --backend onnxruntime --max-nodes 32
  arborspec tune --export-dir E3Q --draft export+lookup   # the export's draft mixed with lookup: its own tree
  arborspec tune --export-dir E3Q --temperature 0.8 --top-p 0.95   # for sampled decoding: its own tree
  arborspec generate --model smollm2-135m --draft layers:2 --tree auto --prompt 'Hello'"""


def register(sub) -> None:
    p = command_parser(sub, "tune", "choose the fastest static tree for this backend (Sequoia DP)", __doc__, EXAMPLE)
    add_model_args(p)
    g = p.add_argument_group("tuning")
    g.add_argument(
        "--prompts", type=Path, help="calibration prompts file (default tools/data/prompts.json, else built-in prompts)"
    )
    g.add_argument("--limit-prompts", type=int, default=8, metavar="N", help="use N calibration prompts (default 8)")
    g.add_argument("--n-prompts", dest="limit_prompts", type=int, help=argparse.SUPPRESS)  # the old name
    g.add_argument("--calib-tokens", type=int, default=64, help="tokens decoded per calibration prompt (default 64)")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="tune for sampled decoding at this temperature (default 0: greedy); the tree goes to its own "
        "file (tree_auto.sampled.json), which --tree auto uses whenever the temperature is above 0",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus of that sampling (default 1.0: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k of that sampling (default 0: off)")
    g.add_argument(
        "--chat",
        action="store_true",
        help="wrap every text prompt in the chat template (default: each prompt's own `chat` flag, as bench does)",
    )
    g.add_argument("--max-nodes", type=int, default=32, help="largest tree considered (default 32)")
    g.add_argument("--max-depth", type=int, default=6, help="deepest tree considered (default 6)")
    g.add_argument("--max-width", type=int, default=8, help="draft candidates ranked per node (default 8)")
    g.add_argument("--past", type=int, default=256, help="cached context length for the cost curves")
    g.add_argument("--reps", type=int, default=5, help="timed repetitions per size (median)")
    g.add_argument(
        "--loop-candidates",
        type=int,
        default=4,
        help="re-time the N best trees (and vanilla) in the decoding loop on the calibration prompts "
        "and choose among them by that (default 4; 0: the cost model alone)",
    )
    g.add_argument(
        "--loop-tokens",
        type=int,
        default=None,
        help="tokens per prompt in that pass (default 32; 64 with --temperature, whose steps vary more)",
    )
    add_seed_arg(g, "seed of the built-in calibration prompts (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="also write the tree file here")
    o.add_argument("--plot", type=Path, help="PNG: cost curves and predicted tokens/s vs budget")
    o.add_argument("--json", action="store_true", help="print the tuned document as one JSON object on stdout")
    o.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    p.set_defaults(run=run)


def run(args) -> int:
    for name in ("limit_prompts", "calib_tokens", "max_nodes", "max_depth", "max_width", "reps"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.past < 0:
        raise InputError("--past must be >= 0")
    if args.loop_tokens is None:
        args.loop_tokens = 64 if args.temperature > 0 else 32
    if args.loop_candidates < 0 or args.loop_tokens < 1:
        raise InputError("--loop-candidates must be >= 0 and --loop-tokens >= 1")
    if args.prompts is not None and not args.prompts.is_file():
        raise MissingFileError(f"prompts file not found: {args.prompts}")
    if args.model and not args.draft:
        raise InputError("tune needs a draft: give --draft layers:K|bigram|lookup[:N]|eagle3[:DIR]|MODEL")
    from arborspec.runtime.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)  # one InputError line when out of range
    if sampling.greedy and (args.top_p != 1.0 or args.top_k):
        raise InputError("--top-p and --top-k shape sampled decoding: give --temperature > 0 with them")
    models = open_models(args)
    from arborspec.tools.tune.tuner import TuneOptions, tune

    opts = TuneOptions(
        max_nodes=args.max_nodes,
        max_depth=args.max_depth,
        max_width=args.max_width,
        past=args.past,
        reps=args.reps,
        prompts=args.prompts,
        n_prompts=args.limit_prompts,
        chat=True if args.chat else None,
        calib_tokens=args.calib_tokens,
        loop_candidates=args.loop_candidates,
        loop_tokens=args.loop_tokens,
        seed=args.seed,
        out=args.out,
        plot=args.plot,
        sampling=sampling,
    )
    try:
        doc = tune(models, models_key(args), opts, progress=not args.quiet)
    finally:
        models.close()
    if args.json:
        print(json.dumps(doc))
        return 0
    q = doc["acceptance"]["q"]
    print(
        f"tuned tree: {doc['nodes']} nodes, depth {doc['depth']}: expected {doc['expected_tokens_per_step']:.2f} "
        f"tokens/step, predicted {doc['predicted_tokens_per_s']:.1f} tok/s vs vanilla "
        f"{doc['vanilla_tokens_per_s']:.1f} ({doc['predicted_speedup']:.2f}x"
        + ("; step times measured in the decoding loop)" if doc.get("in_loop") else "; cost model)")
    )
    print(
        "acceptance by depth (rank 0..3): "
        + "; ".join(f"d{d + 1}: " + " ".join(f"{x:.2f}" for x in row[:4]) for d, row in enumerate(q[:4]))
    )
    if doc["predicted_speedup"] < 1.0:
        print(
            "note: with this draft, speculation is predicted SLOWER than vanilla decoding on this backend "
            "(a cheaper or better-aligned draft is needed; the best tree is written anyway)"
        )
    print("paths: " + json.dumps(doc["paths"]) + (f"; candidates {doc['candidates']}" if doc.get("candidates") else ""))
    print("written: " + ", ".join(doc["written"]) + (f"; plot {args.plot}" if args.plot else ""))
    return 0
