"""ONNX Runtime's fast graph (export/gqa_graph.py: GroupQueryAttention reading and writing the
cache in place, kv layout "bhsd") against the portable graph and PyTorch: same logits and K/V for
prefills (P = 0), long pasts and random trees up to 65 tokens; after many tree steps the cache
equals a fresh prefill; TensorRT refuses it with one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from conftest import random_model, tiny_config, truncated  # noqa: E402

from arborspec.export.onnx_export import export_contract_onnx, export_gqa_onnx  # noqa: E402
from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402
from arborspec.runtime.errors import ArborspecError  # noqa: E402
from arborspec.runtime.kvcache import KVCache  # noqa: E402

CONFIGS = {
    "gqa-tied": tiny_config("llama", vocab=80, layers=2, hidden=64, heads=4, kv=2),
    "mha-untied-bias": dataclasses.replace(
        tiny_config("llama", vocab=70, layers=2, hidden=64, heads=4, kv=4), tie_embeddings=False, attention_bias=True
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def engines(request, tmp_path_factory):
    m = random_model(CONFIGS[request.param], seed=11)
    d = tmp_path_factory.mktemp("gqa")
    export_gqa_onnx(m, d / "fast.onnx", max_context=512, verify=True)
    export_contract_onnx(m, d / "portable.onnx", max_context=512, verify=False)
    return m, OrtEngine(d / "fast.onnx"), OrtEngine(d / "portable.onnx")


def _random_tree_mask(t: int, g: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, t)]
    anc = torch.zeros(t, t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    depth = anc.sum(1) - 1
    return anc, depth


def test_layout_recorded(engines):
    _, fast, portable = engines
    assert fast.kv_layout == "bhsd" and fast.info.cache.layout == "bhsd"
    assert portable.kv_layout == "sbhd"


@pytest.mark.parametrize("past,t", [(0, 7), (0, 1), (200, 1), (200, 65), (37, 16)])
def test_fast_graph_equals_portable_graph(engines, past, t):
    m, fast, portable = engines
    g = torch.Generator().manual_seed(past * 100 + t)
    caches = [KVCache(e.info.cache, past + t + 4, 1) for e in (fast, portable)]
    if past:  # the same committed past in both layouts
        ids = torch.randint(0, m.config.vocab_size, (1, past), generator=g)
        pos = torch.arange(past)[None]
        mask = torch.ones(past, past, dtype=torch.bool).tril()[None]
        for e, c in zip((fast, portable), caches):
            e.forward(ids, pos, mask, c)
            c.commit(None, past)
    anc, depth = _random_tree_mask(t, g)
    ids = torch.randint(0, m.config.vocab_size, (1, t), generator=g)
    pos = (past + depth)[None]
    mask = torch.cat([torch.ones(t, past, dtype=torch.bool), anc], 1)[None]
    before = [c.past(i)[0].clone() for c in caches[:1] for i in range(m.config.n_layers)]
    lf, lp = (e.forward(ids, pos, mask, c) for e, c in zip((fast, portable), caches))
    assert (lf - lp).abs().max() < 1e-4
    for i in range(m.config.n_layers):
        caches[0].length = caches[1].length = past
        for a, b in zip(caches[0].tail(i, t), caches[1].tail(i, t)):
            assert (a - b).abs().max() < 1e-4
        for a, b in zip(caches[0].past(i), caches[1].past(i)):
            assert torch.allclose(a, b, atol=1e-4)
        assert torch.equal(caches[0].past(i)[0], before[i])  # the in-place write left the past alone


def test_tree_decoding_on_the_fast_graph_equals_vanilla_and_cache_equals_prefill(engines):
    m, fast, _ = engines
    ref = SpeculativeDecoder(TorchEngine(m), mode="vanilla").generate([3, 1, 4, 1, 5], 30).tokens
    draft = TorchEngine(truncated(m, 1))
    for spec in ("full:2,3", "beam:2,4,4", "dynamic:3,3,8"):
        dec = SpeculativeDecoder(fast, draft, tree=spec)
        r = dec.generate([3, 1, 4, 1, 5], 30)
        assert r.tokens == ref, spec
    # the cache after those steps == a fresh prefill of every committed token but the last
    cache = dec._cache
    seq = [3, 1, 4, 1, 5] + r.tokens
    n = cache.length
    assert n == len(seq) - 1
    fresh = KVCache(fast.info.cache, n + 1, 1)
    fast.forward(torch.tensor([seq[:n]]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], fresh)
    fresh.commit(None, n)
    for i in range(m.config.n_layers):
        for a, b in zip(cache.past(i), fresh.past(i)):
            assert (a - b).abs().max() < 1e-4


def test_unsupported_models_and_tensorrt_say_so(tmp_path, engines):
    m = random_model(tiny_config("llama", vocab=40, layers=1, hidden=32, heads=4, kv=2))  # head dim 8
    with pytest.raises(ArborspecError, match="multiple of 16"):
        export_gqa_onnx(m, tmp_path / "x.onnx")
    with pytest.raises(ArborspecError, match="Llama-family"):
        export_gqa_onnx(random_model(tiny_config("gpt2")), tmp_path / "y.onnx")
    pytest.importorskip("tensorrt_rtx")
    from arborspec.export.trt_build import EngineBuildError, build_engine

    with pytest.raises(EngineBuildError, match="--attention onnx"):
        build_engine(engines[1].path, tmp_path / "t.engine", compute_capability="8.9")


def test_cache_binding_is_reused_per_cache_and_rebinds_the_rest(engines):
    """The fast graph binds a cache's slabs once (OrtEngine._binding) and reuses the binding:
    calls alternating between two caches, with different T and inputs, give exactly what a
    fresh engine (new bindings every time) gives, and each cache has one binding."""
    _, fast, _ = engines
    fresh = OrtEngine(fast.path)
    g = torch.Generator().manual_seed(3)
    v = fast.info.vocab_size
    caches = [KVCache(fast.info.cache, 64, 1), KVCache(fast.info.cache, 64, 1)]
    twins = [KVCache(fast.info.cache, 64, 1), KVCache(fast.info.cache, 64, 1)]
    fast._bindings.clear()
    for step, t in enumerate([5, 1, 3, 2, 1, 4]):
        i = step % 2
        c, tw = caches[i], twins[i]
        p = c.length
        ids = torch.randint(0, v, (1, t), generator=g)
        pos = torch.arange(p, p + t)[None]
        mask = torch.ones(1, t, p + t, dtype=torch.bool)
        mask[0, :, p:] = torch.ones(t, t, dtype=torch.bool).tril()
        a = fast.forward(ids, pos, mask, c)
        b = fresh.forward(ids, pos, mask, tw)
        fresh._bindings.clear()  # the reference binds everything anew each call
        assert torch.equal(a, b)
        c.length = tw.length = p + t
    assert len(fast._bindings) == 2
    for c, tw in zip(caches, twins):
        assert torch.equal(c.k[:, :, :, : c.length], tw.k[:, :, :, : tw.length])
