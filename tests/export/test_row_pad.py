"""The dummy attention row inside the int4 graph (export/row_pad.py): a one-token call of the padded
graph, which the engine no longer pads, gives bit for bit the logits and K/V of the unpadded
graph's engine-padded call (what vanilla decoding ran before), batched rows equal single ones,
and only the int8-activation exports of models without sliding windows are padded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import onnx  # noqa: E402
import torch  # noqa: E402
from conftest import random_model, tiny_config  # noqa: E402

from arborspec.export import row_pad  # noqa: E402
from arborspec.runtime import contract as C  # noqa: E402
from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.kvcache import KVCache  # noqa: E402


def _export(tmp_path, name, quantize="int4"):
    from arborspec.export.export_folder import export_folder

    m = random_model(tiny_config("llama", vocab=128, layers=2, hidden=64, heads=4, kv=2), seed=3, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    export_folder(lm, tmp_path / name, draft="none", progress=False, quantize=quantize)
    return tmp_path / name / "target.onnx"


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """(padded int4 graph, the same export without the dummy row)."""
    tmp = tmp_path_factory.mktemp("rowpad")
    padded = _export(tmp, "padded")
    mp = pytest.MonkeyPatch()
    mp.setattr(row_pad, "pads_rows_for", lambda *a: False)
    try:
        plain = _export(tmp, "plain")
    finally:
        mp.undo()
    return padded, plain


def _decode(engine, prefix, cont, batch=1):
    """Prefill `prefix`, then one-token calls of `cont` (each sequence of a batch the same);
    -> (logits of each step, the cache)."""
    cache = KVCache(engine.info.cache, 96, batch).zero_()
    p = prefix.numel()
    causal = torch.ones(batch, p, p, dtype=torch.bool).tril()
    engine.forward(prefix.expand(batch, p), torch.arange(p).expand(batch, p), causal, cache)
    cache.length = p
    out = []
    for tok in cont:
        n = cache.length
        ids, pos = torch.full((batch, 1), tok), torch.full((batch, 1), n)
        out.append(engine.forward(ids, pos, torch.ones(batch, 1, n + 1, dtype=torch.bool), cache).clone())
        cache.length = n + 1
    return out, cache


def test_the_padded_graph_says_so_and_pads_every_attention(graphs):
    padded, plain = graphs
    meta = {p.key: p.value for p in onnx.load(str(padded), load_external_data=False).metadata_props}
    assert meta.get(C.META_PAD_ROW) == "1"
    assert C.META_PAD_ROW not in {p.key for p in onnx.load(str(plain), load_external_data=False).metadata_props}
    g = onnx.load(str(padded), load_external_data=False).graph
    made_by = {o: n for n in g.node for o in n.output}
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(made_by[n.input[0]].op_type == "Gather" for n in gqa)
    e = OrtEngine(padded)
    assert e.pads_row and e.info.cache.spare == 1
    assert KVCache(e.info.cache, 10, 1).k.shape[3] == 11  # one spare column for the dummy row
    e.close()


@pytest.mark.parametrize("past", [40, 70])
def test_one_token_calls_equal_the_engine_padded_ones_bit_for_bit(graphs, past):
    padded, plain = graphs
    g = torch.Generator().manual_seed(past)
    prefix, cont = torch.randint(0, 128, (past,), generator=g), torch.randint(0, 128, (12,), generator=g).tolist()
    ours, theirs = OrtEngine(padded, row_invariant=True), OrtEngine(plain, row_invariant=True)
    a, ca = _decode(ours, prefix, cont)
    b, cb = _decode(theirs, prefix, cont)
    n = ca.length
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(ca.k[..., :n, :], cb.k[..., :n, :]) and torch.equal(ca.v[..., :n, :], cb.v[..., :n, :])
    # so the comparison can fail: the unpadded graph's raw one-row call is another kernel
    raw, _ = _decode(OrtEngine(plain, row_invariant=False), prefix, cont)
    assert any(not torch.equal(x, y) for x, y in zip(a, raw))


def test_a_batch_of_rows_on_the_padded_graph_equals_one_row(graphs):
    """GroupQueryAttention refuses B > 1 rows of T = 2 after a prefix: the engine runs a padded
    graph's batch row by row, also without its row layout."""
    padded, _ = graphs
    prefix, cont = torch.arange(3, 33), [5, 9, 11, 2]
    for layout in (True, False):
        e = OrtEngine(padded, row_invariant=layout)
        one, _ = _decode(e, prefix, cont)
        two, _ = _decode(e, prefix, cont, batch=2)
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[0], y[1]) for x, y in zip(one, two))
        e.close()


def test_only_int8_activation_exports_without_sliding_windows_are_padded():
    llama = tiny_config("llama")
    assert row_pad.pads_rows_for(llama, 4, "fp32")
    assert not row_pad.pads_rows_for(llama, 0, "fp32")  # float activations: the engine does not lay out
    assert not row_pad.pads_rows_for(llama, 4, "fp16")  # the GPU graph
    assert not row_pad.pads_rows_for(SimpleNamespace(sliding_window=512), 4, "fp32")
