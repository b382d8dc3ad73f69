"""`arborspec build`: TensorRT engines for an export folder (target, and the draft if it has one).

Role in one decoding step: none at run time. It prepares the engines the `tensorrt` backend
runs for every model call of a step (draft levels, the target's verify, prefills), with
optimisation profiles sized for the decode loop's limits (batch, tree nodes, context).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from arborspec.runtime.errors import InputError, MissingFileError
from arborspec.tools.commands.options import add_export_dir_arg, command_parser

EXAMPLE = """example:
  arborspec build --export-dir exports/smollm2 --max-tree-nodes 32 --max-context 2048
  # ahead of time on a machine without a GPU (TensorRT-RTX), for an RTX 4090 / L4 (SM 8.9):
  ARBORSPEC_TRT_MODULE=tensorrt_rtx arborspec build --export-dir exports/smollm2 \\
      --compute-capability 8.9 --out engines/sm89

Writes <out>/target.engine, <out>/draft.engine (when the export has a draft.onnx; a bigram
or table draft has no graph and needs no engine), <out>/draft_fc.engine for an EAGLE-3 head
(its projection graph; the head must be the portable one, `export --attention onnx`) and
<out>/engines.json (profiles, I/O, TensorRT version, compute capability, ONNX sha256).
<out> defaults to <export-dir>/engines."""

DEFAULT_MAX_CONTEXT = 2048


def register(subparsers) -> None:
    p = command_parser(subparsers, "build", "build TensorRT engines from an export folder", __doc__, EXAMPLE)
    add_export_dir_arg(p, "folder written by `arborspec export` (target.onnx, draft.onnx, manifest.json)")
    p.add_argument("--max-batch", type=int, default=1, help="largest batch B (default 1)")
    p.add_argument(
        "--max-tree-nodes",
        type=int,
        default=64,
        help="largest draft tree; a verify call is nodes+1 tokens (default 64)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help=f"largest P+T, the KV cache length (default {DEFAULT_MAX_CONTEXT}, "
        "or the model's max positions if smaller)",
    )
    p.add_argument(
        "--compute-capability",
        default=None,
        metavar="X.Y",
        help="build ahead of time for this GPU (TensorRT-RTX only), e.g. 8.9; default: the local GPU",
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (default <export-dir>/engines)")
    p.add_argument(
        "--only",
        choices=["target", "draft"],
        default=None,
        help="build just one (draft: both graphs of an EAGLE-3 head)",
    )
    p.add_argument(
        "--trt-module",
        choices=["auto", "tensorrt", "tensorrt_rtx"],
        default="auto",
        help="TensorRT Python module (default: tensorrt if importable, else tensorrt_rtx; env ARBORSPEC_TRT_MODULE)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show TensorRT warnings")
    p.set_defaults(run=run)


def _model_max_position(onnx_path: Path) -> int | None:
    """max_position from the export's metadata (ONNX metadata_props or manifest.json), if any."""
    from arborspec.export.trt_build import _onnx_metadata

    def find(obj):
        if isinstance(obj, dict):
            for k in ("max_position", "max_position_embeddings"):
                if isinstance(obj.get(k), int):
                    return obj[k]
            for v in obj.values():
                r = find(v)
                if r:
                    return r
        return None

    for v in _onnx_metadata(onnx_path).values():
        try:
            r = find(json.loads(v))
        except (json.JSONDecodeError, TypeError):
            continue
        if r:
            return r
    man = onnx_path.parent / "manifest.json"
    if man.is_file():
        try:
            return find(json.loads(man.read_text()))
        except json.JSONDecodeError:
            return None
    return None


def _eagle3_fc_file(d: Path) -> Path | None:
    """The projection graph of the export's EAGLE-3 head (manifest draft kind eagle3), or None."""
    man = d / "manifest.json"
    try:
        draft = json.loads(man.read_text()).get("draft") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if draft.get("kind") != "eagle3":
        return None
    return d / str(draft.get("fc_file") or "draft_fc.onnx")


def _build_jobs(d: Path, only: str | None) -> list[tuple[str, Path]]:
    """The graphs of export folder `d` to build, as (name, path): target, then draft and an EAGLE-3
    head's projection (draft_fc) where the export has them; `only` keeps one of target / draft.
    One line for a missing folder or graph."""
    if not d.exists():
        raise MissingFileError(f"export folder not found: {d}")
    if not d.is_dir():
        raise MissingFileError(f"--export-dir is not a folder: {d}")
    target, draft = d / "target.onnx", d / "draft.onnx"
    if not target.is_file():
        raise MissingFileError(f"{d} has no target.onnx (run `arborspec export` first)")
    jobs = [("target", target)]
    if draft.is_file():
        jobs.append(("draft", draft))
        fc = _eagle3_fc_file(d)
        if fc is not None:  # an EAGLE-3 head: its projection graph too
            if not fc.is_file():
                raise MissingFileError(f"{fc}: the EAGLE-3 projection graph listed in the manifest is missing")
            jobs.append(("draft_fc", fc))
    elif only == "draft":
        raise MissingFileError(f"{d} has no draft.onnx (a bigram/table draft needs no engine)")
    return [j for j in jobs if j[0].split("_")[0] == only] if only else jobs


def run(args) -> int:
    from arborspec.export import trt_build as tb

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    d: Path = args.export_dir
    target, draft = d / "target.onnx", d / "draft.onnx"
    jobs = _build_jobs(d, args.only)
    # ONNX Runtime's GroupQueryAttention graphs cannot be parsed: one line before any work
    # (the EAGLE-3 head named first: its message says how to re-export)
    for _, onnx_path in sorted(jobs, key=lambda j: j[0] == "target"):
        meta = tb._onnx_metadata(onnx_path)
        if meta.get("arborspec.kv_layout") == "bhsd":
            raise InputError(f"{d}: " + tb.gqa_graph_message(onnx_path.name, meta))

    from arborspec.export.preflight import check_build

    check_build([p for _, p in jobs], str(d))  # one line before TensorRT is imported
    try:
        tb.normalize_compute_capability(args.compute_capability)
        trt, flavour = tb.import_tensorrt(args.trt_module)
    except tb.TensorRTNotInstalled as e:
        raise InputError(str(e)) from None
    cc = tb.normalize_compute_capability(args.compute_capability)
    if cc is not None and flavour == "tensorrt_rtx":
        tb._cc_enum(trt, cc)  # unsupported -> one clear line before any work

    max_pos = _model_max_position(target)
    max_context = args.max_context
    if max_context is None:
        max_context = min(DEFAULT_MAX_CONTEXT, max_pos) if max_pos else DEFAULT_MAX_CONTEXT
    elif max_pos and max_context > max_pos:
        raise InputError(f"--max-context {max_context} exceeds the model's {max_pos} positions")

    tb.plan_profiles(args.max_batch, args.max_tree_nodes, max_context)  # limits: fail early
    out = args.out or (d / "engines")
    say(f"building {', '.join(n for n, _ in jobs)} with {flavour} {trt.__version__} into {out}")
    eagle3 = any(n == "draft_fc" for n, _ in jobs) or _eagle3_fc_file(d) is not None
    for name, onnx_path in jobs:
        # an EAGLE-3 head's own cache holds the committed context plus one tree's scratch entries
        ctx = max_context + args.max_tree_nodes + 1 if eagle3 and name == "draft" else max_context
        r = tb.build_engine(
            onnx_path,
            out / f"{name}.engine",
            max_batch=args.max_batch,
            max_tree_nodes=args.max_tree_nodes,
            max_context=ctx,
            compute_capability=cc,
            flavour=flavour,
            log=say,
            verbose=args.verbose,
        )
        profs = "; ".join(
            f"{p['name']}: N {p['ranges']['N'][0]}..{p['ranges']['N'][2]}"
            if "N" in p["ranges"]
            else f"{p['name']}: T {p['ranges']['T'][0]}..{p['ranges']['T'][2]}, "
            f"P {p['ranges']['P'][0]}..{p['ranges']['P'][2]}"
            for p in r.entry["profiles"]
        )
        print(f"{name}: {r.engine_path} ({r.entry['bytes'] / 2**20:.1f} MiB, {r.seconds:.1f}s; {profs})")
    if not draft.is_file() and args.only is None:
        print("draft: no draft.onnx in the export (a bigram/table draft has no graph): skipped")
    print(f"manifest: {out / tb.MANIFEST_NAME}")
    return 0
