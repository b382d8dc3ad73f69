"""Polygraphy comparisons of an export folder: PyTorch vs ONNX Runtime (vs TensorRT).

Role: a release check, not part of a decoding step. It feeds every graph of an export folder
(target and draft) the inputs that the runtime itself produces during decoding and compares
the outputs of several runners with Polygraphy's `Comparator.run` + `compare_accuracy`:

* feeds (`build_feeds`): a prefill (P = 0, a prompt chain), a single-token decode (T = 1,
  P > 0, exactly vanilla's step) and, over a cache prefilled with P > 0 random past tokens, one
  verify step per tree policy (chain, full, beam, dynamic with a budget of the manifest's
  max_tree_nodes, and a static file), each drafted by the real `draft_tree` with the export's
  draft and flattened by the decoder's own path (`tree_plan.write_tree`), so T runs from 1 up to max_tree_nodes + 1;
  the draft graph gets the draft's own calls recorded while drafting (its prefill chain and
  one call per tree level over its scratch cache);
* runners: `TorchRunner` (ours: Polygraphy's PytRunner is broken in 0.53), whose module is
  rebuilt from the source the manifest records (`--model` overrides; `layers:K` drafts are
  rebuilt with export_folder.truncated_draft), Polygraphy's `OnnxrtRunner` over
  `SessionFromOnnx`, and `TrtEngineRunner` (ours, around runtime.backends.tensorrt) where a
  CUDA GPU, TensorRT and built engines exist;
* tolerances: elementwise `abs <= atol or rel <= rtol` (Polygraphy's `SimpleCompareFunc`,
  relative to the PyTorch output). Defaults from the manifest's dtype: fp32 atol 1e-4 rtol 1e-3
  (right for tiny test models), fp16 2e-2 / 2e-2. A 30-layer fp32 model such as SmolLM2 needs
  about 1e-2 on the logits at T = 64 (measured: 6e-5 at T = 1, 3.9e-3 at T = 64, P = 256;
  argmax identical): pass `--atol 1e-2`.

Public API: `compare_export(...) -> CompareReport`, `build_feeds(...)`, `reference_modules(...)`,
`TorchRunner`, `default_policies(...)`, `DEFAULT_TOLERANCES`.

`--save-inputs F` / `--save-outputs F` write Polygraphy JSON (a list of feed dicts /
RunResults) for the target graph at F and for the draft graph at F with `.draft` before the
suffix, so the CLI can replay them:

    polygraphy run DIR/target.onnx --onnxrt --load-inputs in.json --load-outputs out.json
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from arborspec.runtime import settings
from arborspec.runtime.errors import InputError
from arborspec.tools.compare.feeds import (  # noqa: F401 - public API
    STATIC_PATHS,
    Feed,
    build_feeds,
    default_policies,
    feed_in_layout,
    outputs_in_layout,
)

DEFAULT_TOLERANCES = {"fp32": (1e-4, 1e-3), "fp16": (2e-2, 2e-2)}
# fp32 weights with an fp16 KV cache (`export --kv-dtype fp16`): the cache's rounding (relative
# 4.9e-4 per K/V) reaches the logits in proportion to their size (measured on the tiny random test
# model, logits up to ~140: 0.06 max abs, 4e-4 of the largest)
KV16_TOLERANCES = (1e-1, 2e-2)
# Quantised exports (manifest target.quantization) against the fp32 PyTorch reference on the
# original weights: (minimum top-1 agreement over all compared logit rows of a graph, maximum
# relative logit error ||logits - ref||_2 / ||ref||_2 over them). The one place these live.
# A GGUF's own blocks compute with the reference's weights (error ~1e-6); round-to-nearest from
# float weights is what these bound.
QUANT_TOLERANCES = {"int8": (0.95, 0.05), "int4": (0.85, 0.30)}
RUNNERS = ("torch", "onnxruntime", "tensorrt")


# ----------------------------------------------------------------------------- which runners run
def _polygraphy() -> None:
    """Import the runners, and with them Polygraphy: an ImportError that says how to install it."""
    from arborspec.tools.compare import runners  # noqa: F401


def _gpu_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _trt_available() -> str | None:
    """None when a TensorRT module imports, else why not."""
    try:
        from arborspec.runtime.backends.trt_loader import import_trt

        import_trt(None)
        return None
    except ImportError as e:
        return str(e)


# ----------------------------------------------------------------------------- reference
def _shape_keys(cfg: dict) -> dict:
    keys = ("family", "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size")
    return {k: cfg.get(k) for k in keys}


def source_spec(man) -> str | None:
    """The model spec recorded in the manifest (registry name or path), or None."""
    src = man.data.get("source") or {}
    for key in ("name", "model", "path"):
        v = src.get(key)
        if isinstance(v, str) and v and v != "None":
            return v
    return None


def reference_modules(man, model: str | None = None):
    """(target module, draft module or None, description) rebuilt from the export's source."""
    from arborspec.export.export_folder import truncated_draft
    from arborspec.models.registry import load_model
    from arborspec.runtime.drafts.spec import parse_draft_spec

    spec = model or source_spec(man)
    if spec is None:
        raise InputError(
            f"{man.root}: the manifest records no source model (exported from an "
            "in-memory module): pass --model NAME|PATH"
        )
    lm = load_model(spec)
    if _shape_keys(lm.config.to_dict()) != _shape_keys(man.target.get("config", {})):
        raise InputError(
            f"model {spec} does not match the export's target config "
            f"({_shape_keys(lm.config.to_dict())} vs {_shape_keys(man.target.get('config', {}))})"
        )
    target = lm.module.float().eval()
    d = man.draft
    draft = None
    if d.get("kind") == "eagle3":  # the head from its checkpoint; the target outputs its features
        from arborspec.models.eagle3 import eagle3_folder, load_eagle3

        draft = load_eagle3(eagle3_folder(d.get("spec") or "eagle3", spec), lm.config).eval()
        target.feature_layers = list(d.get("aux_layers") or draft.config.aux_layers)
    elif d.get("kind") == "onnx":
        ds = parse_draft_spec(d.get("spec"))
        kind, arg = ds.kind, ds.arg
        if kind == "layers":
            draft = truncated_draft(target, arg)
        elif kind == "model":
            dsrc = (man.data.get("source") or {}).get("draft") or {}
            dspec = dsrc.get("path") or dsrc.get("model") or arg
            draft = load_model(dspec).module.float().eval()
        else:
            raise InputError(f"{man.root}: cannot rebuild the draft {d.get('spec')!r} in PyTorch")
        if _shape_keys(draft.config.to_dict()) != _shape_keys(d.get("config", {})):
            raise InputError(f"the rebuilt draft {d.get('spec')} does not match the export's draft config")
    return target, draft, spec


# ----------------------------------------------------------------------------- report
@dataclass
class Row:
    graph: str
    feed: str
    output: str
    runners: str
    max_abs: float
    max_rel: float
    passed: bool
    top1: tuple[int, int] | None = None  # quantised exports: (rows whose argmax agrees, rows)


@dataclass
class CompareReport:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    n_feeds: dict = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (runner, why)
    quant: dict | None = None  # quantised export: {"scheme", "min_top1", "max_rel"}

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def table(self, all_outputs: bool = False) -> str:
        """Per-output table. By default K/V outputs of one feed are folded into one row per
        kind (worst layer named); failing outputs are always listed one by one."""
        if self.quant is not None:
            return self._quant_table()
        rows = self.rows if all_outputs else _fold(self.rows)
        head = ("graph", "feed", "output", "runners", "max abs err", "max rel err", "result")
        body = [
            (
                r.graph,
                r.feed,
                r.output,
                r.runners,
                f"{r.max_abs:.3g}",
                f"{r.max_rel:.3g}",
                "pass" if r.passed else "FAIL",
            )
            for r in rows
        ]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*b) for b in body]
        for g in self.n_feeds or {"target": 0}:
            lines += [fmt.format(g, "*", "*", name, "-", "-", f"skipped: {why}") for name, why in self.skipped]
        lines += [f"note: {n}" for n in self.notes]
        nf = len(self.failures)
        lines.append(
            f"{'PASSED' if self.passed else 'FAILED'}: {len(self.rows) - nf}/{len(self.rows)} "
            f"outputs within atol {self.atol:g} / rtol {self.rtol:g}"
            + (
                ""
                if self.passed
                else f"; failing: {', '.join(sorted({f'{r.graph}:{r.output}' for r in self.failures}))}"
            )
        )
        return "\n".join(lines)

    def _quant_table(self) -> str:
        q = self.quant
        head = ("graph", "feed", "runners", "max abs logit err", "rel logit err", "top-1 agreement", "result")
        body = [
            (
                r.graph,
                r.feed,
                r.runners,
                f"{r.max_abs:.3g}",
                f"{r.max_rel:.3g}",
                f"{r.top1[0]}/{r.top1[1]} ({r.top1[0] / max(r.top1[1], 1):.1%})",
                ("pass" if r.passed else "FAIL") if r.feed == "all feeds" else "",
            )
            for r in self.rows
        ]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body]
        lines += [f"skipped runner {name}: {why}" for name, why in self.skipped]
        lines += [f"note: {n}" for n in self.notes]
        judged = [r for r in self.rows if r.feed == "all feeds"]
        bad = [f"{r.graph} ({r.runners})" for r in judged if not r.passed]
        lines.append(
            f"quantised ({q['scheme']}) tolerances, per graph over all feeds: top-1 agreement >= "
            f"{q['min_top1']:.0%}, relative logit error ||d||/||ref|| <= {q['max_rel']:g} "
            "(arborspec.tools.compare.comparison.QUANT_TOLERANCES)"
        )
        lines.append(
            f"{'PASSED' if self.passed else 'FAILED'}: {len(judged) - len(bad)}/{len(judged)} graphs within "
            "tolerance" + (f"; failing: {', '.join(bad)}" if bad else "")
        )
        return "\n".join(lines)


def _quant_rows(graph: str, feeds, results, ref_name: str, min_top1: float, max_rel: float) -> list[Row]:
    """Per feed and over all feeds of a graph: max abs / relative logit error and top-1 agreement
    of every runner against the PyTorch reference (rows: every (batch, token) position)."""
    from arborspec.runtime.contract import LOGITS

    by_name = dict(results.items())
    ref_iters = by_name[ref_name]
    rows = []
    for name, iters in by_name.items():
        if name == ref_name:
            continue
        label = f"{name} vs {ref_name}"
        tot_sq = tot_ref = 0.0
        agree = n = 0
        worst = 0.0
        for feed, it, rit in zip(feeds, iters, ref_iters):
            a = np.asarray(it[LOGITS], np.float64).reshape(-1, np.shape(it[LOGITS])[-1])
            r = np.asarray(rit[LOGITS], np.float64).reshape(a.shape)
            d = a - r
            ag = int((a.argmax(-1) == r.argmax(-1)).sum())
            sq, rs = float((d * d).sum()), float((r * r).sum())
            rows.append(
                Row(
                    graph,
                    feed.name,
                    LOGITS,
                    label,
                    float(np.abs(d).max()),
                    (sq / max(rs, 1e-30)) ** 0.5,
                    True,
                    (ag, a.shape[0]),
                )
            )
            tot_sq, tot_ref, agree, n = tot_sq + sq, tot_ref + rs, agree + ag, n + a.shape[0]
            worst = max(worst, float(np.abs(d).max()))
        rel = (tot_sq / max(tot_ref, 1e-30)) ** 0.5
        rows.append(
            Row(
                graph,
                "all feeds",
                LOGITS,
                label,
                worst,
                rel,
                agree / max(n, 1) >= min_top1 and rel <= max_rel,
                (agree, n),
            )
        )
    return rows


def _fold(rows: list[Row]) -> list[Row]:
    out: list[Row] = []
    groups: dict = OrderedDict()
    for r in rows:
        if r.output.startswith(("new_key.", "new_value.")):
            kind = r.output.split(".")[0]
            groups.setdefault((r.graph, r.feed, r.runners, kind), []).append(r)
        else:
            groups[(r.graph, r.feed, r.runners, r.output)] = [r]
    for (g, f, rn, name), rs in groups.items():
        if len(rs) == 1 and rs[0].output == name:
            out.append(rs[0])
            continue
        worst = max(rs, key=lambda r: r.max_abs)
        out.append(
            Row(
                g,
                f,
                f"{name}.* (worst {worst.output})",
                rn,
                worst.max_abs,
                max(r.max_rel for r in rs),
                all(r.passed for r in rs),
            )
        )
        out += [r for r in rs if not r.passed]
    return out


def parse_runners(text: str | Iterable[str] | None) -> tuple[list[str], bool]:
    """-> (runner names, explicitly requested)."""
    if text is None:
        return list(RUNNERS), False
    names = [x.strip().lower() for x in (text.split(",") if isinstance(text, str) else text) if x.strip()]
    alias = {"ort": "onnxruntime", "onnxrt": "onnxruntime", "trt": "tensorrt", "pytorch": "torch"}
    names = [alias.get(n, n) for n in names]
    bad = [n for n in names if n not in RUNNERS]
    if bad:
        raise InputError(f"unknown runner {bad[0]!r} (expected some of {', '.join(RUNNERS)})")
    if len(set(names)) < 2:
        raise InputError("--runners needs at least two different runners to compare")
    return list(dict.fromkeys(names)), True


def _suffixed(path: str | os.PathLike, graph: str) -> Path:
    p = Path(path)
    return p if graph == "target" else p.with_name(f"{p.stem}.{graph}{p.suffix or '.json'}")


@dataclass
class CompareOptions:
    """What `compare_export` does besides the folder and the runners (the `compare` flags)."""

    trees: int = 1  # trees per policy in the feeds
    atol: float | None = None  # None: the manifest dtype's DEFAULT_TOLERANCES (KV16_TOLERANCES)
    rtol: float | None = None
    seed: int = 0
    model: str | None = None  # the PyTorch reference's source (None: the manifest's)
    save_inputs: str | os.PathLike | None = None  # Polygraphy JSON of the feeds
    save_outputs: str | os.PathLike | None = None  # Polygraphy JSON of the results
    progress: bool = True
    engine_dir: str | os.PathLike | None = None  # TensorRT engines (None: DIR/engines)
    target_module: object = None  # PyTorch references given directly (tests, embedding apps)
    draft_module: object = None
    policies: list[str] | None = None  # tree policies of the feeds (None: default_policies)
    verify: bool = False  # check the manifest's checksums
    min_top1: float | None = None  # quantised exports (None: QUANT_TOLERANCES)
    max_rel: float | None = None


def compare_export(
    export_dir: str | os.PathLike,
    runners: str | Iterable[str] | None = None,
    options: CompareOptions | None = None,
    **kw,
) -> CompareReport:
    """Compare every graph of an export folder across runners on runtime-made feeds
    (`kw`: CompareOptions fields, over `options`).

    A quantised export (the manifest's target.quantization) is judged against the fp32 PyTorch
    reference on the original weights by top-1 agreement and relative logit error
    (QUANT_TOLERANCES, or min_top1 / max_rel), not elementwise: its weights differ by design.

    target_module/draft_module: PyTorch references given directly (tests, embedding apps);
    otherwise rebuilt from the manifest's source (or `model`)."""
    _polygraphy()
    from arborspec.runtime.export_dir import read_manifest

    o = replace(options or CompareOptions(), **kw)
    names, explicit = parse_runners(runners)
    man = read_manifest(export_dir, check_checksums=o.verify)
    report, kv_dtype = _new_report(man, o)
    names = _judge_quantised(man, names, o, report)
    edir = Path(o.engine_dir) if o.engine_dir else Path(man.root) / "engines"
    active = _runnable(names, explicit, edir, man, report)
    target_module, draft_module = _reference_pair(man, o)
    feeds, graphs = _feeds_and_graphs(man, target_module, draft_module, o, kv_dtype, report)
    _run_graphs(_Comparison(man, o, report, edir, kv_dtype, target_module), feeds, graphs, active)
    return report


@dataclass
class _Comparison:
    """What every graph's comparison shares: the export, the options and the report, the
    TensorRT engines' folder, the feeds' K/V dtype and the PyTorch target (the EAGLE-3 head's
    embeddings)."""

    man: object
    o: CompareOptions
    report: CompareReport
    edir: Path
    kv_dtype: type
    target_module: object


def _new_report(man, o: CompareOptions) -> tuple[CompareReport, type]:
    """An empty report with the tolerances (given, else the export's dtype's), and the K/V dtype
    of the feeds."""
    dtype = man.target.get("dtype", "fp32")
    if dtype not in DEFAULT_TOLERANCES:
        raise InputError(f"compare supports fp32 and fp16 exports, not {dtype} (numpy has no bfloat16)")
    # an fp32 export with an fp16 cache (`export --kv-dtype fp16`): fp16 feeds and fp16 tolerances
    kv_name = man.target.get("kv_dtype") or dtype
    d_atol, d_rtol = KV16_TOLERANCES if kv_name == "fp16" and dtype == "fp32" else DEFAULT_TOLERANCES[dtype]
    atol = d_atol if o.atol is None else float(o.atol)
    rtol = d_rtol if o.rtol is None else float(o.rtol)
    if atol < 0 or rtol < 0:
        raise InputError("--atol and --rtol must be >= 0")
    report = CompareReport(atol=atol, rtol=rtol)
    if kv_name != dtype:
        report.notes.append(f"{dtype} weights with a {kv_name} KV cache: {kv_name} feeds and tolerances")
    return report, (np.float16 if kv_name == "fp16" else np.float32)


def _judge_quantised(man, names: list[str], o: CompareOptions, report: CompareReport) -> list[str]:
    """A quantised export: report.quant (its scheme and tolerances), torch first among the
    runners (the reference). Returns the runner names."""
    qinfo = man.target.get("quantization")
    if not qinfo:
        return names
    scheme = qinfo.get("scheme", "int4")
    d_top1, d_rel = QUANT_TOLERANCES.get(scheme, QUANT_TOLERANCES["int4"])
    min_top1 = d_top1 if o.min_top1 is None else float(o.min_top1)
    max_rel = d_rel if o.max_rel is None else float(o.max_rel)
    if not (0 <= min_top1 <= 1) or max_rel < 0:
        raise InputError("--min-top1 must be in [0, 1] and --max-logit-rel >= 0")
    if "torch" not in names:
        raise InputError("a quantised export is compared against the fp32 PyTorch reference: include torch in --runners")
    report.quant = {
        "scheme": scheme,
        "format": qinfo.get("format", "matmulnbits"),
        "min_top1": min_top1,
        "max_rel": max_rel,
    }
    report.notes.append(
        f"{scheme} weights ({qinfo.get('format', 'matmulnbits')}, {qinfo.get('source')}) "
        "vs PyTorch fp32 on the original weights: logits judged, K/V not (quantised "
        "weights change them by design)"
    )
    return ["torch"] + [n for n in names if n != "torch"]


def _runnable(names: list[str], explicit: bool, edir: Path, man, report: CompareReport) -> list[str]:
    """The runners that can run here: TensorRT needs a GPU, the module and built engines (a
    runner asked for by name that cannot run is an error; else it is skipped, with why)."""
    active = []
    for n in names:
        if n == "tensorrt":
            why = None
            if not _gpu_available():
                why = "no GPU"
            elif _trt_available() is not None:
                why = "TensorRT is not installed"
            elif not (edir / "target.engine").is_file():
                why = f"no engines in {edir} (run `arborspec build --export-dir {man.root}`)"
            if why:
                if explicit:
                    raise InputError(f"runner tensorrt was requested but cannot run: {why}")
                report.skipped.append(("tensorrt", why))
                continue
        active.append(n)
    if len(active) < 2:
        raise InputError(f"need at least two runners, only {', '.join(active)} can run here")
    return active


def _reference_pair(man, o: CompareOptions):
    """(target module, draft module or None): as given, else rebuilt from the export's source."""
    target_module, draft_module = o.target_module, o.draft_module
    if target_module is None:
        target_module, ref_draft, _ = reference_modules(man, o.model)
        draft_module = draft_module if draft_module is not None else ref_draft
    return target_module.float().eval(), draft_module


def _feeds_and_graphs(man, target_module, draft_module, o: CompareOptions, kv_dtype, report: CompareReport):
    """The feeds per graph, made by the PyTorch reference (whichever runners run), and the graphs
    to compare: [(graph, file, module, engine file or None for an EAGLE-3 head)]."""
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.drafts.bigram import load_bigram_table

    feed_target = TorchEngine(target_module)
    dkind = man.draft.get("kind", "none")
    if dkind == "onnx":
        if draft_module is None:
            raise InputError("the export has a draft graph: give its PyTorch module too")
        feed_draft = TorchEngine(draft_module.float().eval())
    elif dkind == "eagle3":
        if draft_module is None:
            raise InputError("the export has an EAGLE-3 head: give its PyTorch module too")
        target_module.feature_layers = list(man.draft.get("aux_layers") or draft_module.config.aux_layers)
        feed_target = TorchEngine(target_module)
        feed_draft = None
        report.notes.append("draft: EAGLE-3 head (draft_fc.onnx + draft.onnx) on random tree steps")
    elif dkind == "bigram":
        feed_draft = load_bigram_table(man.path(man.draft["file"]))
        report.notes.append("draft: a bigram table (no graph to compare)")
    else:
        feed_draft = None
        report.notes.append("draft: none in this export")
    feeds = build_feeds(
        feed_target,
        feed_draft,
        max_tree_nodes=int(man.limits.get("max_tree_nodes", 64)),
        max_context=man.limits.get("max_context"),
        trees=o.trees,
        seed=o.seed,
        policies=o.policies,
        kv_dtype=kv_dtype,
    )
    report.n_feeds = {g: len(f) for g, f in feeds.items()}
    graphs = [("target", man.target["file"], target_module, "target.engine")]
    if "draft" in feeds:
        graphs.append(("draft", man.draft["file"], draft_module, "draft.engine"))
    if dkind == "eagle3":
        from arborspec.tools.compare.feeds import eagle3_head_feeds

        feeds["draft"] = eagle3_head_feeds(draft_module.config, o.seed)
        report.n_feeds["draft"] = len(feeds["draft"])
        graphs.append(("draft", man.draft["file"], draft_module, None))
    return feeds, graphs


def _run_graphs(c: _Comparison, feeds: dict, graphs: list, active: list[str]) -> None:
    """Every graph through every active runner on its feeds: rows into the report, the feeds and
    results saved where asked (Polygraphy's logging quiet unless ARBORSPEC_DEBUG)."""
    from polygraphy.logger import G_LOGGER
    from tqdm.auto import tqdm

    from arborspec.runtime.contract import kv_layout
    from arborspec.runtime.onnx_meta import read_onnx_metadata

    man, report = c.man, c.report
    total = sum(len(feeds[g]) for g, *_ in graphs) * len(active)
    bar = tqdm(total=total, desc="compare", unit="run", disable=None if c.o.progress else True, leave=False)
    old_sev = G_LOGGER.module_severity
    if not settings.flag("ARBORSPEC_DEBUG"):
        G_LOGGER.module_severity = G_LOGGER.ERROR
    layouts = {g: kv_layout(read_onnx_metadata(man.path(f))["metadata"]) for g, f, _, _ in graphs}
    try:
        for graph, fname, module, engine_name in graphs:
            bar.set_description(f"compare {graph}")
            tick = lambda: bar.update(1)  # noqa: E731
            if engine_name is None:  # the EAGLE-3 head: torch vs ONNX Runtime (vs TensorRT)
                rs = [_head_runner(c, n, fname, module, tick) for n in active]
            else:
                in_place = layouts.get(graph) == "bhsd" or report.quant is not None
                rs = [_graph_runner(c, n, (fname, module, engine_name), tick, in_place) for n in active]
            data = [f.data for f in feeds[graph]]
            results = _compare_graph(graph, rs, data, feeds[graph], report)
            _save_graph(graph, data, results, layouts[graph], c.o, report)
    finally:
        G_LOGGER.module_severity = old_sev
        bar.close()


def _head_runner(c: _Comparison, n: str, fname, module, tick):
    """An EAGLE-3 head's runner: PyTorch, the portable head in ONNX Runtime, or the TensorRT
    engines `arborspec build` made from it."""
    from arborspec.tools.compare.runners import Eagle3HeadRunner

    man, edir, target_module = c.man, c.edir, c.target_module
    if n == "torch":
        from arborspec.runtime.backends.torch_backend import TorchEagle3Head

        emb = target_module.model.embed_tokens.weight.detach().float()
        return Eagle3HeadRunner(lambda: TorchEagle3Head(module, emb), name="torch", on_infer=tick)
    if n == "onnxruntime":
        from arborspec.runtime.drafts.eagle3 import OrtEagle3Head

        fc = man.path(man.draft["fc_file"])
        return Eagle3HeadRunner(lambda: OrtEagle3Head(man.path(fname), fc), name="onnxruntime", on_infer=tick)
    from arborspec.runtime.drafts.eagle3 import TrtEagle3Head

    return Eagle3HeadRunner(
        lambda: TrtEagle3Head(edir / "draft.engine", edir / "draft_fc.engine"), name="tensorrt", on_infer=tick
    )


def _graph_runner(c: _Comparison, n: str, graph: tuple, tick, in_place: bool):
    """Runner `n` of a contract graph (file, PyTorch module, engine file). in_place: ONNX Runtime
    through the runtime's own session ("bhsd" graphs, and quantised ones: QDQ MatMuls kept exact,
    see OrtEngine)."""
    from polygraphy.backend.onnxrt import SessionFromOnnx

    from arborspec.tools.compare.runners import OrtEngineRunner, OrtRunner, TorchRunner, TrtEngineRunner

    fname, module, engine_name = graph
    if n == "torch":
        return TorchRunner(module, c.kv_dtype, name="torch", on_infer=tick)
    if n == "onnxruntime" and in_place:
        return OrtEngineRunner(c.man.path(fname), c.kv_dtype, name="onnxruntime", on_infer=tick)
    if n == "onnxruntime":
        session = SessionFromOnnx(str(c.man.path(fname)), providers=["CPUExecutionProvider"])
        return OrtRunner(session, name="onnxruntime", on_infer=tick)
    return TrtEngineRunner(c.edir / engine_name, c.kv_dtype, name="tensorrt", on_infer=tick)


def _compare_graph(graph: str, rs: list, data: list, feeds, report: CompareReport):
    """Polygraphy's Comparator over the runners (the first is the reference): a row per output
    and feed (quantised: the logit rows of _quant_rows). Returns the run results."""
    from polygraphy.comparator import Comparator
    from polygraphy.comparator.compare import SimpleCompareFunc
    from polygraphy.exception import PolygraphyException

    try:
        results = Comparator.run(rs, data_loader=data)
        ref = 0
        comps = [(i, ref) for i in range(len(rs)) if i != ref]
        acc = (
            [{}]
            if report.quant is not None
            else Comparator.compare_accuracy(
                results, comparisons=comps, compare_func=SimpleCompareFunc(atol=report.atol, rtol=report.rtol)
            )
        )
    except PolygraphyException as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else "Polygraphy failed"
        raise InputError(f"{graph}: {msg}") from None
    if report.quant is not None:
        q = report.quant
        report.rows += _quant_rows(graph, feeds, results, rs[0].name, q["min_top1"], q["max_rel"])
    for pair, iters in acc[0].items():
        label = f"{pair[0]} vs {pair[1]}"
        for feed, outs in zip(feeds, iters):
            for out_name, res in outs.items():
                report.rows.append(
                    Row(graph, feed.name, out_name, label, float(res.max_absdiff), float(res.max_reldiff), bool(res))
                )
    return results


def _save_graph(graph: str, data: list, results, layout: str, o: CompareOptions, report: CompareReport) -> None:
    """--save-inputs / --save-outputs: Polygraphy JSON that replays with `polygraphy run` on the
    graph itself, so in its own I/O layout."""
    from polygraphy.json import save_json

    if o.save_inputs:
        p = _suffixed(o.save_inputs, graph)
        save_json([feed_in_layout(d, layout) for d in data], str(p), description=f"{graph} inputs")
        report.saved.append(str(p))
    if o.save_outputs:
        p = _suffixed(o.save_outputs, graph)
        for _, iters in results.items():
            for it, d in zip(iters, data):
                conv = outputs_in_layout(dict(it), d, layout)
                for k, v in conv.items():
                    it[k] = v
        results.save(str(p))
        report.saved.append(str(p))


__all__ = [
    "compare_export",
    "CompareOptions",
    "build_feeds",
    "reference_modules",
    "default_policies",
    "source_spec",
    "parse_runners",
    "CompareReport",
    "Row",
    "Feed",
    "DEFAULT_TOLERANCES",
    "QUANT_TOLERANCES",
    "RUNNERS",
    "STATIC_PATHS",
]  # TorchRunner, OrtRunner, TrtEngineRunner: lazily, see __getattr__


def __getattr__(name):  # TorchRunner & co. import polygraphy lazily
    if name in ("TorchRunner", "OrtRunner", "TrtEngineRunner", "OrtEngineRunner", "Eagle3HeadRunner"):
        from arborspec.tools.compare import runners as compare_runners

        return getattr(compare_runners, name)
    raise AttributeError(name)
