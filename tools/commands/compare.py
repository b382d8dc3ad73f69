"""`arborspec compare`: Polygraphy comparison of an export folder, PyTorch vs ONNX Runtime
(vs TensorRT), on the feeds the runtime itself produces (see arborspec.tools.compare.comparison).

Exit status: 0 all outputs within tolerance, 1 some output beyond it (named in the table),
2 a usage error (one line).
"""

from __future__ import annotations

import sys
from pathlib import Path

from arborspec.runtime.errors import InputError, MissingFileError
from arborspec.tools.commands.options import add_export_dir_arg, add_quiet_progress_args, add_seed_arg, command_parser

EXAMPLE = """examples:
  arborspec compare --export-dir ~/.cache/arborspec/exports/smollm2-135m-layers4 --atol 1e-2
  arborspec compare --export-dir out/tiny --runners torch,onnxruntime --trees 3 \\
      --save-inputs in.json --save-outputs out.json
  polygraphy run out/tiny/target.onnx --onnxrt --load-inputs in.json --load-outputs out.json

Tolerances (elementwise: abs <= atol or rel <= rtol, relative to PyTorch) default from the
export's dtype: fp32 atol 1e-4 rtol 1e-3 (tiny models), fp16 2e-2. A 30-layer fp32 model such
as SmolLM2-135M needs about --atol 1e-2 on trees of 64 nodes (ONNX Runtime's fused kernels
sum in another order; argmax is identical). A quantised export (--quantize) is judged against
the fp32 PyTorch reference on the original weights by top-1 agreement and relative logit error
(int8: >= 95 %, <= 0.05; int4: >= 85 %, <= 0.30; --min-top1 / --max-logit-rel override).
--save-inputs/--save-outputs write Polygraphy
JSON for the target graph at F and for the draft graph at F with .draft before the suffix."""


def register(sub) -> None:
    p = command_parser(
        sub, "compare", "compare PyTorch / ONNX Runtime / TensorRT on runtime-made feeds", __doc__, EXAMPLE
    )
    add_export_dir_arg(p)
    p.add_argument(
        "--runners",
        default=None,
        help="comma-separated: torch,onnxruntime,tensorrt (default all three; tensorrt is "
        "skipped with a note where there is no GPU, an error when named here)",
    )
    p.add_argument("--trees", type=int, default=1, help="trees per policy, each over another past length (default 1)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default from the dtype)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default from the dtype)")
    p.add_argument(
        "--min-top1",
        type=float,
        default=None,
        metavar="F",
        help="quantised exports: minimum top-1 agreement with the fp32 PyTorch reference "
        "(default: int8 0.95, int4 0.85; see QUANT_TOLERANCES in arborspec.tools.compare.comparison)",
    )
    p.add_argument(
        "--max-logit-rel",
        type=float,
        default=None,
        metavar="F",
        help="quantised exports: maximum relative logit error ||logits - ref|| / ||ref|| "
        "(default: int8 0.05, int4 0.30)",
    )
    add_seed_arg(p, "seed of the random trees and past (default 0)")
    p.add_argument(
        "--model", default=None, help="PyTorch reference: registry name or path (default: the source in the manifest)"
    )
    p.add_argument("--engine-dir", type=Path, default=None, help="TensorRT engines (default EXPORT_DIR/engines)")
    p.add_argument("--save-inputs", type=Path, default=None, help="Polygraphy JSON of the feeds")
    p.add_argument("--save-outputs", type=Path, default=None, help="Polygraphy RunResults JSON")
    p.add_argument("--all-outputs", action="store_true", help="one row per K/V output (default: folded per kind)")
    add_quiet_progress_args(p)
    p.add_argument("--verify", action="store_true", help="check every file's sha256 against the manifest first")
    p.set_defaults(run=run)


def run(args) -> int:
    from arborspec.tools.compare.comparison import compare_export, parse_runners

    parse_runners(args.runners)  # cheap checks first
    if args.trees < 1:
        raise InputError(f"--trees must be >= 1, got {args.trees}")
    for p in (args.save_inputs, args.save_outputs):
        if p is not None and not p.parent.is_dir():
            raise MissingFileError(f"{p.parent}: no such folder for {p.name}")
    rep = compare_export(
        args.export_dir,
        args.runners,
        trees=args.trees,
        atol=args.atol,
        rtol=args.rtol,
        seed=args.seed,
        model=args.model,
        save_inputs=args.save_inputs,
        save_outputs=args.save_outputs,
        engine_dir=args.engine_dir,
        verify=args.verify,
        progress=not args.no_progress and sys.stderr.isatty(),
        min_top1=args.min_top1,
        max_rel=args.max_logit_rel,
    )
    print(rep.table(all_outputs=args.all_outputs))
    for s in rep.saved:
        print(f"saved {s}")
    return 0 if rep.passed else 1
