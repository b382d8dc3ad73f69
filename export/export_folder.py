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


def export_folder(
    model,
    out: str | os.PathLike,
    draft: str | None = "layers:2",
    *,
    dtype: str = "fp32",
    opset: int = DEFAULT_OPSET,
    max_context: int | None = None,
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES,
    tree_defaults: dict | None = None,
    force: bool = False,
    progress: bool = True,
    verify: bool = True,
    exporter: str = "auto",
    draft_model=None,
    draft_topk: int = DEFAULT_DRAFT_TOPK,
    attention: str = "auto",
    quantize: str | None = None,
    block_size: int = 32,
    accuracy_level: int | None = None,
    qformat: str = "matmulnbits",
    kv_dtype: str = "fp32",
    draft_quantize: str | None = None,
) -> ExportSummary:
    """Export target (+ draft, tokenizer, manifest) into the folder `out`, atomically.

    attention: "gqa" (ONNX Runtime's fast graph: GroupQueryAttention reading and writing the
    cache in place, kv layout "bhsd"; Llama family, fp32), "onnx" (the portable graph from
    torch.onnx.export that TensorRT builds, kv layout "sbhd"), or "auto" (gqa where it applies).
    quantize (None, "int4", "int8") with qformat "matmulnbits" (ONNX Runtime's MatMulNBits, on
    the gqa graph) or "qdq" (standard blockwise DequantizeLinear + MatMul on the portable graph,
    which TensorRT parses; export/qdq.py). kv_dtype: "fp32" (default) or "fp16", the KV cache's
    dtype in the gqa graphs of target and draft (fp32 weights and activations; fp16 needs the gqa
    graph and fp32 weights: `--dtype fp16` keeps its cache in fp16 already). accuracy_level:
    MatMulNBits compute, default 4 (int8 activations) for int4 MatMulNBits, else 0 (float):
    exact under speculation on ONNX Runtime through its row-invariant layout (docs/int4.md).

    model: a spec for load_model (registry name, HF folder, .gguf, nanoGPT .pt) or an
    already loaded object with .module/.config/.tokenizer/.source. draft_model: an already
    loaded draft for a model-spec draft (tests); otherwise the draft spec is loaded."""
    from tqdm.auto import tqdm

    if accuracy_level is None:  # int8 activations for int4 blocks: the fastest, and exact (row_layout.py)
        accuracy_level = 4 if quantize == "int4" and qformat == "matmulnbits" else 0
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    if attention not in ATTENTIONS:
        raise InputError(f"unknown attention {attention!r} (expected one of {', '.join(ATTENTIONS)})")
    if qformat not in QFORMATS:
        raise InputError(f"unknown --format {qformat!r} (expected one of {', '.join(QFORMATS)})")
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"unknown --kv-dtype {kv_dtype!r} (expected one of {', '.join(KV_DTYPES)})")
    if kv_dtype != "fp32":
        if dtype != "fp32":
            raise InputError(
                f"--kv-dtype {kv_dtype} is for fp32 weights (--dtype {dtype} keeps the cache in {dtype} already)"
            )
        if attention == "onnx" or qformat == "qdq":
            raise InputError(
                f"--kv-dtype {kv_dtype} needs ONNX Runtime's graph (--attention gqa), "
                "not the portable graph (--attention onnx or --format qdq)"
            )
    if draft_quantize is not None:
        from .eagle3_graph import check_head_quantize

        if not (isinstance(draft, str) and draft.strip().lower().split(":", 1)[0] == "eagle3"):
            raise InputError("--draft-quantize quantises an EAGLE-3 head: use it with --draft eagle3[:FOLDER]")
        check_head_quantize(draft_quantize, portable=attention == "onnx" or qformat == "qdq")
    if qformat == "qdq":
        if not quantize:
            raise InputError("--format qdq describes quantised weights: give --quantize int4|int8 too")
        if attention == "gqa":
            raise InputError(
                "--format qdq is the portable form for TensorRT: use it with --attention onnx "
                "(ONNX Runtime's GroupQueryAttention graph takes --format matmulnbits)"
            )
        attention = "onnx"
    ds = parse_draft_spec(draft)
    if ds.kind in ("export", "lookup") or ds.mix:
        raise InputError(
            f"--draft {draft}: a lookup draft is chosen when decoding, not exported: export with a model "
            "draft (or none) and decode with --draft lookup or --draft export+lookup"
        )
    kind, arg = ds.kind, ds.arg
    out = Path(out)
    stages = ["load model", "build draft", "tokenizer", "export target", "export draft", "manifest"]
    bar = tqdm(total=len(stages), desc="export", unit="stage", disable=None if progress else True, leave=False)

    def stage(name):
        bar.set_description(f"export: {name}")

    part = _prepare_out(out, force)
    tmp = part.path
    try:
        stage("load model")
        lm = _load(model)
        module, cfg = lm.module.float().eval(), lm.config
        max_context = int(max_context or cfg.max_position)
        if max_context < 1 or max_tree_nodes < 1:
            raise InputError("--max-context and --max-tree-nodes must be >= 1")
        if cfg.family == "gpt2" and max_context > cfg.max_position:
            raise InputError(f"--max-context {max_context} exceeds the model's {cfg.max_position} learned positions")
        if max_tree_nodes + 1 > max_context:
            raise InputError(f"--max-tree-nodes {max_tree_nodes} does not fit in --max-context {max_context}")
        bar.update(1)

        stage("build draft")
        draft_module, draft_entry, eagle3_head = None, None, None
        if kind == "layers":
            draft_module = truncated_draft(module, arg)
        elif kind == "model":
            dl = draft_model if draft_model is not None else _load(arg)
            if dl.config.vocab_size != cfg.vocab_size:
                raise InputError(
                    f"draft vocabulary {dl.config.vocab_size} != target vocabulary "
                    f"{cfg.vocab_size}: the draft must share the target's tokenizer"
                )
            draft_module = dl.module.float().eval()
        elif kind == "bigram":
            draft_entry = _save_bigram(module, tmp / BIGRAM_FILE)
            draft_entry["spec"] = "bigram"
        elif kind == "eagle3":
            from arborspec.models.eagle3 import eagle3_folder, load_eagle3

            eagle3_head = load_eagle3(eagle3_folder(arg, model if isinstance(model, str) else None), cfg)
        bar.update(1)

        stage("tokenizer")
        tok_entry, tok_sha = None, None
        if lm.tokenizer is not None:
            lm.tokenizer.save(tmp)
            files = sorted(p.name for p in tmp.iterdir() if p.name.startswith("tokenizer"))
            if (tmp / "tokenizer.json").is_file():
                tok_sha = sha256_file(tmp / "tokenizer.json")
            tok_entry = {"files": files, "sha256": tok_sha}
            tv = getattr(lm.tokenizer, "vocab_size", None)
            if isinstance(tv, int) and tv > cfg.vocab_size:
                log.warning("tokenizer has %d ids but the model only %d embeddings", tv, cfg.vocab_size)
        bar.update(1)

        stage("export target")
        from .gqa_graph import gqa_unsupported

        why_not = gqa_unsupported(cfg, dtype)
        use_gqa = attention == "gqa" or (attention == "auto" and why_not is None)
        if attention == "gqa" and why_not:
            raise InputError(f"--attention gqa: {why_not} (use --attention onnx)")
        if kv_dtype != "fp32" and not use_gqa:
            raise InputError(f"--kv-dtype {kv_dtype} needs ONNX Runtime's graph (--attention gqa): {why_not}")

        if eagle3_head is not None and not use_gqa and dtype != "fp32":
            raise InputError(
                f"--draft eagle3 exports fp32 graphs (the head and the target's features), not --dtype {dtype}"
            )
        if quantize and qformat == "matmulnbits" and not use_gqa:
            raise InputError(
                "--quantize --format matmulnbits needs ONNX Runtime's graph (--attention gqa): "
                + (why_not or "--attention onnx was asked for")
                + "; --format qdq quantises the portable graph"
            )
        src = getattr(lm, "source", {}) or {}
        gguf_path = src.get("path") if src.get("kind") == "gguf" else None

        def export_graph(m, path, role, topk=0):
            if use_gqa:
                return export_gqa_onnx(
                    m,
                    path,
                    dtype,
                    tokenizer_sha256=tok_sha,
                    role=role,
                    max_context=max_context,
                    verify=verify,
                    topk=topk,
                    quantize=quantize,
                    block_size=block_size,
                    accuracy_level=accuracy_level,
                    gguf_path=gguf_path if kind != "model" or role == "target" else None,
                    feature_layers=eagle3_head.config.aux_layers
                    if eagle3_head is not None and role == "target"
                    else None,
                    kv_dtype=kv_dtype,
                )
            return export_contract_onnx(
                m,
                path,
                opset=opset,
                dtype=dtype,
                tokenizer_sha256=tok_sha,
                role=role,
                max_context=max_context,
                exporter=exporter,
                verify=verify,
                topk=topk,
                quantize=quantize,
                block_size=block_size,
                gguf_path=gguf_path if kind != "model" or role == "target" else None,
                feature_layers=eagle3_head.config.aux_layers if eagle3_head is not None and role == "target" else None,
            )

        res_t = export_graph(module, tmp / TARGET_FILE, "target")
        target_entry = graph_entry(tmp, res_t, cfg.to_dict())
        bar.update(1)

        stage("export draft")
        if draft_module is not None:
            if use_gqa and gqa_unsupported(draft_module.config, dtype):
                raise InputError(
                    f"--attention gqa: the draft: {gqa_unsupported(draft_module.config, dtype)} (use --attention onnx)"
                )
            res_d = export_graph(draft_module, tmp / DRAFT_FILE, "draft", draft_topk)
            draft_entry = graph_entry(tmp, res_d, draft_module.config.to_dict(), spec=draft)
            if draft_topk:
                draft_entry["topk"] = min(int(draft_topk), draft_module.config.vocab_size)
        elif eagle3_head is not None:
            from .eagle3_graph import export_eagle3_head

            embed = module.model.embed_tokens.weight.detach().float()
            # the head's graph follows the target's: GroupQueryAttention ("bhsd", ONNX Runtime)
            # or the portable one ("sbhd", standard ONNX: what `arborspec build` turns into engines)
            draft_entry = export_eagle3_head(
                eagle3_head,
                embed,
                tmp,
                max_context,
                tokenizer_sha256=tok_sha,
                verify=verify,
                portable=not use_gqa,
                quantize=draft_quantize,
                block_size=block_size,
            )
            draft_entry["spec"] = draft
            for key, name in (("", draft_entry["file"]), ("fc_", draft_entry["fc_file"])):
                draft_entry[f"{key}bytes"] = (tmp / name).stat().st_size
                draft_entry[f"{key}sha256"] = sha256_file(tmp / name)
        bar.update(1)

        stage("manifest")
        source = {"model": model if isinstance(model, (str, os.PathLike)) else getattr(lm, "name", None)}
        source.update(_json_safe(getattr(lm, "source", {}) or {}))
        if kind == "model":
            source["draft"] = _json_safe(getattr(draft_model or {}, "source", {}) or {"model": arg})
        man = build_manifest(
            target=target_entry,
            draft=draft_entry,
            max_context=max_context,
            max_tree_nodes=max_tree_nodes,
            source=_json_safe(source),
            tokenizer=tok_entry,
            tree_defaults=tree_defaults,
        )
        write_manifest(tmp, man)
        from arborspec.runtime.export_dir import read_manifest

        read_manifest(tmp)  # the folder must read back before it is published
        bar.update(1)
        files = sorted(p.name for p in tmp.iterdir())
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
