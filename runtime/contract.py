"""The engine contract, written once: I/O names, ONNX metadata keys, the version and its check,
dtype tables, and the schemas and readers of the two folder manifests.

Role in one decode step: every model call of a step (draft levels, the target's verify,
prefills) binds tensors by the names below, and before the first step the opener checks the
version and the manifest. The exporter (arborspec.export), every backend, `compare` and the
tests import these names from here; nothing else spells them.

Graph I/O (version 1), one graph per model, target and draft alike (a draft graph may add
`topk_logprobs` float32 [B, T, K] and `topk_ids` int64 [B, T, K], see TOPK_OUTPUTS):

    input_ids        int64 [B, T]        the T new tokens (prompt, chain, or flattened tree)
    position_ids     int64 [B, T]        past_len + depth in the tree
    attention_mask   bool  [B, T, P+T]   True = may attend; columns 0..P-1 are the cache
    past_key.{i}     dtype [P, B, Hkv, D] layer i's committed cache (P may be 0)
    past_value.{i}   dtype [P, B, Hkv, D]
 -> logits           float32 [B, T, V]
    new_key.{i}      dtype [T, B, Hkv, D] only the new tokens' K/V
    new_value.{i}    dtype [T, B, Hkv, D]

Export folder: `manifest.json` (schema below, `Manifest`/`read_manifest`); TensorRT engines
folder: `engines.json` (`EnginesManifest`/`read_engines_manifest`).

manifest.json:

    {"format": "arborspec-export", "contract_version": 1, "arborspec_version": "0.1.0",
     "created": "2026-11-21T20:00:00Z",
     "target": {"kind": "onnx", "file": "target.onnx", "config": {ModelConfig}, "dtype": "fp32",
                "kv_dtype": "fp32" (the cache's: "fp16" with `export --kv-dtype fp16`),
                "opset": 23, "exporter": "dynamo", "ir_version": 10, "external_data": [],
                "sha256": "...", "bytes": 123, "inputs": [{"name", "dtype", "shape"}],
                "outputs": [...]},
     "draft": {"kind": "onnx", "spec": "layers:2", ...same keys as target...}
            | {"kind": "bigram", "spec": "bigram", "file": "draft_bigram.safetensors", ...}
            | {"kind": "eagle3", "spec": "eagle3[:PATH]", "file": "draft.onnx", "fc_file":
               "draft_fc.onnx", "aux_layers": [...], "draft_vocab_size": N, ...}
            | {"kind": "none"},
     "limits": {"max_context": 2048, "max_tree_nodes": 64},
     "tree_defaults": {"mode": "tree", "tree": DEFAULT_TREE},  (runtime/decoder_config.py's)
     "source": {"model": "smollm2-135m", "location": "...", "checksums": {"file": "sha256"}},
     "tokenizer": {"files": ["tokenizer.json", ...], "sha256": "..."} | null}

engines.json (beside the engines, written by `arborspec build`):

    {"format": 1, "engines": {"target": {"file": "target.engine", "onnx": "...",
     "onnx_sha256": "...", "compute_capability": "8.9", "trt": {"module", "version"},
     "profiles": [...], "io": {...}, "limits": {...}, "onnx_metadata": {...},
     "cache": {"file": ...}, "bytes": ...}, "draft": {...}}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ExportDirError, MissingFileError
from .fileio import sha256_file
from .onnx_meta import read_onnx_metadata

CONTRACT_VERSION = 2  # written by this arborspec
SUPPORTED_VERSIONS = (1, 2)  # read by this arborspec (version 1: kv layout "sbhd" only)

# Cache layouts (metadata `arborspec.kv_layout`; version 1 graphs are "sbhd"):
#   "sbhd": past_key.{i} is the committed prefix [P, B, Hkv, D] of a [S_max, B, Hkv, D] slab and
#           new_key.{i} only the new tokens [T, B, Hkv, D] (portable: torch.onnx export, TensorRT)
#   "bhsd": past_key.{i} is the layer's whole slab [B, Hkv, S_max, D] and new_key.{i} is bound
#           to the same buffer: the graph writes the new tokens at [P, P+T) in place (ONNX
#           Runtime GroupQueryAttention with a shared past/present buffer, export/gqa_graph.py)
KV_LAYOUTS = ("sbhd", "bhsd")

# ----------------------------------------------------------------------------- graph I/O
INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"
FIXED_INPUTS = (INPUT_IDS, POSITION_IDS, ATTENTION_MASK)


def past_key(i: int) -> str:
    return f"past_key.{i}"


def past_value(i: int) -> str:
    return f"past_value.{i}"


def new_key(i: int) -> str:
    return f"new_key.{i}"


def new_value(i: int) -> str:
    return f"new_value.{i}"


def input_names(n_layers: int) -> list[str]:
    names = list(FIXED_INPUTS)
    for i in range(n_layers):
        names += [past_key(i), past_value(i)]
    return names


def output_names(n_layers: int) -> list[str]:
    names = [LOGITS]
    for i in range(n_layers):
        names += [new_key(i), new_value(i)]
    return names


# Optional draft outputs (metadata `arborspec.topk` = K): the graph's own top-K per row, so the
# host never reads a vocabulary-wide row. Log-probs (logits minus the row's log-normaliser),
# sorted descending, and their vocabulary ids.
TOPK_LOGPROBS = "topk_logprobs"  # float32 [B, T, K]
TOPK_IDS = "topk_ids"  # int64 [B, T, K]
TOPK_OUTPUTS = (TOPK_LOGPROBS, TOPK_IDS)

# Target features (version 2, optional; metadata `arborspec.feature_layers` = JSON list of layer
# ids): one more output after the K/V outputs, the hidden states ENTERING those layers at every
# row, concatenated [B, T, len * H] float32. An EAGLE-3 draft reads them (EAGLE-3: layers 2,
# L//2, L-3). The verify call that accepts a path returns the features of that path's rows.
HIDDEN_STATES = "hidden_states"
# EAGLE-3 draft graphs (metadata `arborspec.role` = "eagle3"): one more input after the K/V
# inputs, the hidden state each row pairs with its token [B, T, H] float32 (the target's
# features already projected by the head's `fc`, or the draft's own output of the row's
# parent), and one more output after the K/V outputs, the layer's output hidden state
# `hidden_states` [B, T, H]; `logits` are over the draft vocabulary, and the draft-to-target
# id map travels in the metadata (`arborspec.d2t`: base64 of int64 offsets, target id = draft id
# + d2t[draft id]). A second graph `<draft>_fc.onnx` holds the projection:
# `target_features` [N, F] -> `hidden_states` [N, H].
HIDDEN_IN = "hidden_in"
TARGET_FEATURES = "target_features"


def count_layers(names) -> int:
    """Number of layers of a graph from its I/O names (the past_key.{i} inputs)."""
    return sum(1 for n in names if n.startswith("past_key."))


# ----------------------------------------------------------------------------- metadata keys
META_CONTRACT = "arborspec.contract_version"
META_CONFIG = "arborspec.config"
META_DTYPE = "arborspec.dtype"
META_TOKENIZER = "arborspec.tokenizer_sha256"
META_ROLE = "arborspec.role"
META_EXPORTER = "arborspec.exporter"
META_VERSION = "arborspec.version"
META_KV_LAYOUT = "arborspec.kv_layout"
# the cache's element type ("fp32" | "fp16"; absent: the graph's dtype): an fp32 GroupQueryAttention
# graph may keep its cache in fp16 (`arborspec export --kv-dtype fp16`); engines still take the
# cache dtype from the graph's past_key.0 input type and check it against this key
META_KV_DTYPE = "arborspec.kv_dtype"
META_TOPK = "arborspec.topk"  # K of the fused top-k outputs (draft graphs), absent: none
META_FEATURE_LAYERS = "arborspec.feature_layers"  # JSON list: the target-feature output's layers
META_D2T = "arborspec.d2t"  # EAGLE-3 draft graphs: base64 int64 draft -> target id offsets
# "1": the graph takes each row's attended length from its mask (GroupQueryAttention's per-row
# seqlens_k), so batched one-token rows may be ragged (runtime/batch_decode.py); absent: no
META_RAGGED_ROWS = "arborspec.ragged_rows"
# "1": the graph runs a one-token call's attention on one dummy row more, one column past the call
# (export/row_pad.py): one-token calls are row-invariant by themselves; caches need one spare column
META_PAD_ROW = "arborspec.pad_row"
ROLE_EAGLE3 = "eagle3"
META_QUANTIZATION = "arborspec.quantization"  # JSON {"scheme", "format", "layers_by_type", ...}; absent: float

# ----------------------------------------------------------------------------- dtypes
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# ONNX Runtime type strings of float tensors
ORT_TYPES: dict[str, torch.dtype] = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
}
# ONNX TensorProto element types (ONNX Runtime's bind_* takes these ints; numpy has no bfloat16)
ONNX_ELEM: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.int32: 6,
    torch.int64: 7,
    torch.bool: 9,
    torch.float16: 10,
    torch.bfloat16: 16,
}
# TensorRT DataType names -> torch
TRT_DTYPES: dict[str, torch.dtype] = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT8": torch.int8,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ExportDirError(f"unknown dtype {name!r} (expected one of {', '.join(DTYPES)})")
    return DTYPES[name]


# ----------------------------------------------------------------------------- version
def check_contract_version(found: Any, where: str | os.PathLike, expected: int | None = None) -> None:
    """Raise one line when `found` (from a manifest or metadata) is not this contract version."""
    ok = [str(v) for v in (SUPPORTED_VERSIONS if expected is None else (expected,))]
    if str(found) not in ok:
        raise ExportDirError(
            f"{where} uses engine contract version {found}, this arborspec reads "
            f"version {' or '.join(ok)}: re-export it with `arborspec export`"
        )


def check_metadata(
    meta: dict[str, str], where: str | os.PathLike, expected_version: int | None = None
) -> dict[str, Any]:
    """Check an ONNX graph's metadata_props; return its model config (a dict)."""
    if META_CONTRACT not in meta or META_CONFIG not in meta:
        raise ExportDirError(
            f"{where} is not an arborspec export (no arborspec metadata in the ONNX "
            "file): export it with `arborspec export`"
        )
    check_contract_version(meta[META_CONTRACT], where, expected_version)
    try:
        return json.loads(meta[META_CONFIG])
    except json.JSONDecodeError:
        raise ExportDirError(f"{where}: the model config in its metadata is not JSON") from None


def kv_layout(meta: dict[str, str], where: str | os.PathLike = "") -> str:
    """The cache layout a graph's metadata declares ("sbhd" when absent: version 1)."""
    layout = meta.get(META_KV_LAYOUT, "sbhd") or "sbhd"
    if layout not in KV_LAYOUTS:
        raise ExportDirError(f"{where}: unknown kv layout {layout!r} (this arborspec reads {', '.join(KV_LAYOUTS)})")
    return layout


KV_DTYPES = ("fp32", "fp16")  # `arborspec export --kv-dtype`


def kv_dtype_name(meta: dict[str, str], where: str | os.PathLike = "") -> str | None:
    """The cache dtype a graph's metadata declares ("fp32", "fp16"), or None when absent (older
    exports: the cache has the graph's dtype)."""
    name = meta.get(META_KV_DTYPE) or None
    if name is not None and name not in DTYPES:
        raise ExportDirError(f"{where}: unknown kv dtype {name!r} (this arborspec reads {', '.join(DTYPES)})")
    return name


def check_arborspec_onnx(path: str | os.PathLike, expected_version: int | None = None) -> dict[str, str]:
    """metadata_props of an arborspec ONNX graph; one line for a foreign file or another
    contract version."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such file")
    meta = read_onnx_metadata(path)["metadata"]
    check_metadata(meta, path, expected_version)
    return meta


# ----------------------------------------------------------------------------- manifest.json
MANIFEST_NAME = "manifest.json"
FORMAT = "arborspec-export"


@dataclass
class Manifest:
    """A checked export folder manifest (schema in the module docstring)."""

    root: Path
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def contract_version(self) -> int:
        return int(self.data["contract_version"])

    @property
    def target(self) -> dict[str, Any]:
        return self.data["target"]

    @property
    def draft(self) -> dict[str, Any]:
        return self.data.get("draft") or {"kind": "none"}

    @property
    def limits(self) -> dict[str, Any]:
        return self.data.get("limits", {})

    @property
    def tree_defaults(self) -> dict[str, Any]:
        return self.data.get("tree_defaults", {})

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        return self.data.get("tokenizer")

    def path(self, name: str) -> Path:
        return self.root / name

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def _check_file_entry(root: Path, entry: dict[str, Any], role: str, check_checksums: bool) -> None:
    name = entry.get("file")
    if not name:
        raise ExportDirError(f"manifest {role} entry names no file")
    f = root / name
    if not f.is_file():
        raise MissingFileError(f"{f}: {role} file listed in the manifest is missing")
    if entry.get("kind", "onnx") == "onnx":
        for ext in entry.get("external_data", []):
            if not (root / ext).is_file():
                raise MissingFileError(
                    f"{root / ext}: external-data file of {name} is missing (copy the whole export folder)"
                )
        meta = check_arborspec_onnx(f)
        cfg = json.loads(meta[META_CONFIG])
        if "config" in entry and cfg != entry["config"]:
            raise ExportDirError(f"{f}: model config in the ONNX metadata differs from {MANIFEST_NAME}")
    if "bytes" in entry and f.stat().st_size != entry["bytes"]:
        raise ExportDirError(f"{f}: size {f.stat().st_size} differs from the manifest's {entry['bytes']}")
    if check_checksums and entry.get("sha256") and sha256_file(f) != entry["sha256"]:
        raise ExportDirError(f"{f}: sha256 differs from the manifest (file changed or corrupt)")
    if entry.get("kind") == "eagle3":  # the head's second graph: its projection of the target features
        fc = root / str(entry.get("fc_file") or "")
        if not entry.get("fc_file") or not fc.is_file():
            raise MissingFileError(f"{fc}: {role} projection graph listed in the manifest is missing")
        if "fc_bytes" in entry and fc.stat().st_size != entry["fc_bytes"]:
            raise ExportDirError(f"{fc}: size {fc.stat().st_size} differs from the manifest's {entry['fc_bytes']}")
        if check_checksums and entry.get("fc_sha256") and sha256_file(fc) != entry["fc_sha256"]:
            raise ExportDirError(f"{fc}: sha256 differs from the manifest (file changed or corrupt)")


def read_manifest(dir: str | os.PathLike, check_checksums: bool = False) -> Manifest:
    """Read and check DIR/manifest.json and the files it lists (cheap checks: presence, sizes,
    ONNX metadata; `check_checksums` adds the sha256 of every file). One-line errors:
    MissingFileError (folder, manifest or a listed file missing) or ExportDirError."""
    root = Path(dir)
    if not root.exists():
        raise MissingFileError(f"{root}: export folder does not exist")
    if not root.is_dir():
        raise ExportDirError(f"{root}: expected an export folder, got a file")
    mf = root / MANIFEST_NAME
    if not mf.is_file():
        raise MissingFileError(
            f"{root} has no {MANIFEST_NAME}: not an arborspec export folder (create one with `arborspec export`)"
        )
    try:
        data = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportDirError(f"{mf}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExportDirError(f"{mf} is not an arborspec manifest (format != {FORMAT!r})")
    ver = data.get("contract_version")
    if ver not in SUPPORTED_VERSIONS:
        raise ExportDirError(
            f"{mf}: exported for engine contract version {ver}, this arborspec "
            f"reads version {' or '.join(map(str, SUPPORTED_VERSIONS))}: re-export the model"
        )
    for key in ("target", "limits"):
        if key not in data:
            raise ExportDirError(f"{mf}: missing {key!r}")
    man = Manifest(root=root, data=data)
    _check_file_entry(root, man.target, "target", check_checksums)
    if man.draft.get("kind", "none") != "none":
        _check_file_entry(root, man.draft, "draft", check_checksums)
    tok = man.tokenizer
    if tok:
        for name in tok.get("files", []):
            if not (root / name).is_file():
                raise MissingFileError(f"{root / name}: tokenizer file listed in the manifest is missing")
    return man


# ----------------------------------------------------------------------------- engines.json
ENGINES_NAME = "engines.json"
ENGINES_FORMAT = 1


@dataclass
class EnginesManifest:
    """engines.json of a TensorRT engines folder: one entry per engine, keyed by role."""

    root: Path
    data: dict[str, Any] = field(default_factory=lambda: {"format": ENGINES_FORMAT, "engines": {}})

    @property
    def engines(self) -> dict[str, dict[str, Any]]:
        return self.data.setdefault("engines", {})

    def entry_for_file(self, file_name: str) -> dict[str, Any] | None:
        for e in self.engines.values():
            if e.get("file") == file_name:
                return e
        return None

    def path(self, role: str) -> Path | None:
        e = self.engines.get(role)
        return self.root / e["file"] if e and e.get("file") else None


def read_engines_manifest(folder_or_engine: str | os.PathLike, missing_ok: bool = False) -> EnginesManifest | None:
    """engines.json of a folder (or of the folder holding an engine file). With missing_ok, an
    absent or unreadable file gives None; otherwise one line."""
    p = Path(folder_or_engine)
    root = p if p.is_dir() else p.parent
    path = root / ENGINES_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if missing_ok:
            return None
        raise MissingFileError(f"no {ENGINES_NAME} in {root} (build engines with `arborspec build`)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        if missing_ok:
            return None
        raise ExportDirError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("engines"), dict):
        if missing_ok:
            return None
        raise ExportDirError(f"{path} is not an arborspec engines manifest")
    return EnginesManifest(root, data)


def engine_entry(engine_path: str | os.PathLike) -> dict[str, Any] | None:
    """The engines.json entry of one engine file, or None when there is none."""
    engine_path = Path(engine_path)
    man = read_engines_manifest(engine_path.parent, missing_ok=True)
    return man.entry_for_file(engine_path.name) if man else None
