"""Backends behind one protocol: torch, onnxruntime, tensorrt (see base.Engine).

Each file backend is a loader and a runner (Polygraphy's shape): ort_loader.py (session, thread
pool, providers, graph) and onnxruntime.py's OrtEngine (with ort_layouts.py); trt_loader.py
(import, deserialisation, context, I/O) and tensorrt.py's TrtEngine / TrtProjection. Both
engines take (path, device, *, options); torch_backend.py's TorchEngine wraps a module.
"""

from .base import Engine, EngineInfo, check_call

__all__ = ["Engine", "EngineInfo", "check_call"]
