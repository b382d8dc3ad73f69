"""Polygraphy runners for `arborspec compare`: the PyTorch reference module (Polygraphy's own
PytRunner is unusable in 0.53), ONNX Runtime with a progress hook, and a TensorRT engine through
the runtime's TrtEngine. This module imports Polygraphy: comparison.py imports it when a
comparison runs (or a runner is asked for), so the rest of arborspec runs without Polygraphy.

Role in one decode step: none; each runner runs one recorded call of a step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from arborspec.runtime import contract as C

try:
    from polygraphy.backend.base import BaseRunner
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.common import TensorMetadata
    from polygraphy.datatype import DataType
except ImportError as e:  # pragma: no cover - environment
    raise ImportError("arborspec compare needs polygraphy: pip install 'arborspec[export]'") from e


def _feed_on_cache(feed_dict, spec, dev):
    """A contract feed on a runtime engine: (ids, pos, mask, cache) with the feed's past K/V
    ([P, B, Hkv, D] per layer) written into a KVCache of the engine's layout, length P."""
    from arborspec.runtime.kvcache import KVCache

    ids = torch.from_numpy(np.asarray(feed_dict[C.INPUT_IDS])).to(dev)
    pos = torch.from_numpy(np.asarray(feed_dict[C.POSITION_IDS])).to(dev)
    mask = torch.from_numpy(np.asarray(feed_dict[C.ATTENTION_MASK])).to(dev)
    b, t = ids.shape
    p = mask.shape[2] - t
    cache = KVCache(spec, p + t, b, dev)
    if p:
        past = [
            [torch.from_numpy(np.asarray(feed_dict[f(i)])).to(dev, spec.dtype) for i in range(spec.n_layers)]
            for f in (C.past_key, C.past_value)
        ]
        cache.write_tail(torch.stack(past[0]), torch.stack(past[1]))
    cache.length = p
    return ids, pos, mask, cache


def _contract_meta(n_layers: int, kv_dtype) -> TensorMetadata:
    """The contract's inputs as Polygraphy metadata (the K/V in `kv_dtype`)."""
    meta = TensorMetadata()
    meta.add(C.INPUT_IDS, DataType.INT64, ["B", "T"])
    meta.add(C.POSITION_IDS, DataType.INT64, ["B", "T"])
    meta.add(C.ATTENTION_MASK, DataType.BOOL, ["B", "T", "PT"])
    kv = DataType.from_dtype(np.dtype(kv_dtype))
    for i in range(n_layers):
        meta.add(C.past_key(i), kv, ["P", "B", "H", "D"])
        meta.add(C.past_value(i), kv, ["P", "B", "H", "D"])
    return meta


class TorchRunner(BaseRunner):
    """A contract nn.Module as a Polygraphy runner (fp32 reference; feeds and outputs in
    the graph's K/V dtype)."""

    def __init__(self, module, kv_dtype=np.float32, name=None, on_infer: Callable | None = None):
        super().__init__(name=name, prefix="torch-runner")
        self.module, self.kv_dtype, self.on_infer = module, np.dtype(kv_dtype), on_infer

    def activate_impl(self):
        self.module = self.module.float().eval()

    def get_input_metadata_impl(self):
        return _contract_meta(self.module.config.n_layers, self.kv_dtype)

    def infer_impl(self, feed_dict):
        n = self.module.config.n_layers
        dev = next(self.module.parameters()).device
        args = [
            torch.from_numpy(np.asarray(feed_dict[k])).to(dev)
            for k in (C.INPUT_IDS, C.POSITION_IDS, C.ATTENTION_MASK)
        ]
        for i in range(n):
            for name in (C.past_key(i), C.past_value(i)):
                args.append(torch.from_numpy(np.asarray(feed_dict[name], dtype=np.float32)).to(dev))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.module(*args)
        self.inference_time = time.perf_counter() - t0
        res = OrderedDict()
        res[C.LOGITS] = np.ascontiguousarray(out[0].float().cpu().numpy())
        for i in range(n):
            res[C.new_key(i)] = np.ascontiguousarray(out[1 + 2 * i].float().cpu().numpy().astype(self.kv_dtype))
            res[C.new_value(i)] = np.ascontiguousarray(out[2 + 2 * i].float().cpu().numpy().astype(self.kv_dtype))
        if len(out) > 1 + 2 * n:  # the target features an EAGLE-3 draft reads
            res[C.HIDDEN_STATES] = np.ascontiguousarray(out[1 + 2 * n].float().cpu().numpy())
        if self.on_infer:
            self.on_infer()
        return res

class OrtRunner(OnnxrtRunner):
    """Polygraphy's OnnxrtRunner with a progress callback."""

    def __init__(self, sess, name=None, on_infer: Callable | None = None):
        super().__init__(sess, name=name)
        self.on_infer = on_infer

    def infer_impl(self, feed_dict):
        out = super().infer_impl(feed_dict)
        if self.on_infer:
            self.on_infer()
        return out

class EngineRunner(BaseRunner):
    """A runtime engine (TrtEngine, or OrtEngine for ONNX Runtime's in-place "bhsd" graphs)
    as a Polygraphy runner: the feed's past K/V go into a runtime KVCache of the engine's
    layout, the engine writes the new K/V there, and they come back in the contract's
    [T, B, Hkv, D] form, comparable with the PyTorch reference."""

    def __init__(
        self,
        factory: Callable,
        kv_dtype=np.float32,
        name=None,
        on_infer: Callable | None = None,
        sync: bool = False,
    ):
        super().__init__(name=name, prefix="engine-runner")
        self.factory, self.kv_dtype, self.on_infer, self.sync = factory, np.dtype(kv_dtype), on_infer, sync

    def activate_impl(self):
        self.engine = self.factory()

    def get_input_metadata_impl(self):
        return _contract_meta(self.engine.info.cache.n_layers, self.kv_dtype)

    def infer_impl(self, feed_dict):
        eng = self.engine
        spec = eng.info.cache
        ids, pos, mask, cache = _feed_on_cache(feed_dict, spec, eng.device)
        t = ids.shape[1]
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        feats = None
        if getattr(eng.info, "n_features", 0):
            logits, feats = eng.forward_features(ids, pos, mask, cache)
        else:
            logits = eng.forward(ids, pos, mask, cache)
        if self.sync:
            torch.cuda.synchronize()
        self.inference_time = time.perf_counter() - t0
        res = OrderedDict({C.LOGITS: np.ascontiguousarray(logits.float().cpu().numpy())})
        if feats is not None:
            res[C.HIDDEN_STATES] = np.ascontiguousarray(feats.float().cpu().numpy())
        for i in range(spec.n_layers):
            k, v = cache.tail(i, t)
            res[C.new_key(i)] = np.ascontiguousarray(k.float().cpu().numpy().astype(self.kv_dtype))
            res[C.new_value(i)] = np.ascontiguousarray(v.float().cpu().numpy().astype(self.kv_dtype))
        if self.on_infer:
            self.on_infer()
        return res

    def deactivate_impl(self):
        self.engine.close()
        del self.engine

def TrtEngineRunner(engine_path, kv_dtype=np.float32, name=None, on_infer: Callable | None = None):
    """A built TensorRT engine through runtime.backends.tensorrt.TrtEngine (the runtime's own
    bindings: past K/V bound by address, new K/V written onto the cache tail)."""
    from arborspec.runtime.backends.tensorrt import TrtEngine

    return EngineRunner(lambda: TrtEngine(Path(engine_path), device="cuda"), kv_dtype, name, on_infer, sync=True)

def OrtEngineRunner(onnx_path, kv_dtype=np.float32, name=None, on_infer: Callable | None = None):
    """An ONNX graph through the runtime's OrtEngine (needed for "bhsd" graphs, whose past
    inputs are whole cache slabs bound to the outputs)."""
    from arborspec.runtime.backends.onnxruntime import OrtEngine

    return EngineRunner(lambda: OrtEngine(Path(onnx_path)), kv_dtype, name, on_infer)

class Eagle3HeadRunner(BaseRunner):
    """An EAGLE-3 head engine (TorchEagle3Head, OrtEagle3Head) as a Polygraphy runner: the
    feed's target features go through the head's projection (`draft_fc.onnx`), then one
    `forward_hidden` call (`draft.onnx`) over the feed's past; outputs the projected hidden
    input, the logits over the draft vocabulary, the output hidden state and the new K/V."""

    def __init__(self, factory: Callable, name=None, on_infer: Callable | None = None):
        super().__init__(name=name, prefix="eagle3-runner")
        self.factory, self.on_infer = factory, on_infer

    def activate_impl(self):
        self.engine = self.factory()

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for k in (C.INPUT_IDS, C.POSITION_IDS):
            meta.add(k, DataType.INT64, ["B", "T"])
        meta.add(C.TARGET_FEATURES, DataType.FLOAT32, ["T", "F"])
        meta.add(C.ATTENTION_MASK, DataType.BOOL, ["B", "T", "PT"])
        meta.add(C.past_key(0), DataType.FLOAT32, ["P", "B", "H", "D"])
        meta.add(C.past_value(0), DataType.FLOAT32, ["P", "B", "H", "D"])
        return meta

    def infer_impl(self, feed_dict):
        eng = self.engine
        ids, pos, mask, cache = _feed_on_cache(feed_dict, eng.info.cache, eng.device)
        t = ids.shape[1]
        t0 = time.perf_counter()
        hidden = eng.project(torch.from_numpy(np.asarray(feed_dict[C.TARGET_FEATURES])).to(eng.device).float())
        logits, out = eng.forward_hidden(ids, hidden[None], pos, mask, cache)
        self.inference_time = time.perf_counter() - t0
        k, v = cache.tail(0, t)
        res = OrderedDict()
        for name, x in (
            (C.HIDDEN_IN, hidden),
            (C.LOGITS, logits),
            (C.HIDDEN_STATES, out),
            (C.new_key(0), k),
            (C.new_value(0), v),
        ):
            res[name] = np.ascontiguousarray(x.float().cpu().numpy())
        if self.on_infer:
            self.on_infer()
        return res
