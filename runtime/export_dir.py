"""Open an export folder on any backend: target engine, draft source, tokenizer, manifest.

Role in one decode step: this runs before the first step. `open_export` reads and checks the
manifest (runtime/contract.py), then builds the engines that every step calls (the target once
per step to verify; the draft source once per tree level) and the tokenizer, for ONNX Runtime
(the ONNX graphs) or TensorRT (the engines `arborspec build` wrote into DIR/engines). It is
on the runtime path, so it never imports onnx, polygraphy, transformers, arborspec.models or
arborspec.export.

    with open_export("exports/smollm2", backend="onnxruntime", draft="lookup") as ex:
        ex.target, ex.draft, ex.tokenizer, ex.manifest
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .contract import FORMAT, MANIFEST_NAME, Manifest, check_arborspec_onnx, read_engines_manifest, read_manifest  # noqa: F401
from .decoder_config import with_options
from .errors import (
    DeviceError,
    ExportDirError,
    InexactSpeculationWarning,
    InputError,
    MissingFileError,
    ThreadPoolWarning,
    one_line,
)
from .onnx_meta import read_onnx_metadata  # noqa: F401

BACKENDS = ("onnxruntime", "tensorrt")
LAID_OUT_TREE = "chain:2"  # the default tree under the row layout (OpenedExport.tree_default)


@dataclass
class OpenedExport:
    """An opened export folder. `draft` is a DraftSource or None; close() closes every engine."""

    target: Any
    draft: Any
    tokenizer: Any
    manifest: Manifest
    backend: str
    device: str
    engines: list = field(default_factory=list)

    @property
    def limits(self) -> dict:
        return dict(self.manifest.limits or {})

    @property
    def describe(self) -> str:
        """The folder, backend and device, as the CLI names what it opened."""
        return f"{self.manifest.root} ({self.backend}, {self.device})"

    @property
    def exact_speculation(self) -> bool:
        """Whether chain/tree decoding on this export reproduces its vanilla decoding (greedy:
        token for token; sampled: the same distribution): see `inexact_speculation_reason`."""
        return inexact_speculation_reason(self.manifest, self.target.caps.row_invariant) is None

    @property
    def tree_default(self) -> str | None:
        """The tree of a call that names none (when `arborspec tune` has not chosen one): the
        manifest's, but a chain of 2 on a target whose calls the row-invariant layout carries, where
        a branching tree costs padded bands or one call per path (int4 SmolLM2 + its EAGLE-3 head,
        one prompt, 2 cores: full:3,2 19.6 tok/s against vanilla's 92.1; chain:2 1.21-1.36x vanilla in two bench runs)."""
        tree = (self.manifest.tree_defaults or {}).get("tree")
        if tree and self.target.caps.row_invariant and not tree.startswith("chain:"):
            return LAID_OUT_TREE
        return tree

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.engines = []

    def __enter__(self) -> "OpenedExport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def int8_activation_level(target: dict | None) -> int:
    """The MatMulNBits accuracy level of a manifest's target entry when it computes with int8
    activations (>= 4), else 0."""
    q = (target or {}).get("quantization") or {}
    level = int(q.get("accuracy_level") or 0)
    return level if q.get("format", "matmulnbits") == "matmulnbits" and level >= 4 else 0


def inexact_speculation_reason(man: Manifest, row_invariant: bool = False) -> str | None:
    """Why verifying T tokens in one target call can give other logits than T one-token calls
    on this export, or None. ONNX Runtime's MatMulNBits at accuracy level 4 rounds activations
    to int8, which turns any last-bit difference between a row computed alone and inside a
    larger call into whole logits (measured on SmolLM2-135M int4: up to 1.5). The ONNX Runtime
    engine's row-invariant layout (`row_invariant`: runtime/backends/row_layout.py, on for such
    exports unless ARBORSPEC_ORT_ROW_LAYOUT=0) removes those differences, so the export is exact
    there; elsewhere (the portable graph, the layout turned off) it is not. (Float exports differ
    by ~1e-5 in a logit without the layout: greedy equality by observation; with
    ARBORSPEC_ORT_ROW_LAYOUT=1 by construction, at the layout's cost: docs/int4.md.)"""
    level = int8_activation_level(man.target)
    if level and not row_invariant:
        return (
            f"{man.root}: the target computes with int8 activations (--accuracy-level {level}) and this engine "
            "does not lay calls out row-invariantly (ARBORSPEC_ORT_ROW_LAYOUT=0, or not ONNX Runtime's gqa graph): "
            "logits depend on how many tokens a call verifies, so chain/tree output can differ from vanilla"
        )
    return None


def load_tokenizer(man: Manifest):
    """The export's TextTokenizer, or None when it exported none."""
    tok = man.tokenizer
    if not tok or not tok.get("files"):
        return None
    from .fileio import sha256_file
    from .tokenizer import TextTokenizer

    tj = man.root / "tokenizer.json"
    if tok.get("sha256") and tj.is_file() and sha256_file(tj) != tok["sha256"]:
        raise ExportDirError(
            f"{tj} is not the tokenizer this model was exported with (sha256 differs from "
            "the manifest): the ids would be wrong; re-export or restore the file"
        )
    try:
        return TextTokenizer.load(man.root)
    except (ValueError, OSError) as e:
        if isinstance(e, ExportDirError):
            raise
        raise ExportDirError(f"{man.root}: cannot read the tokenizer ({one_line(e)})") from None


def _engine(opened: OpenedExport, role: str, opening: OpenOptions, spinning: bool = False):
    """The `role` engine ("target", "draft") of the opened export, on its backend and device."""
    backend, man, device = opened.backend, opened.manifest, opened.device
    if backend == "onnxruntime":
        from .backends.onnxruntime import OrtEngine
        from .backends.ort_loader import row_layout_env

        env = row_layout_env()  # unset: the row-invariant layout where int8 activations need it
        invariant = role == "target" and (bool(int8_activation_level(man.target)) if env is None else env)
        return OrtEngine(
            man.path(man.data[role]["file"]),
            providers=opening.providers,
            device=device,
            spinning=spinning,
            row_invariant=invariant,
        )
    from .backends.tensorrt import TrtEngine

    edir = opening.engines(man)
    emf = read_engines_manifest(edir, missing_ok=True)
    path = emf.path(role) if emf else None
    if path is None or not path.is_file():
        raise MissingFileError(
            f"no TensorRT {role} engine in {edir}: run `arborspec build --export-dir {man.root}` first"
        )
    return TrtEngine(path, device=device if device.startswith("cuda") else "cuda")


def _eagle3_draft(backend: str, man: Manifest, target, device: str, edir: Path):
    """The export's EAGLE-3 head (ONNX Runtime: its two graphs; TensorRT: the engines `arborspec
    build` made from the portable graphs), checked against the target's feature output."""
    from .drafts.eagle3 import Eagle3Draft, OrtEagle3Head, TrtEagle3Head

    if backend == "onnxruntime":
        head = OrtEagle3Head(man.path(man.draft["file"]), man.path(man.draft["fc_file"]), device=device)
    else:
        if man.draft.get("kv_layout", "bhsd") == "bhsd":
            raise ExportDirError(
                f"{man.root}: the EAGLE-3 head is ONNX Runtime's GroupQueryAttention graph, which TensorRT "
                "cannot run: re-export with --attention onnx, then `arborspec build`"
            )
        emf = read_engines_manifest(edir, missing_ok=True)
        paths = [emf.path(r) if emf else None for r in ("draft", "draft_fc")]
        if any(p is None or not p.is_file() for p in paths):
            raise MissingFileError(
                f"no TensorRT EAGLE-3 head engines (draft, draft_fc) in {edir}: run "
                f"`arborspec build --export-dir {man.root}` first"
            )
        head = TrtEagle3Head(paths[0], paths[1], device=device if device.startswith("cuda") else "cuda")
    n = target.info.n_features
    if n != head.feature_size:
        head.close()
        raise ExportDirError(
            f"{man.root}: the target graph outputs {n} feature values per token, the EAGLE-3 head reads "
            f"{head.feature_size}: re-export with --draft eagle3"
        )
    return Eagle3Draft(head)


@dataclass(frozen=True)
class OpenOptions:
    """How `open_export` opens a folder, besides the backend and device."""

    # None or "export" (the export's own draft; "eagle3" names it too when it is an EAGLE-3
    # head), "none", "lookup[:N]" (prompt lookup, no model), "suffix[:...]", or "export+lookup[:N]" /
    # "export+suffix" (the export's model draft mixed with a table draft); runtime/drafts/spec.py
    draft: str | None = None
    providers: list | None = None  # ONNX Runtime's execution providers (None: the device's)
    engine_dir: str | os.PathLike | None = None  # TensorRT engines (None: DIR/engines)
    load_tok: bool = True  # load the tokenizer
    verify: bool = False  # check every file's sha256 too

    def engines(self, man: Manifest) -> Path:
        """The folder of the TensorRT engines."""
        return Path(self.engine_dir) if self.engine_dir else man.root / "engines"


OPEN_FIELDS = frozenset(f.name for f in fields(OpenOptions))


def open_export(
    dir: str | os.PathLike,
    backend: str = "onnxruntime",
    device: str = "cpu",
    opening: OpenOptions | None = None,
    **options,
) -> OpenedExport:
    """Open an export folder. opening: OpenOptions (draft, providers, engine_dir, load_tok,
    verify), options its fields as keywords over it: open_export(dir, draft="lookup")."""
    from .drafts.spec import parse_draft_spec
    from .drafts.tables import mixed_draft

    opening = with_options(opening or OpenOptions(), options, "open_export")
    draft = opening.draft
    _check_backend(backend)
    man = read_manifest(dir, check_checksums=opening.verify)
    opened = OpenedExport(None, None, None, man, backend, device)
    try:
        ds = parse_draft_spec(draft, default="export")  # ds.mix: the export's draft mixed with lookup
        kind = man.draft.get("kind", "none")
        # no draft model runs between target calls: the target's threads may spin-wait
        model_free = ds.kind in ("lookup", "suffix", "none") or kind in ("none", "bigram")
        target = _engine(opened, "target", opening, spinning=model_free)
        opened.target = target
        opened.engines.append(target)
        opened.draft = _open_draft(opened, ds, opening)
        if ds.mix:
            if opened.draft is None or kind in ("none", "bigram"):
                raise InputError(
                    f"--draft {draft!r}: {man.root} has no model draft to mix with {ds.mix_kind} "
                    f"(its draft: {kind}); use --draft {ds.mix_kind}, or export with a model draft"
                )
            opened.draft = mixed_draft(opened.draft, ds.mix_kind, ds.mix, target.info.vocab_size)
        opened.tokenizer = load_tokenizer(man) if opening.load_tok else None
        _warn_on_open(opened, model_free)
    except BaseException:
        opened.close()
        raise
    return opened


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise InputError(
            f"backend {backend!r} cannot open an export folder (expected one of "
            f"{', '.join(BACKENDS)}; the torch backend loads models with --model)"
        )
    if backend == "tensorrt":
        import torch

        if not torch.cuda.is_available():  # before pointing at `arborspec build`: engines need a GPU to run
            raise DeviceError(
                "--backend tensorrt runs on an NVIDIA GPU with CUDA and none is visible here: "
                "use --backend onnxruntime (CPU)"
            )


def _open_draft(opened: OpenedExport, ds, opening: OpenOptions):
    """The draft `ds` asks for over the opened target (its engines join opened.engines, so a
    failure closes them): lookup, none, or the export's own (model, bigram, EAGLE-3)."""
    from .drafts.bigram import load_bigram_table
    from .drafts.model import ModelDraft
    from .drafts.tables import table_draft

    man, backend, device, target = opened.manifest, opened.backend, opened.device, opened.target
    kind = man.draft.get("kind", "none")
    if ds.kind in ("lookup", "suffix"):
        return table_draft(ds.kind, ds.arg, target.info.vocab_size)
    if ds.kind == "none":
        return None
    if ds.kind != "export" and not (ds.text.lower() == "eagle3" == kind):  # "eagle3": the export's own
        raise InputError(
            f"--draft {ds.text!r} cannot be used with an export folder: its draft is "
            "fixed at export time (use `export`, `none`, `lookup[:N]` or `suffix[:...]`, or re-export)"
        )
    if kind == "onnx":
        d = _engine(opened, "draft", opening)
        opened.engines.append(d)
        if d.info.vocab_size != target.info.vocab_size:
            raise ExportDirError(f"draft vocabulary {d.info.vocab_size} != target vocabulary {target.info.vocab_size}")
        return ModelDraft(d)
    if kind == "bigram":
        return load_bigram_table(man.path(man.draft["file"]))
    if kind == "eagle3":
        draft = _eagle3_draft(backend, man, target, device, opening.engines(man))
        opened.engines.append(draft.engine)
        return draft
    if kind != "none":
        raise ExportDirError(f"unknown draft kind {kind!r} in {man.root / MANIFEST_NAME}")
    return None


def _warn_on_open(opened: OpenedExport, model_free: bool) -> None:
    """Warnings at open_export's caller: speculation that is not exact on this export, and a
    draft model and target on thread pools of their own (ONNX Runtime on CPU, no pool chosen)."""
    man, target = opened.manifest, opened.target
    reason = inexact_speculation_reason(man, target.caps.row_invariant) if opened.draft is not None else None
    if reason:
        warnings.warn(reason, InexactSpeculationWarning, stacklevel=3)
    if opened.backend == "onnxruntime" and str(opened.device) == "cpu" and not model_free:
        from .backends.ort_loader import pool_unchosen

        if pool_unchosen():  # unchosen: the shared pool is off too
            warnings.warn(
                "the draft model and the target run on ONNX Runtime thread pools of their own, and every call "
                "pays a wake-up (measured on 2 cores, int4 SmolLM2 + EAGLE-3: a verify call 9.5 instead of 7.6 ms, "
                "speculation slower than vanilla): call arborspec.enable_shared_pool() before opening, or set "
                "ARBORSPEC_ORT_SHARED_POOL=1",
                ThreadPoolWarning,
                stacklevel=3,
            )


def load_export_dir(
    dir: str | os.PathLike,
    backend: str = "onnxruntime",
    device: str = "cpu",
    providers: list | None = None,
    load_tokenizer: bool = True,
):
    """The older form of `open_export`: -> (target_engine, draft, tokenizer, manifest), where
    draft is the ONNX draft's engine, the bigram table's path, or None."""
    ex = open_export(dir, backend, device, providers=providers, load_tok=load_tokenizer)
    d = ex.draft.engine if hasattr(ex.draft, "engine") else ex.draft
    if ex.manifest.draft.get("kind") == "bigram":
        d = ex.manifest.path(ex.manifest.draft["file"])
    return ex.target, d, ex.tokenizer, ex.manifest


__all__ = [
    "OpenedExport",
    "OpenOptions",
    "open_export",
    "load_export_dir",
    "load_tokenizer",
    "inexact_speculation_reason",
    "Manifest",
    "ExportDirError",
    "read_manifest",
    "read_onnx_metadata",
    "check_arborspec_onnx",
    "MANIFEST_NAME",
    "FORMAT",
]
