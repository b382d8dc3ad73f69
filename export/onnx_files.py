"""What every exported ONNX file gets: the contract's metadata, a clamped IR version, ONNX's
checker, and the result record the export folder's manifest is made from.

Role in one decode step: none at run time; the runtime reads these metadata_props to know what a
graph is (runtime/contract.py names them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from arborspec.runtime.contract import (
    CONTRACT_VERSION,
    META_CONFIG,
    META_CONTRACT,
    META_DTYPE,
    META_EXPORTER,
    META_KV_DTYPE,
    META_KV_LAYOUT,
    META_ROLE,
    META_TOKENIZER,
    META_TOPK,
    META_VERSION,
)

MAX_IR_VERSION = 13  # onnxruntime 1.31 loads IR <= 13 (onnx 1.23 may write 14)


@dataclass
class ExportResult:
    path: Path
    opset: int
    exporter: str  # "dynamo" or "legacy"
    dtype: str
    ir_version: int
    n_nodes: int
    external_data: list[str] = field(default_factory=list)  # file names beside path
    fallback_reason: str | None = None
    max_abs_diff: float | None = None  # self-check vs PyTorch (None: not run)
    quantization: dict | None = None  # weight-only quantisation scheme (None: float weights)
    kv_dtype: str | None = None  # the cache's dtype when it differs from `dtype` (--kv-dtype fp16)


def finalize(path: Path, metadata: dict[str, str], big: bool) -> tuple[int, int]:
    """Write metadata_props, clamp the IR version, run the full checker. Returns (ir, nodes)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    del model.metadata_props[:]
    for k, v in metadata.items():
        e = model.metadata_props.add()
        e.key, e.value = k, v
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION
    onnx.save(model, str(path))  # external data references are kept as they are
    onnx.checker.check_model(str(path), full_check=True)
    return model.ir_version, len(model.graph.node)


def contract_metadata(
    cfg,
    dtype: str,
    tokenizer_sha256: str | None,
    role: str,
    exporter: str,
    kv_layout: str,
    topk: int = 0,
    kv_dtype: str | None = None,
) -> dict[str, str]:
    """The metadata_props every exported graph carries (runtime/contract.py names them);
    kv_dtype: the cache's dtype (default: the graph's dtype)."""
    import arborspec

    meta = {
        META_CONTRACT: str(CONTRACT_VERSION),
        META_CONFIG: cfg.to_json(),
        META_DTYPE: dtype,
        META_TOKENIZER: tokenizer_sha256 or "",
        META_ROLE: role,
        META_EXPORTER: exporter,
        META_VERSION: arborspec.__version__,
        META_KV_LAYOUT: kv_layout,
        META_KV_DTYPE: kv_dtype or dtype,
    }
    if topk > 0:
        meta[META_TOPK] = str(topk)
    return meta
