"""Read an ONNX file's top-level facts (IR version, opsets, metadata_props) without onnx.

Role in one decode step: none; before the first step the runtime checks that a graph is an
arborspec contract graph of the right version. The protobuf's top-level fields are scanned
and the graph is skipped by seeking, so this costs a few reads even for a 2 GB file, and the
runtime never imports onnx.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from .errors import ExportDirError


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
    """{"ir_version", "opsets", "metadata"} of an ONNX file. Raises ExportDirError if the file
    is not an ONNX model (truncated, random bytes)."""
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
