"""Export one model as ONNX Runtime's GroupQueryAttention graph, a layer at a time.

Role in one decode step: none at run time; it writes the graph that every verify call (the
target) or draft level (a layer-truncated draft) runs on ONNX Runtime. Steps, top to bottom:

1. estimate the peak memory from the shapes and refuse, with one line, what cannot fit;
2. pick the linear layers' weights: float, the GGUF's own blocks (Q4_0/Q4_1/Q8_0 and the K-quants,
   exactly: export/quantize.py), or ONNX Runtime's blockwise round-to-nearest of float weights,
   one weight at a time (the same kernel and the same blocks as its MatMulNBitsQuantizer);
3. build the graph (export/gqa_graph.GQAGraph), reading each tensor from its source when its
   initialiser is written, straight into `<model>.data` for a large model;
4. write the contract's metadata and run ONNX's checker on the saved file;
5. check the graph against PyTorch on random steps: the whole model where it is small, else the
   first layers (a graph of that prefix, built by the same code from the same tensors).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from arborspec.runtime.errors import InputError

from . import gqa_graph, row_pad
from .onnx_files import ExportResult
from .weights import ModuleWeights

GIB = 1024**3
FULL_CHECK_BYTES = 2 * GIB  # a model under this (fp32) is checked whole; above it, a prefix of layers
PREFIX_LAYERS = 2
STREAM_BYTES = GIB  # weights above this go straight to external data as they are written
BASE_BYTES = GIB // 2  # Python, torch, ONNX Runtime and the tokenizer


@dataclass
class GQAExport:
    """What to export besides the weights (the `arborspec export` flags that reach the graph)."""

    dtype: str = "fp32"
    quantize: str | None = None  # None, "int4" or "int8"
    block_size: int = 32
    accuracy_level: int = 0
    kv_dtype: str = "fp32"
    topk: int = 0
    feature_layers: list[int] | None = None
    max_context: int | None = None
    verify: bool = True
    tolerance: float | None = None
    tokenizer_sha256: str | None = None
    role: str = ""
    gguf_path: str | None = None  # a module's GGUF, whose blocks the int4 export carries
    progress: bool = False
    info: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.dtype not in gqa_graph.GQA_DTYPES:
            raise InputError(
                f"--attention gqa exports {' or '.join(gqa_graph.GQA_DTYPES)} (got {self.dtype}); "
                f"use --attention onnx for {self.dtype}"
            )
        if self.kv_dtype not in gqa_graph.KV_DTYPES:
            raise InputError(f"unknown --kv-dtype {self.kv_dtype!r} (expected one of {', '.join(gqa_graph.KV_DTYPES)})")
        if self.quantize not in (None, "int4", "int8"):
            raise InputError(f"unknown --quantize {self.quantize!r} (expected int4 or int8)")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise InputError(f"--block-size must be 16, 32, 64, 128 or 256, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise InputError(f"--accuracy-level must be 0..4, got {self.accuracy_level}")


# -- 1. memory -----------------------------------------------------------------------------------
def estimate_peak_bytes(cfg, spec: GQAExport) -> dict[str, int]:
    """The export's peak resident memory from the shapes alone (bytes), and its parts."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * h
    largest = max(qkv, 2 * inter * h, h * inter) * 4  # the widest product, fp32
    embed = cfg.vocab_size * h * 4
    layer, heads = (4 * n for n in cfg.weight_counts())
    build = 3 * largest + 2 * embed  # read + transposed/concatenated + quantised; the embedding + its cast
    full = fp32_bytes(cfg)
    checked = full if full <= FULL_CHECK_BYTES else heads + PREFIX_LAYERS * layer
    check = 2 * checked  # the PyTorch reference and ONNX Runtime's session
    return {"peak": BASE_BYTES + max(build, check), "largest_layer": largest, "embeddings": heads, "check": check}


def fp32_bytes(cfg) -> int:
    layer, heads = cfg.weight_counts()
    return 4 * (cfg.n_layers * layer + heads)


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none), or ARBORSPEC_EXPORT_MEMORY_GB."""
    from arborspec.runtime import settings

    limit = settings.number("ARBORSPEC_EXPORT_MEMORY_GB")
    if limit:
        return int(limit * GIB)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(cfg, spec: GQAExport, what: str) -> dict[str, int]:
    """Refuse, before any work, an export that cannot fit in the memory available."""
    est = estimate_peak_bytes(cfg, spec)
    have = available_bytes()
    if have is not None and est["peak"] > have:
        raise InputError(
            f"exporting {what} needs about {est['peak'] / GIB:.1f} GB of memory (largest layer "
            f"{est['largest_layer'] / GIB:.2f} GB in fp32, embeddings {est['embeddings'] / GIB:.2f} GB, "
            f"self-check {est['check'] / GIB:.2f} GB) but {have / GIB:.2f} GB is available "
            "(ARBORSPEC_EXPORT_MEMORY_GB or MemAvailable): free memory, "
            "or export on a machine with more (nothing was written)"
        )
    return est


# -- 2. linear layers ----------------------------------------------------------------------------
def rtn_nbits(w_out_in: np.ndarray, bits: int, block: int):
    """ONNX Runtime's blockwise round-to-nearest (asymmetric, its C++ kernel) of one float weight
    [N, K] -> NBits: the blocks its MatMulNBitsQuantizer writes for the same MatMul."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    from .quantize import NBits

    n, k = w_out_in.shape
    if k % block:
        raise InputError(f"input size {k} is not a multiple of --block-size {block}")
    kb, per_byte = k // block, 8 // bits
    w = np.ascontiguousarray(w_out_in.T.astype(np.float32))  # [K, N] as the MatMul holds it
    packed = np.zeros((n, kb, block // per_byte), np.uint8)
    zp = np.zeros((n, (kb + per_byte - 1) // per_byte), np.uint8)
    scales = np.zeros((n, kb), np.float32)
    quantize = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    quantize(packed, w, scales, zp, block, n, k, False)
    return NBits(packed, scales.reshape(-1), zp.reshape(-1), bits, n, k, "onnxruntime-rtn", None, block)


def pick_linears(weights, spec: GQAExport):
    """(hf_name -> NBits | None, the manifest's quantization entry) for the export's weights."""
    if not spec.quantize:
        return None, None
    bits = 4 if spec.quantize == "int4" else 8
    carried = _carried_blocks(weights, spec) if bits == 4 else None
    info = {"scheme": spec.quantize, "format": "matmulnbits", "accuracy_level": spec.accuracy_level}
    if carried is not None:
        if spec.block_size != 32:
            raise InputError("a GGUF's blocks are 32 wide: --block-size 32 (or quantise from float weights)")
        counts: dict = {}
        errors: dict = {}  # requantised layers: max |w' - w| / max |w|
        seen: set = set()

        def linears(name):
            try:
                q = carried(name)
            except InputError:  # a type MatMulNBits cannot hold (Q5_0, Q2_K, IQ4_XS ...): requantised
                w = weights.get(name)
                q = rtn_nbits(w, 4, 32)
                q.source = "requantised-from-gguf"
                err = float(np.abs(q.dequantize() - w).max() / max(float(np.abs(w).max()), 1e-30))
                errors[name] = err
            if q is not None and name not in seen:  # once per layer (the self-check asks again)
                seen.add(name)
                counts[q.source] = counts.get(q.source, 0) + 1
            return q

        return linears, {**info, "block_size": 32, "source": "gguf-blocks", "layers_by_source": counts,
                         "requantised_max_rel_error": errors}  # fmt: skip

    def rtn(name):
        if name == "lm_head.weight":
            return None  # the head stays float (a Gemm), as ONNX Runtime's quantiser leaves it
        return rtn_nbits(weights.get(name), bits, spec.block_size)

    return rtn, {**info, "block_size": spec.block_size, "source": "onnxruntime-rtn"}


def _carried_blocks(weights, spec: GQAExport):
    if hasattr(weights, "blocks"):  # a GGUF source (export/weights.GGUFWeights)
        return weights.linear
    if spec.gguf_path:  # a module loaded from a GGUF
        from .quantize import GGUFBlocks

        cfg = weights.config
        return GGUFBlocks(spec.gguf_path, cfg.n_heads, cfg.n_kv_heads).linear
    return None


# -- 3.-5. the export ----------------------------------------------------------------------------
def export_gqa(weights, path: str | os.PathLike, spec: GQAExport):
    """Export `weights` (export/weights.py, or a module) to `path`; returns an ExportResult."""
    spec.validate()
    weights = weights if hasattr(weights, "release") else ModuleWeights(weights.float().eval())
    cfg = weights.config
    why_not = gqa_graph.gqa_unsupported(cfg, spec.dtype)
    if why_not:
        raise InputError(f"--attention gqa: {why_not} (use --attention onnx)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    max_context = int(spec.max_context or cfg.max_position)
    spec.topk = min(int(spec.topk or 0), cfg.vocab_size)
    spec.info["memory"] = check_memory(cfg, spec, cfg.name or path.name)
    linears, qinfo = pick_linears(weights, spec)
    ext = _build_and_save(weights, path, spec, linears, max_context)
    ir, nodes = _write_metadata(path, cfg, spec, ext)
    res = ExportResult(
        path=path, opset=gqa_graph.OPSET, exporter="gqa", dtype=spec.dtype, ir_version=ir, n_nodes=nodes,
        external_data=ext, quantization=qinfo, kv_dtype=spec.kv_dtype if spec.kv_dtype != spec.dtype else None,
    )  # fmt: skip
    if spec.verify:
        res.max_abs_diff = _self_check(weights, path, spec, linears, max_context, qinfo)
    return res


def _build_and_save(weights, path: Path, spec: GQAExport, linears, max_context: int):
    big = fp32_bytes(weights.config) * (0.5 if spec.dtype == "fp16" else 1) > STREAM_BYTES
    sink = gqa_graph.ExternalDataSink(path) if big else None
    try:
        model = _build(weights, spec, linears, max_context, sink, None)
    finally:
        if sink is not None:
            sink.close()
    ext = gqa_graph.save_model(model, path)
    return ext


def _build(weights, spec: GQAExport, linears, max_context: int, sink, n_layers):
    opts = gqa_graph.GraphOptions(
        max_context, spec.topk, spec.accuracy_level, spec.feature_layers, spec.kv_dtype, spec.dtype, n_layers,
        pad_row=row_pad.pads_rows_for(weights.config, spec.accuracy_level, spec.dtype),
    )
    return gqa_graph.GQAGraph(weights, opts, linears, sink, progress=spec.progress and n_layers is None).build()


def _write_metadata(path: Path, cfg, spec: GQAExport, ext: list[str]) -> tuple[int, int]:
    from arborspec.runtime.contract import META_FEATURE_LAYERS, META_PAD_ROW, META_RAGGED_ROWS

    from .onnx_files import contract_metadata, finalize

    kv = spec.kv_dtype if spec.dtype == "fp32" else spec.dtype
    meta = contract_metadata(
        cfg, spec.dtype, spec.tokenizer_sha256, spec.role, f"gqa:opset{gqa_graph.OPSET}", "bhsd", spec.topk, kv_dtype=kv
    )
    if spec.feature_layers:
        meta[META_FEATURE_LAYERS] = json.dumps([int(i) for i in spec.feature_layers])
    meta[META_RAGGED_ROWS] = "1"  # seqlens_k from the mask (gqa_graph.attention_inputs)
    if row_pad.pads_rows_for(cfg, spec.accuracy_level, spec.dtype):
        meta[META_PAD_ROW] = "1"  # one dummy attention row in one-token calls (export/row_pad.py)
    return finalize(path, meta, bool(ext))


def _self_check(weights, path: Path, spec: GQAExport, linears, max_context: int, qinfo) -> float:
    """The largest difference from PyTorch on random steps: the whole graph (a small model) or a
    graph of its first PREFIX_LAYERS layers beside a PyTorch module of the same (a large one)."""
    cfg = weights.config
    relative = spec.kv_dtype == "fp16" or spec.dtype == "fp16"
    whole = fp32_bytes(cfg) <= FULL_CHECK_BYTES
    if whole and isinstance(weights, ModuleWeights) and linears is None:
        diff = gqa_graph.verify_gqa_against_torch(weights.module, path, relative=relative)
    elif whole:
        diff = gqa_graph.verify_gqa_against_torch(reference_module(weights, cfg.n_layers, linears), path, relative=relative)
    else:
        k = min(PREFIX_LAYERS, cfg.n_layers)
        module = reference_module(weights, k, linears)
        with tempfile.TemporaryDirectory(prefix="arborspec-check-") as tmp:
            sub = Path(tmp) / "prefix.onnx"
            inside = [i for i in spec.feature_layers or [] if i < k]  # the prefix's own features
            prefix_spec = GQAExport(**{**spec.__dict__, "info": {}, "feature_layers": inside or None})
            sink = gqa_graph.ExternalDataSink(sub)
            try:
                model = _build(weights, prefix_spec, linears, max_context, sink, k)
            finally:
                sink.close()
            gqa_graph.save_model(model, sub)
            del model
            _write_metadata(sub, module.config, prefix_spec, [])
            diff = gqa_graph.verify_gqa_against_torch(module, sub, relative=relative)
    tol = spec.tolerance if spec.tolerance is not None else _tolerance(spec, qinfo)
    if not diff <= tol:
        what = "relative to the largest value, " if relative else ""
        raise RuntimeError(f"{path.name}: ONNX Runtime differs from PyTorch by {diff:.3g} ({what}> {tol:g}) on random steps")
    return diff


def _tolerance(spec: GQAExport, qinfo) -> float:
    # the reference holds the weights the blocks compute with: fp32 tolerance with float
    # activations; int8 activations (accuracy level 4) round x: a loose bound only
    if spec.dtype == "fp16":
        return 5e-2
    return 1e-2 if spec.accuracy_level == 0 else 5.0


def reference_module(weights, n_layers: int, linears=None):
    """A PyTorch module of the first n_layers layers (final norm and head kept) from `weights`,
    its linear layers holding the weights the graph's blocks compute with (`linears`); filled a
    tensor at a time (one transient copy beside the module, never a second model)."""
    import torch

    from arborspec.models import build_model

    cfg = weights.config if n_layers == weights.config.n_layers else weights.config.truncated(n_layers)
    module = build_model(cfg)

    def tensor(name):
        q = linears(name) if linears is not None and (name.endswith("_proj.weight") or name == "lm_head.weight") else None
        if q is not None:
            return q.dequantize()
        if name == "lm_head.weight" and cfg.tie_embeddings and not weights.has(name):
            name = "model.embed_tokens.weight"
        return weights.get(name)

    with torch.no_grad():
        for name, p in module.state_dict(keep_vars=True).items():
            p.copy_(torch.from_numpy(tensor(name)))
        weights.release()
    return module.float().eval()
