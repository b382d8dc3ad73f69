"""arborspec.runtime: the embeddable decoding runtime (tree, drafts, accept, KV cache, backends).

Imports torch (and, lazily, onnxruntime / tensorrt / tokenizers / safetensors); never onnx,
polygraphy, transformers, arborspec.models or arborspec.export. Main entry points:
`decode.SpeculativeDecoder`, `export_dir.load_export_dir`, `sampling.SamplingParams`,
`trees.parse_tree_spec`. A SpeculativeDecoder runs one sequence at a time (B = 1); use one
decoder per thread.
"""
