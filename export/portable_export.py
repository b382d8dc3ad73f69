"""Export one model as the portable graph (`--attention onnx`), a layer at a time.

Role in one decode step: none at run time; it writes the graph TensorRT builds into the engine
every call of a step runs. Steps, top to bottom (those of export/gqa_export.py, whose memory
estimate, reference module and prefix check it shares):

1. estimate the peak memory from the shapes and refuse, with one line, what cannot fit;
2. build the graph (export/portable_graph.PortableGraph), reading each tensor from its source
   when its initialiser is written, straight into `<model>.data` for a large model;
3. write the contract's metadata and run ONNX's checker on the saved file;
4. check the graph with ONNX Runtime against PyTorch on random tree steps: the whole model where it
   is small, else a graph of its first layers built by the same code from the same tensors (bf16:
   not run, ONNX Runtime's CPU has few bf16 kernels; as for the loaded-module export).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from arborspec.runtime.errors import InputError

from . import gqa_export
from .gqa_graph import ExternalDataSink, GraphOptions, save_model
from .onnx_files import ExportResult
from .portable_graph import PORTABLE_DTYPES, build_portable_model, portable_unsupported
from .preflight import DTYPE_BYTES, n_params

OPSET = 23


def export_portable(weights, path, spec: gqa_export.GQAExport) -> ExportResult:
    """Export a weights source (export/weights.py) to `path` as the "sbhd" contract graph."""
    cfg = weights.config
    why_not = portable_unsupported(cfg)
    if why_not:
        raise InputError(f"--attention onnx: {why_not} (use --stream off)")
    if spec.dtype not in PORTABLE_DTYPES:
        raise InputError(f"the portable graph writes fp32, fp16 or bf16 weights, not {spec.dtype}")
    if spec.quantize and spec.dtype == "bf16":
        raise InputError("--format qdq exports fp32 or fp16 activations, not bf16")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    max_context = int(spec.max_context or cfg.max_position)
    spec.topk = min(int(spec.topk or 0), cfg.vocab_size)
    spec.info["memory"] = gqa_export.check_memory(cfg, spec, cfg.name or path.name)
    qdq = qdq_lookup(weights, spec)
    ext, counts = _build_and_save(weights, path, spec, max_context, None, qdq)
    qinfo = None
    if qdq is not None:
        qinfo = {"scheme": spec.quantize, "format": "qdq", "block_size": spec.block_size, "zero_point": 0, **counts,
                 "source": "gguf-blocks" if hasattr(weights, "blocks") else "rtn-symmetric"}  # fmt: skip
    ir, nodes = _write_metadata(path, cfg, spec, bool(ext), qinfo)
    res = ExportResult(path=path, opset=OPSET, exporter="portable", dtype=spec.dtype, ir_version=ir, n_nodes=nodes,
                       external_data=ext, quantization=qinfo)  # fmt: skip
    if spec.verify and spec.dtype != "bf16":
        res.max_abs_diff = self_check(weights, path, spec, max_context, qdq)
    return res


def qdq_lookup(weights, spec):
    """hf_name -> export/qdq.QDQ | None for `--quantize int4|int8 --format qdq`, one weight at a time:
    a GGUF's own 32-wide Q4_0 / Q4_1 / Q8_0 blocks carried exactly, other weights (float, K-quants)
    blockwise symmetric round-to-nearest; a tied head stays float. None without --quantize."""
    if not spec.quantize:
        return None
    import numpy as np

    from .qdq import qdq_from_nbits, qdq_round_to_nearest

    bits = 4 if spec.quantize == "int4" else 8
    dtype = np.float16 if spec.dtype == "fp16" else np.float32
    if hasattr(weights, "blocks") and spec.block_size != 32:
        raise InputError("a GGUF's blocks are 32 wide: --block-size 32 (or quantise from float weights)")

    def lookup(name: str):
        if name == "lm_head.weight" and weights.config.tie_embeddings:
            return None  # the embedding's own weights, which the Gather needs in float (as export/qdq.py)
        try:
            nb = weights.linear(name)
            if nb is not None and nb.block == 32 and nb.source in ("gguf-q4_0", "gguf-q4_1", "gguf-q8_0"):
                return qdq_from_nbits(nb, max(bits, nb.bits), dtype)
        except InputError:
            pass  # blocks the QDQ form cannot hold exactly: rounded again from their float values
        return qdq_round_to_nearest(weights.get(name), bits, spec.block_size, dtype)

    return _memo(lookup)


def _memo(lookup):
    """The last few layers' blocks kept (the graph and its self-check ask for each twice)."""
    cache: dict = {}

    def cached(name: str):
        if name not in cache:
            if len(cache) > 8:
                cache.pop(next(iter(cache)))
            cache[name] = lookup(name)
        return cache[name]

    return cached


def _build_and_save(weights, path: Path, spec, max_context: int, n_layers: int | None, qdq=None):
    big = n_params(weights.config) * DTYPE_BYTES[spec.dtype] > gqa_export.STREAM_BYTES
    sink = ExternalDataSink(path) if big or n_layers is not None else None
    opts = GraphOptions(max_context, spec.topk, 0, spec.feature_layers, spec.dtype, spec.dtype, n_layers)
    try:
        model, counts = build_portable_model(weights, opts, sink, spec.progress and n_layers is None, qdq)
    finally:
        if sink is not None:
            sink.close()
    return save_model(model, path), counts


def _write_metadata(path: Path, cfg, spec, big: bool, qinfo: dict | None = None) -> tuple[int, int]:
    from arborspec.runtime.contract import META_FEATURE_LAYERS, META_QUANTIZATION

    from .onnx_files import contract_metadata, finalize

    meta = contract_metadata(
        cfg, spec.dtype, spec.tokenizer_sha256, spec.role, f"portable:opset{OPSET}", "sbhd", spec.topk
    )
    if spec.feature_layers:
        meta[META_FEATURE_LAYERS] = json.dumps([int(i) for i in spec.feature_layers])
    if qinfo:
        meta[META_QUANTIZATION] = json.dumps(qinfo, sort_keys=True)
    return finalize(path, meta, big)


def self_check(weights, path: Path, spec, max_context: int, qdq=None) -> float:
    """The largest difference from PyTorch on random tree steps (relative to the largest value for
    fp16): the whole graph where the model is small, else a graph of its first layers."""
    import torch

    from .onnx_export import verify_against_torch

    cfg = weights.config
    tdtype = torch.float16 if spec.dtype == "fp16" else torch.float32
    relative = spec.dtype == "fp16"
    if gqa_export.fp32_bytes(cfg) <= gqa_export.FULL_CHECK_BYTES:
        module = gqa_export.reference_module(weights, cfg.n_layers, qdq).to(tdtype)
        module.feature_layers = spec.feature_layers
        diff = verify_against_torch(module, path, cfg, tdtype, relative=relative)
    else:
        k = min(gqa_export.PREFIX_LAYERS, cfg.n_layers)
        module = gqa_export.reference_module(weights, k, qdq).to(tdtype)
        inside = [i for i in spec.feature_layers or [] if i < k] or None
        module.feature_layers = inside
        prefix = gqa_export.GQAExport(**{**spec.__dict__, "info": {}, "feature_layers": inside})
        with tempfile.TemporaryDirectory(prefix="arborspec-check-") as tmp:
            sub = Path(tmp) / "prefix.onnx"
            _build_and_save(weights, sub, prefix, max_context, k, qdq)
            _write_metadata(sub, module.config, prefix, True)
            diff = verify_against_torch(module, sub, module.config, tdtype, relative=relative)
    tol = spec.tolerance if spec.tolerance is not None else (5e-2 if relative else 1e-2)
    if not diff <= tol:
        what = "relative to the largest value, " if relative else ""
        raise RuntimeError(
            f"{path.name}: ONNX Runtime differs from PyTorch by {diff:.3g} ({what}> {tol:g}) on random tree steps"
        )
    return diff
