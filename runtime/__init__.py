"""arborspec.runtime: the embeddable decoding runtime (tree, drafts, accept, KV cache, backends).

The public names (`__all__`), each imported on first use, so `import arborspec.runtime` costs
nothing and loads neither torch nor onnxruntime:

- `Generator` (runtime/generator.py): text in, text out; `Generator.from_export(dir)` opens an
  export folder and picks the decoder; `Completion` is what it returns.
- `open_export` (runtime/export_dir.py) -> `OpenedExport`: an export folder's target engine,
  draft source and tokenizer on any backend (onnxruntime, tensorrt, torch).
- `SpeculativeDecoder` (runtime/decode.py): token ids in and out, one sequence at a time (use
  one decoder per thread); `BatchDecoder` (runtime/batch_decode.py): B sequences, one verify
  call a step. Both run the steps of runtime/step.py and are configured by a `DecoderConfig`
  (mode, tree, candidates, node limit, prefix reuse).
- `SamplingParams` (runtime/sampling.py) and `GenerationRequest` (runtime/request.py): what one
  call asks for; `GenerationResult`: its tokens, stats and stop reason.
- `EngineBase` (runtime/backends/base.py): the engine a backend implements (`OrtEngine`,
  `TrtEngine`, `TorchEngine` in runtime/backends/), with `EngineInfo`, `EngineCapabilities`.
- The errors (runtime/errors.py): `ArborspecError` (a ValueError, one line) and its kinds.

Imports torch (and, lazily, onnxruntime / tensorrt / tokenizers / safetensors); never onnx,
polygraphy, transformers, arborspec.models or arborspec.export.
"""

from importlib import import_module

# public name -> the module (under arborspec.runtime) that defines it
_WHERE = {
    "Generator": "generator",
    "Completion": "generator",
    "open_export": "export_dir",
    "OpenedExport": "export_dir",
    "SpeculativeDecoder": "decode",
    "BatchDecoder": "batch_decode",
    "DecoderConfig": "decoder_config",
    "SamplingParams": "sampling",
    "GenerationRequest": "request",
    "GenerationResult": "request",
    "EngineBase": "backends.base",
    "EngineInfo": "backends.base",
    "EngineCapabilities": "backends.base",
    "ArborspecError": "errors",
    "InputError": "errors",
    "TreeSpecError": "errors",
    "ExportDirError": "errors",
    "MissingFileError": "errors",
    "EngineError": "errors",
    "DeviceError": "errors",
    "NumericalError": "errors",
    "OutputError": "errors",
}

__all__ = list(_WHERE)


def __getattr__(name):  # lazy: importing arborspec.runtime stays cheap
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'arborspec.runtime' has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{where}"), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
