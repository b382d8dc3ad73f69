"""Open an export folder (manifest.json + target.onnx + draft + tokenizer) for decoding.

Role in one decoding step: this runs before the first step. It reads and checks the
manifest (contract version, files, external data, ONNX metadata), then builds the engines
that every step calls (the draft per tree level, the target once to verify) and the
tokenizer. It is on the runtime path, so it never imports onnx, polygraphy, transformers,
arborspec.models or arborspec.export: ONNX metadata is read by scanning the protobuf's
top-level fields (the graph is skipped by seeking), and ONNX Runtime is imported lazily.

The manifest schema (written by arborspec.export.manifest, read here):

    {
      "format": "arborspec-export",
      "contract_version": 1,                  # arborspec.CONTRACT_VERSION at export time
      "arborspec_version": "0.1.0",
      "created": "2026-11-21T20:00:00Z",
      "target": {"kind": "onnx", "file": "target.onnx", "config": {ModelConfig},
                 "dtype": "fp32", "opset": 23, "exporter": "dynamo", "ir_version": 10,
                 "external_data": [], "sha256": "...", "bytes": 123,
                 "inputs": [{"name", "dtype", "shape"}], "outputs": [...]},
      "draft": {"kind": "onnx", "spec": "layers:2", ...same keys as target...}
             | {"kind": "bigram", "spec": "bigram", "file": "draft_bigram.safetensors", ...}
             | {"kind": "none"},
      "limits": {"max_context": 2048, "max_tree_nodes": 64},
      "tree_defaults": {"mode": "tree", "tree": "full:3,2"},
      "source": {"model": "smollm2-135m", "location": "...", "checksums": {"file": "sha256"}},
      "tokenizer": {"files": ["tokenizer.json", ...], "sha256": "..."} | null
    }
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = "arborspec-export"
META_CONTRACT = "arborspec.contract_version"
META_CONFIG = "arborspec.config"


class ExportDirError(ValueError):
    """An export folder that cannot be used (reported as one line by the CLI)."""


@dataclass
class Manifest:
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


# ----------------------------------------------------------------------------- ONNX metadata
def _varint(f) -> int:
    shift = result = 0
    while True:
        b = f.read(1)
        if not b:
            raise EOFError
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return result
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) over a small protobuf message held in memory."""
    import io

    f = io.BytesIO(buf)
    while f.tell() < len(buf):
        key = _varint(f)
        num, wt = key >> 3, key & 7
        if wt == 0:
            yield num, wt, _varint(f)
        elif wt == 2:
            yield num, wt, f.read(_varint(f))
        elif wt == 1:
            yield num, wt, f.read(8)
        elif wt == 5:
            yield num, wt, f.read(4)
        else:
            raise ValueError("bad wire type")


def read_onnx_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Top-level facts of an ONNX file without onnx: {"ir_version", "opsets", "metadata"}.
    Seeks over the graph, so it costs a few reads even for a 2 GB file. Raises ExportDirError
    if the file is not an ONNX model."""
    path = Path(path)
    out: dict[str, Any] = {"ir_version": None, "opsets": {}, "metadata": {}}
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            while f.tell() < size:
                key = _varint(f)
                num, wt = key >> 3, key & 7
                if wt == 0:
                    v = _varint(f)
                    if num == 1:
                        out["ir_version"] = v
                elif wt == 2:
                    n = _varint(f)
                    if num in (8, 14):
                        sub = dict((k, v) for k, _, v in _fields(f.read(n)))
                        if num == 14:
                            out["metadata"][sub.get(1, b"").decode()] = sub.get(2, b"").decode()
                        else:
                            out["opsets"][sub.get(1, b"").decode()] = sub.get(2, 0)
                    else:
                        f.seek(n, 1)
                elif wt == 1:
                    f.seek(8, 1)
                elif wt == 5:
                    f.seek(4, 1)
                else:
                    raise ValueError(f"wire type {wt}")
                if f.tell() > size:
                    raise EOFError
    except (EOFError, ValueError, UnicodeDecodeError) as e:
        raise ExportDirError(f"{path} is not a readable ONNX model ({e or 'truncated'})") from None
    if out["ir_version"] is None:
        raise ExportDirError(f"{path} is not an ONNX model (no IR version)")
    return out


def check_arborspec_onnx(path: str | os.PathLike, expected_version: int | None = None) -> dict[str, Any]:
    """Metadata of an arborspec ONNX graph; raises ExportDirError for a foreign file or another
    contract version. Returns the metadata_props dict."""
    from arborspec import CONTRACT_VERSION

    expected_version = CONTRACT_VERSION if expected_version is None else expected_version
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    meta = read_onnx_metadata(path)["metadata"]
    if META_CONTRACT not in meta or META_CONFIG not in meta:
        raise ExportDirError(f"{path} is not an arborspec export (no arborspec metadata in the ONNX "
                             "file): export it with `arborspec export`")
    if str(meta[META_CONTRACT]) != str(expected_version):
        raise ExportDirError(f"{path} uses engine contract version {meta[META_CONTRACT]}, this "
                             f"arborspec reads version {expected_version}: re-export it")
    return meta


# ----------------------------------------------------------------------------- manifest
def _check_graph_entry(root: Path, entry: dict[str, Any], role: str, check_checksums: bool) -> None:
    name = entry.get("file")
    if not name:
        raise ExportDirError(f"manifest {role} entry names no file")
    f = root / name
    if not f.is_file():
        raise FileNotFoundError(f"{f}: {role} file listed in the manifest is missing")
    if entry.get("kind", "onnx") == "onnx":
        for ext in entry.get("external_data", []):
            if not (root / ext).is_file():
                raise FileNotFoundError(f"{root / ext}: external-data file of {name} is missing "
                                        "(copy the whole export folder)")
        meta = check_arborspec_onnx(f)
        cfg = json.loads(meta[META_CONFIG])
        if "config" in entry and cfg != entry["config"]:
            raise ExportDirError(f"{f}: model config in the ONNX metadata differs from manifest.json")
    if "bytes" in entry and f.stat().st_size != entry["bytes"]:
        raise ExportDirError(f"{f}: size {f.stat().st_size} differs from the manifest's {entry['bytes']}")
    if check_checksums and entry.get("sha256"):
        import hashlib

        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for b in iter(lambda: fh.read(1 << 22), b""):
                h.update(b)
        if h.hexdigest() != entry["sha256"]:
            raise ExportDirError(f"{f}: sha256 differs from the manifest (file changed or corrupt)")


def read_manifest(dir: str | os.PathLike, check_checksums: bool = False) -> Manifest:
    """Read and validate DIR/manifest.json and the files it lists. Raises FileNotFoundError
    (folder, manifest or a listed file missing) or ExportDirError (a ValueError: not an
    arborspec folder, another contract version, a foreign ONNX file)."""
    from arborspec import CONTRACT_VERSION

    root = Path(dir)
    if not root.exists():
        raise FileNotFoundError(f"{root}: export folder does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: expected an export folder, got a file")
    mf = root / MANIFEST_NAME
    if not mf.is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST_NAME}: not an arborspec export folder "
                                "(create one with `arborspec export`)")
    try:
        data = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportDirError(f"{mf}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExportDirError(f"{mf} is not an arborspec manifest (format != {FORMAT!r})")
    ver = data.get("contract_version")
    if ver != CONTRACT_VERSION:
        raise ExportDirError(f"{mf}: exported for engine contract version {ver}, this arborspec "
                             f"reads version {CONTRACT_VERSION}: re-export the model")
    for key in ("target", "limits"):
        if key not in data:
            raise ExportDirError(f"{mf}: missing {key!r}")
    man = Manifest(root=root, data=data)
    _check_graph_entry(root, man.target, "target", check_checksums)
    if man.draft.get("kind", "none") != "none":
        _check_graph_entry(root, man.draft, "draft", check_checksums)
    tok = man.tokenizer
    if tok:
        for name in tok.get("files", []):
            if not (root / name).is_file():
                raise FileNotFoundError(f"{root / name}: tokenizer file listed in the manifest is missing")
    return man


# ----------------------------------------------------------------------------- loading
def _load_tokenizer(man: Manifest):
    tok = man.tokenizer
    if not tok or not tok.get("files"):
        return None
    from arborspec.runtime.tokenizer import TextTokenizer  # written by the models/loaders owner

    loader = getattr(TextTokenizer, "load", None) or TextTokenizer.from_files
    return loader(man.root)


def load_export_dir(dir: str | os.PathLike, backend: str = "onnxruntime", device: str = "cpu",
                    providers: list | None = None, load_tokenizer: bool = True):
    """-> (target_engine, draft, tokenizer, manifest).

    draft is an Engine (ONNX draft), a Path to the bigram table file, or None (no draft).
    tokenizer is a TextTokenizer or None (no tokenizer files exported)."""
    man = read_manifest(dir)
    if backend != "onnxruntime":
        raise ExportDirError(f"backend {backend!r} cannot run an export folder here (expected "
                             "onnxruntime; tensorrt engines are built with `arborspec build`)")
    from .backends.onnxruntime import OrtEngine

    target = OrtEngine(man.path(man.target["file"]), providers=providers, device=device)
    d = man.draft
    kind = d.get("kind", "none")
    if kind == "onnx":
        draft = OrtEngine(man.path(d["file"]), providers=providers, device=device)
        if draft.info.vocab_size != target.info.vocab_size:
            raise ExportDirError(f"draft vocabulary {draft.info.vocab_size} != target "
                                 f"vocabulary {target.info.vocab_size}")
    elif kind == "bigram":
        draft = man.path(d["file"])
    elif kind == "none":
        draft = None
    else:
        raise ExportDirError(f"unknown draft kind {kind!r} in the manifest")
    tokenizer = _load_tokenizer(man) if load_tokenizer else None
    return target, draft, tokenizer, man


__all__ = ["Manifest", "ExportDirError", "read_manifest", "read_onnx_metadata",
           "check_arborspec_onnx", "load_export_dir", "MANIFEST_NAME", "FORMAT"]
