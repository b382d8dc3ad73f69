"""Polygraphy data-loader script: the feeds the arborspec runtime itself produces.

Role: lets the stock `polygraphy run` CLI exercise an export on real decoding inputs. Without
a data loader Polygraphy fills every dynamic dimension with 1 and "passes" while checking
nothing useful (T = 1, P = 1, a one-column mask). `load_data()` yields, for the graph being
run, the same feeds `arborspec compare` uses (arborspec.tools.compare.comparison.build_feeds): a prefill
(P = 0, a prompt chain), a one-token decode (T = 1, P > 0) and one verify step per tree policy
(chain, full, beam, static, dynamic up to max_tree_nodes nodes) drafted by the real
draft_tree over a cache of P > 0 past tokens; for draft.onnx, the draft's own calls (its
prefill chain and one call per tree level). The feeds are made with the export's own ONNX
Runtime engines, so no PyTorch source model is needed.

Which export and graph: `ARBORSPEC_EXPORT_DIR` (else the folder of the first `*.onnx`
argument on Polygraphy's command line); the graph is the one named on the command line
(target.onnx or draft.onnx), or `ARBORSPEC_GRAPH=target|draft`. Optional:
`ARBORSPEC_TREES` (trees per policy, default 1), `ARBORSPEC_SEED` (default 0).

Exact command (ONNX Runtime on the export's target graph; add `--load-outputs torch.json`
from `arborspec compare --save-outputs torch.json` to compare against PyTorch):

    polygraphy run DIR/target.onnx --onnxrt \\
        --data-loader-script $(python -c 'import arborspec.tools.compare.polygraphy_data_loader as m; print(m.__file__)')

and for the draft graph the same with DIR/draft.onnx.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from arborspec.runtime import settings
from arborspec.runtime.errors import InputError, MissingFileError


def _locate() -> tuple[Path, str | None]:
    env = settings.path("ARBORSPEC_EXPORT_DIR")
    onnx_arg = next((a for a in sys.argv[1:] if a.endswith(".onnx")), None)
    if env:
        root = Path(env)
    elif onnx_arg:
        root = Path(onnx_arg).resolve().parent
    else:
        raise MissingFileError("arborspec data loader: set ARBORSPEC_EXPORT_DIR or run it on DIR/target.onnx")
    return root, onnx_arg


def feeds(
    export_dir: str | os.PathLike | None = None,
    graph: str | None = None,
    trees: int | None = None,
    seed: int | None = None,
) -> list:
    """The feed dicts (OrderedDict[str, numpy.ndarray]) for one graph of an export folder."""
    from arborspec.runtime.drafts.bigram import load_bigram_table
    from arborspec.runtime.export_dir import load_export_dir
    from arborspec.tools.compare.comparison import build_feeds

    root, onnx_arg = _locate() if export_dir is None else (Path(export_dir), None)
    target, draft, _, man = load_export_dir(root, load_tokenizer=False)
    if graph is None:
        graph = settings.text("ARBORSPEC_GRAPH")
    if graph is None and onnx_arg is not None:
        name = Path(onnx_arg).name
        graph = "draft" if name == man.draft.get("file") else "target"
    graph = graph or "target"
    if graph not in ("target", "draft"):
        raise InputError(f"ARBORSPEC_GRAPH must be target or draft, got {graph!r}")
    if graph == "draft" and man.draft.get("kind") != "onnx":
        raise InputError(f"{root} has no draft graph (draft kind {man.draft.get('kind')})")
    if isinstance(draft, (str, Path)):
        draft = load_bigram_table(draft)
    import numpy as np

    kv = np.float16 if (man.target.get("kv_dtype") or man.target.get("dtype")) == "fp16" else np.float32
    out = build_feeds(
        target,
        draft,
        max_tree_nodes=int(man.limits.get("max_tree_nodes", 64)),
        max_context=man.limits.get("max_context"),
        trees=int(trees if trees is not None else settings.integer("ARBORSPEC_TREES")),
        seed=int(seed if seed is not None else settings.integer("ARBORSPEC_SEED")),
        kv_dtype=kv,
    )
    from arborspec.runtime.contract import kv_layout
    from arborspec.runtime.onnx_meta import read_onnx_metadata
    from arborspec.tools.compare.feeds import feed_in_layout

    entry = man.target if graph == "target" else man.draft
    layout = kv_layout(read_onnx_metadata(man.path(entry["file"]))["metadata"])
    return [feed_in_layout(f.data, layout) for f in out[graph]]


def load_data():
    """Polygraphy's entry point: a generator of feed dicts."""
    yield from feeds()
