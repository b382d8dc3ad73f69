"""Backends behind one protocol: torch, onnxruntime, tensorrt (see base.Engine)."""

from .base import Engine, EngineInfo, check_call

__all__ = ["Engine", "EngineInfo", "check_call"]
