"""arborspec: tree speculative decoding with ONNX / TensorRT engines and an embeddable runtime.

The sub-packages live in top-level folders of the repository and are mapped here by
setuptools: arborspec.models (PyTorch reference decoders, loaders), arborspec.export (ONNX,
TensorRT engine build), arborspec.runtime (tree, accept, KV cache, backends), arborspec.tools
(CLI, comparisons, benchmarks).
"""
__version__ = "0.1.0"
CONTRACT_VERSION = 1
