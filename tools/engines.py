"""Open a target and a draft for a backend from CLI-style arguments.

Role in one decoding step: none; it wires the engines that every step calls. With
`--backend torch` the models come from the registry (`--model NAME|PATH`, `--draft
layers:K|bigram|MODEL`); with `--backend onnxruntime` or `tensorrt` they come from an export
folder (`--export-dir DIR`) and only the runtime is imported (no model code, no onnx).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BACKENDS = ("torch", "onnxruntime", "tensorrt")


@dataclass
class OpenModels:
    target: Any
    draft: Any  # an Engine, a BigramDraft or None
    tokenizer: Any
    limits: dict = field(default_factory=dict)
    tree_default: str | None = None
    describe: str = ""
    source: dict = field(default_factory=dict)


def add_model_args(p, draft_default: str | None = None) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--model", help="target: registry name (smollm2-135m), .gguf, HF folder or nanoGPT .pt "
                                    "(torch backend)")
    g.add_argument("--draft", default=draft_default,
                   help="draft: layers:K (first K target layers), bigram (table from the target), "
                        "lookup[:N] (n-gram prompt lookup, any backend), none, or a model name/path "
                        "with the same vocabulary (torch backend)")
    g.add_argument("--export-dir", type=Path, help="export folder from `arborspec export` "
                                                   "(onnxruntime and tensorrt backends)")
    g.add_argument("--engine-dir", type=Path, help="TensorRT engines folder (default EXPORT_DIR/engines)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="torch (default with --model) | onnxruntime (default with --export-dir) | tensorrt")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")


def _bigram_from_target(engine, source: dict, progress: bool = True):
    """The bigram draft of a torch target, cached in the user cache by the weights' sha256."""

    from arborspec.models.registry import cache_dir
    from arborspec.runtime.drafts import (BigramDraft, bigram_table_from_target, load_bigram_table,
                                          save_bigram_table)

    sha = source.get("sha256")
    cache = None
    if sha:
        cache = cache_dir() / "bigram" / f"{sha[:32]}.safetensors"
        if cache.is_file():
            return load_bigram_table(cache)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = lambda it: tqdm(it, desc="bigram table from the target", unit="batch", leave=False)  # noqa: E731
    idx, logits = bigram_table_from_target(engine, progress=bar)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_bigram_table(cache, idx, logits, engine.info.vocab_size)
    return BigramDraft(idx, logits, engine.info.vocab_size)


def lookup_spec(spec: str | None) -> int | None:
    """`lookup` / `lookup:N` (prompt-lookup n-gram draft, n <= N) -> N, else None."""
    if not spec or not spec.strip().lower().startswith("lookup"):
        return None
    _, _, n = spec.strip().partition(":")
    try:
        n = int(n) if n else 3
    except ValueError:
        raise ValueError(f"bad draft spec {spec!r}: expected lookup or lookup:N") from None
    if n < 1:
        raise ValueError(f"bad draft spec {spec!r}: N must be >= 1")
    return n


def open_models(args, need_draft: bool = True) -> OpenModels:
    """Engines for the arguments. `--draft lookup[:N]` (a runtime-only n-gram draft) works with
    every backend, also on top of an export folder whose own draft it replaces."""
    n_lookup = lookup_spec(getattr(args, "draft", None))
    if n_lookup is not None:
        from arborspec.runtime.drafts import LookupDraft

        saved = args.draft
        args.draft = "none" if (args.backend or ("torch" if args.model else "onnxruntime")) == "torch" else None
        try:
            models = open_models(args, need_draft=False)
        finally:
            args.draft = saved
        if need_draft:
            models.draft = LookupDraft(models.target.info.vocab_size, max_ngram=n_lookup)
        return models
    backend = args.backend or ("torch" if args.model else "onnxruntime")
    if backend == "torch":
        if not args.model:
            raise ValueError("--backend torch needs --model NAME|PATH")
        return _open_torch(args, need_draft)
    if args.export_dir is None:
        raise ValueError(f"--backend {backend} needs --export-dir DIR (make one with `arborspec export`)")
    if args.model:
        raise ValueError(f"--model is for the torch backend; --backend {backend} reads --export-dir")
    return _open_export(args, backend, need_draft)


def _open_torch(args, need_draft: bool) -> OpenModels:

    from arborspec.models.registry import load_model
    from arborspec.runtime.backends.torch_backend import TorchEngine

    loaded = load_model(args.model)
    device = args.device
    target = TorchEngine(loaded.module, device=device)
    draft = None
    spec = (args.draft or "none").strip()
    if need_draft and spec.lower() != "none":
        from arborspec.export.export_folder import parse_draft_spec, truncated_draft

        kind, val = parse_draft_spec(spec)
        if kind == "layers":
            draft = TorchEngine(truncated_draft(loaded.module, val), device=device)
        elif kind == "bigram":
            draft = _bigram_from_target(target, loaded.source)
        elif kind == "model":
            d = load_model(val)
            if d.config.vocab_size != loaded.config.vocab_size:
                raise ValueError(f"draft vocabulary ({d.config.vocab_size}) differs from the target's "
                                 f"({loaded.config.vocab_size})")
            draft = TorchEngine(d.module, device=device)
    return OpenModels(target, draft, loaded.tokenizer, describe=f"{args.model} (torch, {device})",
                      source=loaded.source)


def _open_export(args, backend: str, need_draft: bool) -> OpenModels:
    from arborspec.runtime.drafts import load_bigram_table
    from arborspec.runtime.export_dir import load_export_dir, read_manifest

    if args.draft not in (None, "", "export") and need_draft:
        raise ValueError("--draft is fixed by the export folder with --export-dir (re-export to change it)")
    if backend == "onnxruntime":
        target, draft, tok, man = load_export_dir(args.export_dir, device=args.device)
    else:
        from arborspec.runtime.backends.tensorrt import TrtEngine

        man = read_manifest(args.export_dir)
        edir = args.engine_dir or (Path(args.export_dir) / "engines")
        if not (edir / "target.engine").is_file():
            raise FileNotFoundError(f"no TensorRT engines in {edir}: run `arborspec build --export-dir "
                                    f"{args.export_dir}` first")
        device = args.device if args.device.startswith("cuda") else "cuda"
        target = TrtEngine(edir / "target.engine", device=device)
        d = man.draft
        if d.get("kind") == "onnx":
            draft = TrtEngine(edir / "draft.engine", device=device)
        elif d.get("kind") == "bigram":
            draft = man.path(d["file"])
        else:
            draft = None
        from arborspec.runtime.export_dir import _load_tokenizer

        tok = _load_tokenizer(man)
    if isinstance(draft, (str, Path)):
        draft = load_bigram_table(draft)
    if not need_draft:
        draft = None
    tree_default = (man.tree_defaults or {}).get("tree")
    return OpenModels(target, draft, tok, limits=dict(man.limits or {}), tree_default=tree_default,
                      describe=f"{args.export_dir} ({backend}, {args.device})")
