"""arborspec: tree speculative decoding with ONNX / TensorRT engines and an embeddable runtime.

The sub-packages live in top-level folders of the repository and are mapped here by
setuptools: arborspec.models (PyTorch reference decoders, loaders), arborspec.export (ONNX,
TensorRT engine build), arborspec.runtime (tree, accept, KV cache, backends), arborspec.tools
(CLI, comparisons, benchmarks).

The embedding API: `arborspec.Generator` (runtime/generator.py), `arborspec.open_export`.
"""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing arborspec stays cheap
    if name == "CONTRACT_VERSION":
        from arborspec.runtime.contract import CONTRACT_VERSION

        return CONTRACT_VERSION
    if name in ("Generator", "Completion"):
        from arborspec.runtime import generator

        return getattr(generator, name)
    if name in ("open_export", "OpenedExport"):
        from arborspec.runtime import export_dir

        return getattr(export_dir, name)
    if name == "enable_shared_pool":
        from arborspec.runtime.backends.ort_loader import enable_shared_pool

        return enable_shared_pool
    if name in ("ArborspecError",):
        from arborspec.runtime import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'arborspec' has no attribute {name!r}")
