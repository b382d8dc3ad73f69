"""`arborspec export`: one self-describing folder with everything a decoding step needs.

Role in one decoding step: none at run time; it produces what every step runs on:
`target.onnx` (the verify call), the draft (`draft.onnx` for a neural draft, called once per
tree level, or `draft_bigram.safetensors` for a table draft), the tokenizer files, and
`manifest.json` (limits, tree defaults, I/O, checksums). The folder is written into a
temporary sibling and renamed at the end, so a failed export leaves no half folder.

Draft specs: `layers:K` (first K layers of the target + final norm + head, a copy of the
target's weights), `bigram` (a next-token table derived from the target), `none`, or a model
spec / path accepted by arborspec.models.registry.load_model (its vocabulary must equal the
target's).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from arborspec.runtime.drafts.spec import parse_draft_spec
from arborspec.runtime.errors import ArborspecError, InputError, OutputError
from arborspec.runtime.fileio import PartialFolder, describe_os_error, remove_stale_partials

from .gqa_graph import KV_DTYPES
from .manifest import build_manifest, graph_entry, write_manifest
from .onnx_export import DEFAULT_OPSET, DTYPES, export_contract_onnx, export_gqa_onnx, sha256_file

log = logging.getLogger("arborspec.export")

TARGET_FILE = "target.onnx"
DRAFT_FILE = "draft.onnx"
BIGRAM_FILE = "draft_bigram.safetensors"
DEFAULT_MAX_TREE_NODES = 64
DEFAULT_DRAFT_TOPK = 16
QFORMATS = ("matmulnbits", "qdq")  # --format of quantised weights
ATTENTIONS = ("auto", "gqa", "onnx")  # K of the draft graph's fused top-k outputs (the widest tree level)


@dataclass
class ExportSummary:
    out: Path
    manifest: dict[str, Any]
    files: list[str] = field(default_factory=list)


_LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def truncated_draft(module: torch.nn.Module, k: int) -> torch.nn.Module:
    """`layers:K`: a new module of config.truncated(K) holding copies of the target's
    embeddings, first K layers, final norm and head."""
    from arborspec.models import build_model

    cfg = module.config
    if not 1 <= k <= cfg.n_layers:
        raise InputError(f"draft layers:{k} needs 1 <= K <= {cfg.n_layers} (the target's layer count)")
    draft = build_model(cfg.truncated(k))
    sd = {}
    for name, t in module.state_dict().items():
        m = _LAYER_KEY.search(name)
        if m and int(m.group(1)) >= k:
            continue
        sd[name] = t.detach().clone()
    draft.load_state_dict(sd, strict=True)
    return draft.to(dtype=next(module.parameters()).dtype).eval()


def _load(spec):
    """A LoadedModel-like object (module, config, tokenizer, source) from a spec or itself."""
    if hasattr(spec, "module") and hasattr(spec, "config"):
        return spec
    from arborspec.models.registry import load_model

    return load_model(spec)


def _json_safe(obj):
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _save_bigram(module, path: Path, top_k: int = 32) -> dict[str, Any]:
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.drafts.bigram import bigram_table_from_target, save_bigram_table

    engine = TorchEngine(module)
    indices, logits = bigram_table_from_target(engine, top_k=top_k)
    vocab = module.config.vocab_size
    save_bigram_table(path, indices, logits, vocab)
    return {
        "kind": "bigram",
        "file": path.name,
        "vocab_size": vocab,
        "top_k": int(logits.shape[1]),
        "dense": indices is None,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def _prepare_out(out: Path, force: bool) -> PartialFolder:
    if out.exists():
        if not out.is_dir():
            raise InputError(f"{out} exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise InputError(f"{out} exists and is not empty (pass --force to replace it)")
    for stale in remove_stale_partials(out):
        log.warning("removed %s, a partial export left by a run that was killed", stale)
    return PartialFolder(out)


@dataclass
class ExportOptions:
    """The options of `arborspec export` (see export_folder)."""

    dtype: str = "fp32"
    opset: int = DEFAULT_OPSET
    max_context: int | None = None
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES
    tree_defaults: dict | None = None
    force: bool = False
    progress: bool = True
    verify: bool = True
    exporter: str = "auto"
    draft_model: Any = None
    draft_topk: int = DEFAULT_DRAFT_TOPK
    attention: str = "auto"
    quantize: str | None = None
    block_size: int = 32
    accuracy_level: int | None = None
    qformat: str = "matmulnbits"
    kv_dtype: str = "fp32"
    draft_quantize: str | None = None
    stream: str = "auto"  # "auto" | "on" | "off": read the checkpoint a tensor at a time (export/weights.py)

    def check(self, draft) -> None:
        """Every option on its own and together; one line for the first that is wrong."""
        if self.accuracy_level is None:  # int8 activations for int4 blocks: the fastest, and exact (row_layout.py)
            self.accuracy_level = 4 if self.quantize == "int4" and self.qformat == "matmulnbits" else 0
        for value, known, what in (
            (self.dtype, DTYPES, "dtype"),
            (self.attention, ATTENTIONS, "attention"),
            (self.qformat, QFORMATS, "--format"),
            (self.kv_dtype, KV_DTYPES, "--kv-dtype"),
            (self.stream, STREAMS, "--stream"),
        ):
            if value not in known:
                raise InputError(f"unknown {what} {value!r} (expected one of {', '.join(known)})")
        self._check_kv_dtype()
        self._check_draft_quantize(draft)
        if self.qformat == "qdq":
            if not self.quantize:
                raise InputError("--format qdq describes quantised weights: give --quantize int4|int8 too")
            if self.attention == "gqa":
                raise InputError(
                    "--format qdq is the portable form for TensorRT: use it with --attention onnx "
                    "(ONNX Runtime's GroupQueryAttention graph takes --format matmulnbits)"
                )
            self.attention = "onnx"

    def _check_kv_dtype(self) -> None:
        if self.kv_dtype == "fp32":
            return
        if self.dtype != "fp32":
            raise InputError(
                f"--kv-dtype {self.kv_dtype} is for fp32 weights (--dtype {self.dtype} keeps the cache in {self.dtype} already)"
            )
        if self.attention == "onnx" or self.qformat == "qdq":
            raise InputError(
                f"--kv-dtype {self.kv_dtype} needs ONNX Runtime's graph (--attention gqa), "
                "not the portable graph (--attention onnx or --format qdq)"
            )

    def _check_draft_quantize(self, draft) -> None:
        if self.draft_quantize is None:
            return
        from .eagle3_graph import check_head_quantize

        if not (isinstance(draft, str) and draft.strip().lower().split(":", 1)[0] == "eagle3"):
            raise InputError("--draft-quantize quantises an EAGLE-3 head: use it with --draft eagle3[:FOLDER]")
        check_head_quantize(self.draft_quantize, portable=self.attention == "onnx" or self.qformat == "qdq")


STREAMS = ("auto", "on", "off")


@dataclass
class Source:
    """The target as the export reads it: a loaded module, or a streamed weights source."""

    config: Any
    tokenizer: Any
    source: dict
    module: Any = None  # torch.nn.Module (the in-memory path)
    weights: Any = None  # export/weights.py (the streamed path)
    name: str | None = None

    def embed(self) -> torch.Tensor:
        if self.module is not None:
            return self.module.model.embed_tokens.weight.detach().float()
        return torch.from_numpy(self.weights.get("model.embed_tokens.weight"))


def export_folder(model, out: str | os.PathLike, draft: str | None = "layers:2", **options) -> ExportSummary:
    """Export target (+ draft, tokenizer, manifest) into the folder `out`, atomically.

    Options (ExportOptions): attention "gqa" (ONNX Runtime's fast graph: GroupQueryAttention reading
    and writing the cache in place, kv layout "bhsd"; Llama family, fp32 or fp16), "onnx" (the
    portable graph from torch.onnx.export that TensorRT builds, kv layout "sbhd"), or "auto" (gqa
    where it applies). quantize (None, "int4", "int8") with qformat "matmulnbits" (ONNX Runtime's
    MatMulNBits, on the gqa graph) or "qdq" (standard blockwise DequantizeLinear + MatMul on the
    portable graph, which TensorRT parses; export/qdq.py). kv_dtype: "fp32" (default) or "fp16",
    the KV cache's dtype in the gqa graphs of an fp32 export. accuracy_level: MatMulNBits compute,
    default 4 (int8 activations) for int4 MatMulNBits, else 0 (float): exact under speculation on
    ONNX Runtime through its row-invariant layout (docs/int4.md). stream: "on" reads a HF folder or
    GGUF a tensor at a time (peak memory: a few layers, docs/models.md), "off" loads the model
    whole, "auto" streams models over 2 GB in fp32 where the graph and the draft allow it.

    model: a spec for load_model (registry name, HF folder, .gguf, nanoGPT .pt) or an
    already loaded object with .module/.config/.tokenizer/.source. draft_model: an already
    loaded draft for a model-spec draft (tests); otherwise the draft spec is loaded."""
    from tqdm.auto import tqdm

    opts = ExportOptions(**options)
    opts.check(draft)
    ds = parse_draft_spec(draft)
    if ds.kind in ("export", "lookup", "suffix") or ds.mix:
        raise InputError(
            f"--draft {draft}: a lookup draft is chosen when decoding, not exported: export with a model "
            "draft (or none) and decode with --draft lookup or --draft export+lookup"
        )
    out = Path(out)
    stages = ["load model", "build draft", "tokenizer", "export target", "export draft", "manifest"]
    bar = tqdm(total=len(stages), desc="export", unit="stage", disable=None if opts.progress else True, leave=False)
    part = _prepare_out(out, opts.force)
    try:
        man = _export_stages(model, draft, ds, opts, part.path, bar)
        files = sorted(p.name for p in part.path.iterdir())
        part.publish()
    except ArborspecError:  # its own one-line message (a MissingFileError is an OSError too)
        part.discard()
        raise
    except OSError as e:  # a full disk, a file-size limit: one line, nothing half-written left
        part.discard()
        raise OutputError(describe_os_error(e, out) + " (nothing was written)") from e
    except BaseException:
        part.discard()
        raise
    finally:
        bar.close()
    return ExportSummary(out=out, manifest=man, files=files)


def _export_stages(model, draft, ds, opts: ExportOptions, tmp: Path, bar) -> dict:
    """The export's stages in order, into the temporary folder `tmp`; returns the manifest."""

    def done(next_stage: str | None):
        bar.update(1)
        if next_stage:
            bar.set_description(f"export: {next_stage}")

    bar.set_description("export: load model")
    src = load_source(model, ds.kind, opts)
    max_context = _check_limits(src.config, opts)
    done("build draft")
    draft_module, draft_entry, eagle3_head = build_draft(src, ds, opts, model, tmp)
    done("tokenizer")
    tok_entry, tok_sha = write_tokenizer(src, tmp)
    done("export target")
    use_gqa = _use_gqa(src.config, opts, eagle3_head, src.weights is not None)
    graphs = _GraphExporter(src, opts, use_gqa, max_context, tok_sha, eagle3_head, ds.kind)
    target_entry = graph_entry(tmp, graphs.export(src.weights or src.module, tmp / TARGET_FILE, "target"), src.config.to_dict())
    done("export draft")
    if draft_module is not None:
        draft_entry = graphs.export_draft(draft_module, tmp, draft)
    elif eagle3_head is not None:
        draft_entry = graphs.export_head(tmp, draft)
    done("manifest")
    source = {"model": model if isinstance(model, (str, os.PathLike)) else src.name}
    source.update(_json_safe(src.source or {}))
    if ds.kind == "model":
        source["draft"] = _json_safe(getattr(opts.draft_model or {}, "source", {}) or {"model": ds.arg})
    man = build_manifest(
        target=target_entry, draft=draft_entry, max_context=max_context, max_tree_nodes=opts.max_tree_nodes,
        source=_json_safe(source), tokenizer=tok_entry, tree_defaults=opts.tree_defaults,
    )  # fmt: skip
    write_manifest(tmp, man)
    from arborspec.runtime.export_dir import read_manifest

    read_manifest(tmp)  # the folder must read back before it is published
    done(None)
    return man


def load_source(model, draft_kind: str, opts: ExportOptions) -> Source:
    """The target: streamed where the options allow it (export/weights.py), else loaded whole."""
    weights = _streamed_weights(model, draft_kind, opts)
    if weights is not None:
        return _streamed_source(model, weights)
    cfg = _peek_config(model)
    if cfg is not None:  # before the model is loaded: one line where it cannot fit
        from .preflight import check_loaded_export

        check_loaded_export(cfg, opts.dtype, cfg.name or Path(str(model)).name)
    lm = _load(model)
    return Source(lm.config, lm.tokenizer, getattr(lm, "source", {}) or {}, module=lm.module.float().eval(),
                  name=getattr(lm, "name", None))  # fmt: skip


def _streamed_weights(model, draft_kind: str, opts: ExportOptions):
    if opts.stream == "off":
        return None
    why = None
    if opts.attention == "onnx" and opts.exporter != "auto":
        why = f"--exporter {opts.exporter} traces the loaded module"
    elif draft_kind not in ("none", "eagle3"):
        why = f"--draft {draft_kind} is built from the loaded target"
    weights = None if why else _open_weights(model, portable=opts.attention == "onnx")
    if weights is None and why is None:
        why = "only Llama-family Hugging Face folders and GGUF files stream"
    if weights is not None and opts.stream == "auto":
        from .gqa_export import FULL_CHECK_BYTES, fp32_bytes

        if fp32_bytes(weights.config) <= FULL_CHECK_BYTES:
            return None  # a small model: loaded whole, checked whole
    if weights is None and opts.stream == "on":
        raise InputError(f"--stream on: {why} (use --stream auto or off)")
    return weights


def _peek_config(model):
    """The config of a model spec read without loading its weights (a Llama-family HF folder or
    GGUF, another family's HF folder), or None (a registry name, a loaded object, nanoGPT)."""
    if not isinstance(model, (str, Path)):
        return None
    from .weights import open_weights

    try:
        weights = open_weights(model)
        if weights is not None:
            return weights.config
        folder = Path(str(model)).expanduser()
        if (folder / "config.json").is_file():
            from arborspec.models.hf_loader import config_from_hf

            return config_from_hf(json.loads((folder / "config.json").read_text()), name=folder.name)
    except (ArborspecError, OSError, KeyError, ValueError):
        return None  # the loader says what is wrong, in its own words
    return None


def _open_weights(model, portable: bool = False):
    """A streaming source for the model where its graph can be written a layer at a time (the
    portable graph: export/portable_graph.py; ONNX Runtime's: export/gqa_graph.py), else None."""
    from .gqa_graph import gqa_unsupported
    from .portable_graph import portable_unsupported
    from .weights import open_weights

    weights = open_weights(model)
    unsupported = portable_unsupported if portable else gqa_unsupported
    if weights is not None and unsupported(weights.config) is not None:
        return None
    return weights


def _streamed_source(model, weights) -> Source:
    from arborspec.models.registry import files_source, hf_folder_tokenizer

    cfg = weights.config
    if hasattr(weights, "folder"):
        tok = hf_folder_tokenizer(weights.folder, cfg)
        return Source(cfg, tok, files_source("hf", weights.folder, weights.files), weights=weights)
    from arborspec.models.tokenizer_build import text_tokenizer_from_gguf_meta

    meta = weights.meta
    tok = text_tokenizer_from_gguf_meta(meta) if meta.get("tokenizer.ggml.model") == "gpt2" else None
    source = files_source("gguf", weights.path, [weights.path])
    if str(model) == "smollm2-135m":
        source["name"] = "smollm2-135m"
    return Source(cfg, tok, source, weights=weights)


def _check_limits(cfg, opts: ExportOptions) -> int:
    max_context = int(opts.max_context or cfg.max_position)
    if max_context < 1 or opts.max_tree_nodes < 1:
        raise InputError("--max-context and --max-tree-nodes must be >= 1")
    if cfg.family == "gpt2" and max_context > cfg.max_position:
        raise InputError(f"--max-context {max_context} exceeds the model's {cfg.max_position} learned positions")
    if opts.max_tree_nodes + 1 > max_context:
        raise InputError(f"--max-tree-nodes {opts.max_tree_nodes} does not fit in --max-context {max_context}")
    return max_context


def build_draft(src: Source, ds, opts: ExportOptions, model, tmp: Path):
    """(draft module, draft manifest entry, EAGLE-3 head): what the draft spec asks for."""
    kind, arg = ds.kind, ds.arg
    if kind == "layers":
        return truncated_draft(src.module, arg), None, None
    if kind == "model":
        dl = opts.draft_model if opts.draft_model is not None else _load(arg)
        if dl.config.vocab_size != src.config.vocab_size:
            raise InputError(
                f"draft vocabulary {dl.config.vocab_size} != target vocabulary "
                f"{src.config.vocab_size}: the draft must share the target's tokenizer"
            )
        return dl.module.float().eval(), None, None
    if kind == "bigram":
        entry = _save_bigram(src.module, tmp / BIGRAM_FILE)
        entry["spec"] = "bigram"
        return None, entry, None
    if kind == "eagle3":
        from arborspec.models.eagle3 import eagle3_config, eagle3_folder

        folder = eagle3_folder(arg, model if isinstance(model, str) else None)
        return None, None, HeadPlan(folder, eagle3_config(folder, src.config), src.config)
    return None, None, None


@dataclass
class HeadPlan:
    """An EAGLE-3 head checked against the target; its weights are read only when the head is
    exported (after the target: a large target's export never holds both)."""

    folder: Path
    config: Any
    target_config: Any

    def load(self):
        from arborspec.models.eagle3 import load_eagle3

        return load_eagle3(self.folder, self.target_config)


def write_tokenizer(src: Source, tmp: Path):
    """The tokenizer files into the export; (manifest entry, sha256 of tokenizer.json)."""
    if src.tokenizer is None:
        return None, None
    src.tokenizer.save(tmp)
    files = sorted(p.name for p in tmp.iterdir() if p.name.startswith("tokenizer"))
    tok_sha = sha256_file(tmp / "tokenizer.json") if (tmp / "tokenizer.json").is_file() else None
    tv = getattr(src.tokenizer, "vocab_size", None)
    if isinstance(tv, int) and tv > src.config.vocab_size:
        log.warning("tokenizer has %d ids but the model only %d embeddings", tv, src.config.vocab_size)
    return {"files": files, "sha256": tok_sha}, tok_sha


def _use_gqa(cfg, opts: ExportOptions, eagle3_head, streamed: bool) -> bool:
    """Whether the target (and a model draft) take ONNX Runtime's graph; one line where the
    options ask for what the model cannot have. `auto` gives an fp16 export the portable graph
    unless it streams (the fp16 GroupQueryAttention graph is asked for with --attention gqa)."""
    from .gqa_graph import gqa_unsupported

    why_not = gqa_unsupported(cfg, opts.dtype)
    auto_ok = why_not is None and (opts.dtype == "fp32" or streamed)
    use_gqa = opts.attention == "gqa" or (opts.attention == "auto" and auto_ok)
    if opts.attention == "gqa" and why_not:
        raise InputError(f"--attention gqa: {why_not} (use --attention onnx)")
    if opts.kv_dtype != "fp32" and not use_gqa:
        raise InputError(f"--kv-dtype {opts.kv_dtype} needs ONNX Runtime's graph (--attention gqa): {why_not}")
    if eagle3_head is not None and opts.dtype != "fp32":
        raise InputError(f"--draft eagle3 exports fp32 graphs (the head and the target's features), not --dtype {opts.dtype}")
    if opts.quantize and opts.qformat == "matmulnbits" and not use_gqa:
        raise InputError(
            "--quantize --format matmulnbits needs ONNX Runtime's graph (--attention gqa): "
            + (why_not or "--attention onnx was asked for")
            + "; --format qdq quantises the portable graph"
        )
    return use_gqa


@dataclass
class _GraphExporter:
    """Exports the target, a model draft or an EAGLE-3 head with the export's options."""

    src: Source
    opts: ExportOptions
    use_gqa: bool
    max_context: int
    tok_sha: str | None
    eagle3_head: Any
    draft_kind: str

    def export(self, m, path: Path, role: str, topk: int = 0):
        o = self.opts
        src = self.src.source or {}
        gguf_path = src.get("path") if src.get("kind") == "gguf" and (self.draft_kind != "model" or role == "target") else None
        features = self.eagle3_head.config.aux_layers if self.eagle3_head is not None and role == "target" else None
        common = dict(
            dtype=o.dtype, tokenizer_sha256=self.tok_sha, role=role, max_context=self.max_context, verify=o.verify,
            topk=topk, quantize=o.quantize, block_size=o.block_size, gguf_path=gguf_path, feature_layers=features,
        )  # fmt: skip
        if not self.use_gqa and hasattr(m, "release"):  # a streamed source: the portable graph a layer at a time
            from .gqa_export import GQAExport
            from .portable_export import export_portable

            spec = GQAExport(
                dtype=o.dtype, topk=topk, feature_layers=features, max_context=self.max_context, verify=o.verify,
                tokenizer_sha256=self.tok_sha, role=role, progress=bool(o.progress and role == "target"),
                quantize=o.quantize, block_size=o.block_size,
            )  # fmt: skip
            return export_portable(m, path, spec)
        if self.use_gqa:
            return export_gqa_onnx(
                m, path, **common, accuracy_level=o.accuracy_level, kv_dtype=o.kv_dtype,
                progress=bool(o.progress and role == "target"),
            )  # fmt: skip
        return export_contract_onnx(m, path, opset=o.opset, exporter=o.exporter, **common)

    def export_draft(self, draft_module, tmp: Path, draft: str) -> dict:
        from .gqa_graph import gqa_unsupported

        cfg = draft_module.config
        if self.use_gqa and gqa_unsupported(cfg, self.opts.dtype):
            raise InputError(f"--attention gqa: the draft: {gqa_unsupported(cfg, self.opts.dtype)} (use --attention onnx)")
        res = self.export(draft_module, tmp / DRAFT_FILE, "draft", self.opts.draft_topk)
        entry = graph_entry(tmp, res, cfg.to_dict(), spec=draft)
        if self.opts.draft_topk:
            entry["topk"] = min(int(self.opts.draft_topk), cfg.vocab_size)
        return entry

    def export_head(self, tmp: Path, draft: str) -> dict:
        from .eagle3_graph import export_eagle3_head

        o = self.opts
        # the head's graph follows the target's: GroupQueryAttention ("bhsd", ONNX Runtime)
        # or the portable one ("sbhd", standard ONNX: what `arborspec build` turns into engines)
        entry = export_eagle3_head(
            self.eagle3_head.load(), self.src.embed(), tmp, self.max_context, tokenizer_sha256=self.tok_sha,
            verify=o.verify, portable=not self.use_gqa, quantize=o.draft_quantize, block_size=o.block_size,
        )  # fmt: skip
        entry["spec"] = draft
        if (tmp / (entry["file"] + ".data")).is_file():  # a large head's weights (export/eagle3_graph.save_head_model)
            entry["external_data"] = [entry["file"] + ".data"]
        for key, name in (("", entry["file"]), ("fc_", entry["fc_file"])):
            entry[f"{key}bytes"] = (tmp / name).stat().st_size
            entry[f"{key}sha256"] = sha256_file(tmp / name)
        return entry
