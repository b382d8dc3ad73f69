"""Memory pre-flights: refuse, with one line and before any work, an export or an engine build
that the memory available cannot hold.

Role in one decode step: none at run time. Every path that writes a graph or an engine asks
here first (the GroupQueryAttention path asks export/gqa_export.check_memory, whose estimate is
its own): the loaded-module exports (the whole model in fp32, then torch.onnx.export's copy),
the streamed portable graph (export/portable_graph.py) and `arborspec build` (TensorRT's parser
and builder hold the ONNX's weights several times over). "Available" is MemAvailable of
/proc/meminfo, or ARBORSPEC_EXPORT_MEMORY_GB (runtime/settings.py) where it is set.

The factors are measured (benchmarks/RESULTS.md, "The TensorRT path at 1B-8B"), not derived:
the peak resident memory of each path over its weights' bytes on a Llama-3.2-1B-shaped
checkpoint, rounded up (the estimates are 5-20 % above the measured peaks).
"""

from __future__ import annotations

from pathlib import Path

from arborspec.runtime.errors import InputError

GIB = 1024**3
BASE_BYTES = GIB // 2  # Python, torch, onnx and the tokenizer
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# torch.onnx.export of a loaded module: the fp32 module, its cast copy and the exported program's
# initialisers (7.07 GiB at the 1B shape in fp16, 1.07B parameters: 6.6 bytes a parameter + the base)
LOADED_BYTES_PER_PARAM_FP32 = 4
# TensorRT-RTX's build of an ONNX: the builder's own two copies of the weights (converted, and the
# serialized engine's); the graph's mapped pages are given back as it goes (export/trt_weights.py).
# 4.24 GiB for a 2.0 GiB fp16 graph at the 1B shape (1.87x + the base; 6.7 GiB before)
BUILD_FACTOR = 2.0
ENV = "ARBORSPEC_EXPORT_MEMORY_GB"


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none), or ARBORSPEC_EXPORT_MEMORY_GB."""
    from .gqa_export import available_bytes as available

    return available()


def n_params(cfg) -> int:
    layer, heads = cfg.weight_counts()
    return cfg.n_layers * layer + heads


def loaded_export_bytes(cfg, dtype: str) -> int:
    """Peak of an export from a loaded module (torch.onnx.export, or the GroupQueryAttention graph
    of a module): the fp32 module, a copy in the graph's dtype, and one more for the self-check."""
    n = n_params(cfg)
    return BASE_BYTES + n * (LOADED_BYTES_PER_PARAM_FP32 + 2 * DTYPE_BYTES.get(dtype, 4))


def refuse(doing: str, need: int, parts: str, fix: str) -> None:
    """Raise the one-line refusal when `need` bytes exceed what is available."""
    have = available_bytes()
    if have is not None and need > have:
        raise InputError(
            f"{doing} needs about {need / GIB:.1f} GB of memory ({parts}) but {have / GIB:.2f} GB is "
            f"available ({ENV} or MemAvailable): {fix} (nothing was written)"
        )


def check_loaded_export(cfg, dtype: str, what: str) -> int:
    """Refuse, before the model is loaded, an export from a loaded module that cannot fit."""
    need = loaded_export_bytes(cfg, dtype)
    refuse(
        f"exporting {what} from the loaded model",
        need,
        f"{n_params(cfg) / 1e9:.2f}B parameters in fp32 plus two {dtype} copies",
        "free memory, export a Hugging Face folder or GGUF that streams (--stream on), "
        "or export on a machine with more",
    )
    return need


def onnx_weight_bytes(onnx_path: str | Path) -> int:
    """The bytes of an ONNX graph and its external data files (what TensorRT's parser reads)."""
    p = Path(onnx_path)
    files = [p, *p.parent.glob(p.name + "*.data")]
    return sum(f.stat().st_size for f in files if f.is_file())


def build_bytes(onnx_path: str | Path) -> int:
    return BASE_BYTES + int(BUILD_FACTOR * onnx_weight_bytes(onnx_path))


def check_build(onnx_paths: list, what: str) -> int:
    """Refuse, before TensorRT is imported, an engine build that cannot fit (the largest graph:
    the engines are built one after another)."""
    if not onnx_paths:
        return 0
    biggest = max(onnx_paths, key=onnx_weight_bytes)
    need = build_bytes(biggest)
    refuse(
        f"building the engine of {what}/{Path(biggest).name}",
        need,
        f"{BUILD_FACTOR:g}x its {onnx_weight_bytes(biggest) / GIB:.2f} GB of ONNX weights: TensorRT's builder "
        "holds them twice",
        "free memory, or build on a machine with more",
    )
    return need
