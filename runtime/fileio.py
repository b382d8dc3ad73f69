"""Files the runtime and the exporters write and check: atomic writes and checksums.

Role in one decode step: none; before the first step an export folder's files are checked
with `sha256_file`, and everything arborspec writes (manifests, tables, caches, engines) goes
through `atomic_write_*`: a temporary sibling, fsync, rename; folders through `PartialFolder`
(a hidden sibling folder, renamed into place). A failed write (full disk, file-size limit)
removes the temporary file and raises one `OutputError` line, so no reader ever sees half a
file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import InputError, MissingFileError, OutputError

CHUNK = 1 << 22


def sha256_file(path: str | os.PathLike, chunk: int = CHUNK) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def describe_os_error(e: OSError, path: str | os.PathLike) -> str:
    """One line for a failed write: names the path and the cause."""
    if e.errno == errno.ENOSPC:
        why = "no space left on the device"
    elif e.errno == errno.EFBIG:
        why = "file too large (file-size limit)"
    elif e.errno == errno.EDQUOT:
        why = "disk quota exceeded"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "permission denied" if e.errno != errno.EROFS else "read-only file system"
    else:
        why = e.strerror or type(e).__name__
    return f"cannot write {path}: {why}"


def read_text_file(path: str | os.PathLike, what: str = "file") -> str:
    """A UTF-8 text file the user named: a missing file or one that is not UTF-8 is one
    `ArborspecError` line naming the file (and the first bad byte), not a traceback."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{what} {p} is a folder, not a file")
    if not p.is_file():
        raise MissingFileError(f"{what} not found: {p}")
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{what} {p} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "wb") -> Path:
    """Write `path` through `write(fileobj)` into a hidden temporary sibling, fsync, rename.
    On any failure the temporary file is removed; OS errors become one OutputError line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files: give the usual permissions
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _unlink(tmp)
        raise OutputError(describe_os_error(e, path)) from e
    except BaseException:
        _unlink(tmp)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data), "wb")


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text), "w")


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2, sort_keys: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Remove `.NAME.<pid>.*.tmp` siblings left by a writer that was killed (its pid is gone):
    every atomic write of a file first sweeps what an earlier, killed write of it left."""
    path = Path(path)
    removed = []
    for p in path.parent.glob(f".{path.name}.*.tmp"):
        pid = p.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _unlink(str(p))
            removed.append(p)
    return removed


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


# ----------------------------------------------------------------------------- partial folders
PARTIAL_TAG = ".partial-"


def partial_dir(out: str | os.PathLike) -> Path:
    """A fresh hidden sibling `.NAME.partial-<pid>-<random>` to write a folder into before it is
    renamed into place; the pid lets a later run recognise one left by a killed process."""
    import uuid

    out = Path(out)
    tmp = out.parent / f".{out.name}{PARTIAL_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:  # an unwritable or impossible place: one line, before any work
        file = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
        raise OutputError(
            f"cannot write {out}: {file} is a file, not a folder" if file else describe_os_error(e, out)
        ) from e
    return tmp


class PartialFolder:
    """A folder written atomically, the one helper for "write to a temp folder, rename, remove on
    failure": `path` is a fresh hidden sibling of `out` (partial_dir) to fill; `publish()` puts it
    in `out`'s place (an existing `out` is moved aside first and removed after; keep_existing: a
    folder another process published first wins and ours is dropped); `discard()` removes it.
    As a context manager it yields `path`, publishes when the block ends, discards on any error."""

    def __init__(self, out: str | os.PathLike, keep_existing: bool = False):
        self.out, self.keep_existing = Path(out), keep_existing
        self.path = partial_dir(self.out)

    def publish(self) -> Path:
        import shutil
        import uuid

        out, old = self.out, None
        if out.exists():
            if self.keep_existing:
                self.discard()
                return out
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        try:
            os.replace(self.path, out)
        except OSError:
            if not (self.keep_existing and out.exists()):  # not a race lost to another writer
                raise
            self.discard()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return out

    def discard(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
            return
        try:
            self.publish()
        except BaseException:
            self.discard()
            raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(out: str | os.PathLike) -> list[Path]:
    """Remove `.NAME.partial-*` siblings whose writer is gone (killed, power loss); returns them.
    Partials of a live process (a concurrent run) are left alone."""
    import shutil

    out = Path(out)
    removed = []
    if not out.parent.is_dir():
        return removed
    for p in out.parent.glob(f".{out.name}{PARTIAL_TAG}*"):
        rest = p.name[len(f".{out.name}{PARTIAL_TAG}") :]
        pid = rest.split("-", 1)[0]
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed
