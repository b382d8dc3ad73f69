"""manifest.json of an export folder: the writer side (the reader lives in the runtime).

Role in one decoding step: none directly. The manifest tells the runtime, before the first
step, which graphs to open (target, draft or bigram table), their dtypes and I/O, the limits
that size the KV caches and trees (max_context, max_tree_nodes), the tree defaults, and which
tokenizer the ids belong to. The schema and the reader live in arborspec.runtime.contract
(the one place the contract is written); `read_manifest` is re-exported here.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

from arborspec.runtime.contract import (  # noqa: F401
    CONTRACT_VERSION,
    FORMAT,
    MANIFEST_NAME,
    Manifest,
    read_manifest,
)
from arborspec.runtime.decoder_config import DEFAULT_TREE as DECODER_DEFAULT_TREE
from arborspec.runtime.errors import ExportDirError, InputError  # noqa: F401
from arborspec.runtime.fileio import atomic_write_json, sha256_file

DEFAULT_TREE = {"mode": "tree", "tree": DECODER_DEFAULT_TREE}  # the manifest's tree_defaults


def graph_io(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Inputs and outputs of an ONNX graph as [{"name", "dtype", "shape"}]; symbolic dims are
    strings, fixed dims ints."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def desc(v):
        tt = v.type.tensor_type
        dims = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tt.shape.dim]
        return {"name": v.name, "dtype": onnx.TensorProto.DataType.Name(tt.elem_type).lower(), "shape": dims}

    return [desc(v) for v in model.graph.input], [desc(v) for v in model.graph.output]


def graph_entry(
    root: Path, result, config: dict[str, Any], spec: str | None = None, checksum: bool = True
) -> dict[str, Any]:
    """Manifest entry for one exported graph (an onnx_export.ExportResult inside root)."""
    path = Path(result.path)
    inputs, outputs = graph_io(path)
    e = {
        "kind": "onnx",
        "file": path.name,
        "config": config,
        "dtype": result.dtype,
        "kv_dtype": getattr(result, "kv_dtype", None) or result.dtype,  # the cache's (--kv-dtype)
        "opset": result.opset,
        "exporter": result.exporter,
        "ir_version": result.ir_version,
        "nodes": result.n_nodes,
        "external_data": list(result.external_data),
        "bytes": path.stat().st_size,
        "inputs": inputs,
        "outputs": outputs,
    }
    if result.fallback_reason:
        e["fallback_reason"] = result.fallback_reason
    if getattr(result, "quantization", None):
        e["quantization"] = result.quantization
    if result.max_abs_diff is not None:
        e["self_check_max_abs_diff"] = result.max_abs_diff
    if checksum:
        e["sha256"] = sha256_file(path)
    if spec is not None:
        e["spec"] = spec
    return e


def build_manifest(
    *,
    target: dict[str, Any],
    draft: dict[str, Any] | None,
    max_context: int,
    max_tree_nodes: int,
    source: dict[str, Any] | None = None,
    tokenizer: dict[str, Any] | None = None,
    tree_defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import arborspec

    if max_context < 1 or max_tree_nodes < 1:
        raise InputError("max_context and max_tree_nodes must be >= 1")
    return {
        "format": FORMAT,
        "contract_version": CONTRACT_VERSION,
        "arborspec_version": arborspec.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "target": target,
        "draft": draft or {"kind": "none"},
        "limits": {"max_context": int(max_context), "max_tree_nodes": int(max_tree_nodes)},
        "tree_defaults": dict(tree_defaults or DEFAULT_TREE),
        "source": source or {},
        "tokenizer": tokenizer,
    }


def write_manifest(dir: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    return atomic_write_json(Path(dir) / MANIFEST_NAME, manifest)


__all__ = [
    "graph_io",
    "graph_entry",
    "build_manifest",
    "write_manifest",
    "read_manifest",
    "Manifest",
    "ExportDirError",
    "MANIFEST_NAME",
    "FORMAT",
    "DEFAULT_TREE",
]
