"""Where `arborspec tune` writes the tree it chose, and where `--tree auto` reads it.

Role in one decode step: none; it names the file of step 1's tuned tree shape once. `tune` writes
to `ModelsKey.path()`, and the resolver (runtime/decoder_config.resolve_config) reads it for
`--tree auto` (and for no tree at all, when the file exists):

- an export folder: DIR/tree_auto.json for its own draft, DIR/tree_auto.SPEC.json for another
  (`lookup`, `export+lookup`: each draft its own tree), `.sampled.json` for `tune --temperature T`;
- a --model run (torch backend): the user cache (ARBORSPEC_CACHE)/tune/, keyed by model, draft,
  backend and device.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError, MissingFileError

AUTO_TREE_FILE = "tree_auto.json"  # an export's own draft's tuned tree


@dataclass(frozen=True)
class ModelsKey:
    """Which models a tuned tree belongs to: an export folder, or a --model/--draft pair on a
    backend and device."""

    model: str | None = None
    draft: str | None = None
    backend: str | None = None
    device: str = "cpu"
    export_dir: str | os.PathLike | None = None

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("torch" if self.model else "onnxruntime")

    def key(self) -> str:
        model = str(self.model)
        p = Path(model).expanduser()
        if p.exists():
            model = str(p.resolve())
        draft = str(self.draft or "")
        dp = Path(draft).expanduser()
        if draft and dp.exists():
            draft = str(dp.resolve())
        return json.dumps(
            {"model": model, "draft": draft, "backend": self.backend or "torch", "device": self.device}, sort_keys=True
        )

    def path(self, sampled: bool = False) -> Path:
        """The tuned tree's file for these models (`sampled`: the one tuned for sampled decoding)."""
        if self.export_dir:
            return auto_tree_file(self.export_dir, self.draft, sampled)
        from .settings import path as setting_path

        stem = f"{Path(str(self.model)).name}-{Path(str(self.draft or 'none')).name}"
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)[:80]
        tail = ".sampled.json" if sampled else ".json"
        digest = hashlib.sha256(self.key().encode()).hexdigest()[:12]
        return setting_path("ARBORSPEC_CACHE") / "tune" / f"{stem}-{digest}{tail}"

    def tune_command(self) -> str:
        """The `arborspec tune` line that writes this key's tree."""
        be = f" --backend {self.backend}" if self.backend else ""
        if self.export_dir:
            own = self.path().name == AUTO_TREE_FILE  # the export's own draft
            return f"arborspec tune --export-dir {self.export_dir}{'' if own else f' --draft {self.draft}'}{be}"
        return f"arborspec tune --model {self.model} --draft {self.draft}{be}"


def auto_tree_file(export_dir, draft: str | None = None, sampled: bool = False) -> Path:
    """Where `arborspec tune --export-dir DIR [--draft SPEC]` writes its tree: DIR/tree_auto.json
    for the export's own draft, DIR/tree_auto.SPEC.json for another (`lookup`, `export+lookup`:
    each draft gets the tree tuned for it); `tree_auto[.SPEC].sampled.json` for the tree tuned
    for sampled decoding (`tune --temperature T`)."""
    d = (draft or "export").strip().lower()
    if "suffix" in d:  # the suffix draft proposes its own nodes: BASE+suffix runs BASE's tree (suffix alone: any)
        d = d.split("+")[0] if "+" in d else "export"
    tail = ".sampled.json" if sampled else ".json"
    if d in ("export", "eagle3"):
        return Path(export_dir) / (AUTO_TREE_FILE[: -len(".json")] + tail)
    return Path(export_dir) / f"tree_auto.{re.sub(r'[^a-z0-9_.-]+', '_', d)}{tail}"


def tuned_spec(key: ModelsKey, sampled: bool = False) -> str:
    """`static:PATH` of the tree `arborspec tune` chose for these models (`sampled`: the one for
    sampled decoding), or one line saying how to make it (or that the file is no JSON)."""
    path = key.path(sampled)
    if not path.is_file():
        raise MissingFileError(f"--tree auto: no tuned tree for these models ({path}); run `{key.tune_command()}` first")
    try:
        json.loads(path.read_text())
    except ValueError:
        raise InputError(f"--tree auto: {path} is not valid JSON; re-run `arborspec tune`") from None
    return f"static:{path}"


def tuned_backend_note(spec, key: ModelsKey) -> str | None:
    """A note when `spec` is this key's tuned tree and was tuned on another backend, else None."""
    text = str(spec or "")
    if not text.startswith("static:") or Path(text[len("static:") :]) not in (key.path(), key.path(True)):
        return None
    path = Path(text[len("static:") :])
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    tuned = meta.get("backend") if isinstance(meta, dict) else None
    if tuned and tuned != key.resolved_backend:
        return f"{path} was tuned for the {tuned} backend, running on {key.resolved_backend}"
    return None
