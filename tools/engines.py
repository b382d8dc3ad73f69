"""Open a target and a draft for a backend from CLI-style arguments.

Role in one decoding step: none; it wires the engines that every step calls. With
`--backend torch` the models come from the registry (`--model NAME|PATH`, `--draft
layers:K|bigram|MODEL`) as an `OpenModels`; with `--backend onnxruntime` or `tensorrt` they come
from an export folder (`--export-dir DIR`) as the runtime's own `OpenedExport`
(runtime/export_dir.py, what `Generator.from_export` opens too) and only the runtime is imported
(no model code, no onnx). Both have target, draft, tokenizer, limits, tree_default, describe,
close(): what runtime/decoder_config.resolve_config reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arborspec.tools.options import DEVICE_HELP, DRAFT_HELP, UserError

BACKENDS = ("torch", "onnxruntime", "tensorrt")
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --dtype: torch's names


@dataclass
class OpenModels:
    """The torch backend's opened models (an export folder opens as an OpenedExport)."""

    target: Any
    draft: Any  # a DraftSource, an Engine or None
    tokenizer: Any
    limits: dict = field(default_factory=dict)
    tree_default: str | None = None
    describe: str = ""
    source: dict = field(default_factory=dict)

    def close(self) -> None:
        """Nothing to close: torch modules hold no sessions."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def add_model_args(p, draft_default: str | None = None) -> None:
    g = p.add_argument_group("models")
    g.add_argument(
        "--model", help="target: registry name (smollm2-135m), .gguf, HF folder or nanoGPT .pt (torch backend)"
    )
    g.add_argument("--draft", default=draft_default, help=DRAFT_HELP)
    g.add_argument(
        "--export-dir", type=Path, help="export folder from `arborspec export` (onnxruntime and tensorrt backends)"
    )
    g.add_argument("--engine-dir", type=Path, help="TensorRT engines folder (default EXPORT_DIR/engines)")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="torch (default with --model) | onnxruntime (default with --export-dir) | tensorrt",
    )
    g.add_argument("--device", default="cpu", help=DEVICE_HELP)
    g.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="torch backend on a CUDA device: replay calls of up to 128 tokens as CUDA graphs "
        "(one capture per T bucket; 3-5x faster calls measured on an H200)",
    )
    g.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="fp32",
        help="torch backend: the target's and a model draft's weights and KV cache (logits and an "
        "EAGLE-3 head stay float32; an export's dtype is chosen at `arborspec export --dtype`). "
        "Measured on an H200 with --cuda-graphs: fp16 verify calls of 8-16 tokens cost 1.1x a "
        "one-token call, fp32's 1.6-2.6x (default fp32)",
    )
    g.add_argument(
        "--verify",
        action="store_true",
        help="check the sha256 of every file of the export folder against its manifest before "
        "loading (default: cheap checks only: presence, sizes, ONNX metadata)",
    )


def _bigram_from_target(engine, source: dict, progress: bool = True):
    """The bigram draft of a torch target, cached in the user cache by the weights' sha256."""

    from arborspec.models.registry import cache_dir
    from arborspec.runtime.drafts.bigram import (
        BigramDraft,
        bigram_table_from_target,
        load_bigram_table,
        save_bigram_table,
    )

    sha = source.get("sha256")
    cache = None
    if sha:
        cache = cache_dir() / "bigram" / f"{sha[:32]}.safetensors"
        if cache.is_file():
            return load_bigram_table(cache)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = lambda it: tqdm(it, desc="bigram table from the target", unit="batch", leave=False, disable=None)  # noqa: E731
    idx, logits = bigram_table_from_target(engine, progress=bar)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_bigram_table(cache, idx, logits, engine.info.vocab_size)
    return BigramDraft(idx, logits, engine.info.vocab_size)


@dataclass(frozen=True)
class EngineOptions:
    """How `open_engines` opens them, besides what and where."""

    engine_dir: Any = None  # TensorRT engines (None: EXPORT_DIR/engines)
    verify: bool = False  # check every export file's sha256
    need_draft: bool = True  # False: no draft is opened
    cuda_graphs: bool = False  # torch backend on CUDA: replay calls as CUDA graphs
    dtype: str = "fp32"  # torch backend: fp32, fp16, bf16


def open_models(args, need_draft: bool = True):
    """Engines for CLI-style arguments (see `open_engines`)."""
    return open_engines(
        args.model,
        getattr(args, "draft", None),
        args.export_dir,
        args.backend,
        args.device,
        EngineOptions(
            engine_dir=getattr(args, "engine_dir", None),
            verify=bool(getattr(args, "verify", False)),
            need_draft=need_draft,
            cuda_graphs=bool(getattr(args, "cuda_graphs", False)),
            dtype=getattr(args, "dtype", "fp32") or "fp32",
        ),
    )


def open_engines(
    model=None,
    draft: str | None = None,
    export_dir=None,
    backend: str | None = None,
    device: str = "cpu",
    options: EngineOptions | None = None,
    **kw,
):
    """Target and draft for a backend: `model` (torch backend: registry name or path; an
    OpenModels) or `export_dir` (onnxruntime, tensorrt; an OpenedExport). `draft lookup[:N]` (a
    runtime-only n-gram draft) works with every backend, also on top of an export folder whose
    own draft it replaces. options: EngineOptions, its fields as keywords over it (dtype:
    the torch backend's weights and cache)."""
    from dataclasses import replace

    o = replace(options or EngineOptions(), **kw)
    engine_dir, verify, need_draft, cuda_graphs, dtype = o.engine_dir, o.verify, o.need_draft, o.cuda_graphs, o.dtype
    backend = backend or ("torch" if model else "onnxruntime")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if dtype != "fp32" and backend != "torch":
        raise UserError(
            f"--dtype {dtype} is for the torch backend; an export folder's dtype is fixed when it is "
            "made (arborspec export --dtype)"
        )
    from arborspec.runtime.drafts.spec import parse_draft_spec

    if cuda_graphs and (backend != "torch" or not str(device).startswith("cuda")):
        raise UserError(f"--cuda-graphs needs --backend torch on a CUDA --device (got {backend} on {device})")

    ds = parse_draft_spec(draft) if need_draft else None
    if backend == "torch" and ds is not None and ds.mix:  # BASE+lookup[:N]: the model draft mixed with lookup
        models = open_engines(model, ds.text, export_dir, backend, device, o)
        models.draft = mixed_with_lookup(
            models.draft, models.target.info.vocab_size, ds.mix, f"--draft {draft}", ds.mix_kind
        )
        return models
    if backend == "torch":
        if not model:
            raise UserError("--backend torch needs --model NAME|PATH")
        if ds is not None and ds.kind in ("lookup", "suffix"):
            from arborspec.runtime.drafts.tables import table_draft

            models = _open_torch(model, None, device, need_draft=False, cuda_graphs=cuda_graphs, dtype=dtype)
            models.draft = table_draft(ds.kind, ds.arg, models.target.info.vocab_size)
            return models
        return _open_torch(model, ds, device, need_draft, cuda_graphs=cuda_graphs, dtype=dtype)
    if export_dir is None:
        raise UserError(f"--backend {backend} needs --export-dir DIR (make one with `arborspec export`)")
    if model:
        raise UserError(f"--model is for the torch backend; --backend {backend} reads --export-dir")
    from arborspec.runtime.export_dir import open_export

    return open_export(
        export_dir,
        backend,
        device,
        draft=(draft or "export") if need_draft else "none",
        engine_dir=engine_dir,
        verify=verify,
    )


def mixed_with_lookup(draft, vocab_size: int, max_ngram=3, what: str = "--draft BASE+lookup", table: str = "lookup"):
    """A model draft (DraftSource or engine) mixed with a lookup draft (runtime/drafts/mixed.py),
    or with the suffix draft (table "suffix", max_ngram its SuffixOptions); `what`: the option
    asking for it, for the error line."""
    from arborspec.runtime.drafts.mixed import LookupMixDraft
    from arborspec.runtime.drafts.model import as_draft_source
    from arborspec.runtime.drafts.tables import mixed_draft

    base = as_draft_source(draft)
    if isinstance(base, LookupMixDraft) or getattr(base, "proposes", False):
        raise UserError(f"{what}: the draft is already mixed with a table draft (--draft BASE+TABLE): use --tree")
    if base is None:
        raise UserError(f"{what}: there is no model draft to mix with {table}")
    return mixed_draft(base, table, max_ngram, vocab_size)


def _open_torch(model, ds, device: str, need_draft: bool, cuda_graphs: bool = False, dtype: str = "fp32") -> OpenModels:
    """ds: a parsed draft spec (runtime/drafts/spec.py) or None. cuda_graphs: the target and a
    model draft or EAGLE-3 head replay their calls as CUDA graphs (runtime/backends/cuda_graphs.py).
    dtype: the target's and a model draft's (an EAGLE-3 head runs in float32, its features cast up)."""
    import torch

    from arborspec.models.registry import load_model
    from arborspec.runtime.backends.torch_backend import TorchEngine

    tdtype = getattr(torch, DTYPES[dtype])

    loaded = load_model(model)
    kind = ds.kind if ds is not None else "none"
    if need_draft and kind == "eagle3":
        # an EAGLE-3 head reads the target's features: the target module must output them
        from arborspec.models.eagle3 import eagle3_folder, load_eagle3
        from arborspec.runtime.drafts.eagle3 import Eagle3Draft

        head = load_eagle3(eagle3_folder(ds.arg, str(model)), loaded.config)
        loaded.module.feature_layers = list(head.config.aux_layers)
        target = TorchEngine(loaded.module, device=device, dtype=tdtype, cuda_graphs=cuda_graphs)
        embed = loaded.module.model.embed_tokens.weight.detach().float()
        draft = Eagle3Draft(head, embed, device=device, cuda_graphs=cuda_graphs)
        return OpenModels(
            target, draft, loaded.tokenizer, describe=f"{model} + eagle3 (torch, {device})", source=loaded.source
        )
    target = TorchEngine(loaded.module, device=device, dtype=tdtype, cuda_graphs=cuda_graphs)
    draft = None
    if need_draft and kind != "none":
        from arborspec.export.export_folder import truncated_draft

        val = ds.arg
        if kind == "layers":
            draft = TorchEngine(
                truncated_draft(loaded.module, val), device=device, dtype=tdtype, cuda_graphs=cuda_graphs
            )
        elif kind == "bigram":
            draft = _bigram_from_target(target, loaded.source)
        elif kind == "model":
            d = load_model(val)
            if d.config.vocab_size != loaded.config.vocab_size:
                raise UserError(
                    f"draft vocabulary ({d.config.vocab_size}) differs from the target's ({loaded.config.vocab_size})"
                )
            draft = TorchEngine(d.module, device=device, dtype=tdtype, cuda_graphs=cuda_graphs)
        else:  # "export": an export folder's own draft
            raise UserError(f"--draft {ds.text}: the torch backend has no export folder; use --export-dir with it")
    return OpenModels(target, draft, loaded.tokenizer, describe=f"{model} (torch, {device})", source=loaded.source)


def models_key(args):
    """The tuned-tree key (runtime/tuned_tree.ModelsKey) of CLI-style model arguments."""
    from arborspec.runtime.tuned_tree import ModelsKey

    return ModelsKey(
        model=getattr(args, "model", None),
        draft=getattr(args, "draft", None),
        backend=getattr(args, "backend", None),
        device=getattr(args, "device", "cpu") or "cpu",
        export_dir=getattr(args, "export_dir", None),
    )


def resolved_config(models, args, asked, key=None):
    """runtime/decoder_config.resolve_config for CLI-style arguments: `asked` (a DecoderConfig)
    over the opened `models`, the tuned tree keyed by `key` (None: the arguments' own), at
    --temperature; a note on stderr when that tree was tuned on another backend."""
    import sys

    from arborspec.runtime.decoder_config import resolve_config
    from arborspec.runtime.tuned_tree import tuned_backend_note

    key = key or models_key(args)
    cfg = resolve_config(asked, models, key, getattr(args, "temperature", 0.0) or 0.0)
    note = tuned_backend_note(cfg.tree, key)
    if note:
        print(f"arborspec: note: {note}", file=sys.stderr)
    return cfg
