"""After accepted trees, the caches hold exactly the committed tokens' K/V: the target's cache
(and a model draft's) equals a fresh prefill of the committed tokens, read directly, for every
draft kind (model, lookup, EAGLE-3, mixed), for llama and gpt2, and for both graph kinds of an
ONNX export (the GQA graph, kv layout bhsd; the portable graph, sbhd). The models' greedy output
is varied (asserted), so a wrong cache row also changes tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import truncated, varied_model
from lossless_util import make_draft

from arborspec.models.eagle3 import default_aux_layers
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.kvcache import KVCache

PROMPT = [1, 5, 7, 9, 3, 11, 1, 5, 7]
N = 40


def fresh_prefill(engine, seq) -> KVCache:
    n = len(seq)
    c = KVCache(engine.info.cache, n, 1)
    engine.forward(torch.tensor([seq]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], c)
    c.commit(None, n)
    return c


def assert_cache_is_prefill(engine, cache: KVCache, seq, what: str):
    assert cache.length == len(seq), what
    fresh = fresh_prefill(engine, seq)
    for i in range(engine.info.cache.n_layers):
        for name, a, b in zip("kv", cache.past(i), fresh.past(i)):
            err = float((a - b).abs().max())
            assert err < 1e-4, f"{what}: layer {i} {name} differs from a fresh prefill by {err:.2e}"


def decode_and_check(target, draft, module, tree="full:3,2"):
    ref = SpeculativeDecoder(target, mode="vanilla").generate(PROMPT, N).tokens
    assert len(set(ref)) >= 10, "the model's greedy output is too repetitive to test the cache"
    dec = SpeculativeDecoder(target, draft, tree=tree)
    r = dec.generate(PROMPT, N)
    assert r.tokens == ref
    moved = sum(n for k, n in r.stats.accepted_hist.items() if k > 1)
    assert moved >= 1, "no accepted tree: the commit path was not exercised"
    seq = PROMPT + r.tokens[:-1]  # the last token (the next root) is not in the cache yet
    assert_cache_is_prefill(target, dec._cache, seq, "target cache")
    eng = getattr(dec.draft, "engine", None)
    if isinstance(eng, TorchEngine) and eng.module is not module:  # a model draft: its cache too
        m = dec.draft.cache.length
        assert m >= len(seq) - 1  # at most the last accepted leaf is pending
        assert_cache_is_prefill(eng, dec.draft.cache, seq[:m], "draft cache")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def target_module(request):
    m = varied_model(request.param)
    if request.param == "llama":
        m.feature_layers = default_aux_layers(m.config.n_layers)
    return m


@pytest.mark.parametrize("kind", ["model", "lookup", "eagle3", "mixed"])
def test_torch_caches_equal_a_fresh_prefill(target_module, tmp_path, kind):
    if kind in ("eagle3", "mixed") and target_module.config.family != "llama":
        pytest.skip("EAGLE-3 heads are for llama-family targets")
    draft = make_draft(kind, target_module, tmp_path, target_module.config.vocab_size)
    decode_and_check(TorchEngine(target_module), draft, target_module)


def test_dynamic_trees_commit_exactly(target_module):
    decode_and_check(
        TorchEngine(target_module), TorchEngine(truncated(target_module, 1)), target_module, "dynamic:3,3,8"
    )


@pytest.mark.parametrize("graph", ["gqa", "portable"])
def test_onnx_caches_equal_a_fresh_prefill(tmp_path_factory, graph):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from arborspec.export.onnx_export import export_contract_onnx, export_gqa_onnx
    from arborspec.runtime.backends.onnxruntime import OrtEngine

    m = varied_model("llama", layers=2)
    d = tmp_path_factory.mktemp("kv-onnx")
    (export_gqa_onnx if graph == "gqa" else export_contract_onnx)(m, d / "t.onnx", max_context=512, verify=False)
    eng = OrtEngine(d / "t.onnx")
    assert eng.info.cache.layout == ("bhsd" if graph == "gqa" else "sbhd")
    decode_and_check(eng, TorchEngine(truncated(m, 1)), m)


@pytest.mark.parametrize("layout", ["sbhd", "bhsd"])
def test_commit_rows_moves_each_row_like_a_row_by_row_copy(layout):
    """KVCache.commit_rows (batched decoding's commit, one gather and one scatter for all rows)
    against copying each row's entries one by one: rows with paths of different lengths, a row
    already in place, an empty move, sources that overlap their destinations."""
    from arborspec.runtime.kvcache import CacheSpec

    spec = CacheSpec(3, 2, 4, torch.float32, layout=layout)
    c = KVCache(spec, 12, 4)
    g = torch.Generator().manual_seed(0)
    c.k.copy_(torch.randn(c.k.shape, generator=g))
    c.v.copy_(torch.randn(c.v.shape, generator=g))
    moves = [(0, 3, [5, 7, 8]), (1, 4, [4, 5]), (2, 2, []), (3, 6, [6, 9, 10, 11])]
    before = c.k.clone()
    want_k, want_v = c.k.clone(), c.v.clone()
    for row, dst0, src in moves:
        for x in (want_k, want_v):
            r = x[:, :, row] if layout == "sbhd" else x[:, row, :, :]
            seq = 1 if layout == "sbhd" else 2
            vals = r.index_select(seq, torch.tensor(src, dtype=torch.long)).clone()
            r.narrow(seq, dst0, len(src)).copy_(vals)
    c.commit_rows(moves)
    assert torch.equal(c.k, want_k) and torch.equal(c.v, want_v)
    assert not torch.equal(want_k, before)  # the moves changed the cache


@pytest.mark.parametrize("kind", ["model", "lookup", "eagle3", "mixed"])
def test_a_deferred_root_leaves_the_draft_as_a_root_call_would(tmp_path, kind):
    """DraftSource.defer (a batch step verified without a tree: no draft call) leaves a draft
    where its root call and an empty commit leave it: after two deferred roots, the next start's
    logits equal those of a twin that made both calls (the queue runs as one chain)."""
    from arborspec.runtime.trees import Tree, parse_tree_spec

    m = varied_model("llama")
    m.feature_layers = default_aux_layers(m.config.n_layers)
    target = TorchEngine(m)
    v = m.config.vocab_size
    a = make_draft(kind, m, tmp_path, v)
    b = a.fork()
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(len(PROMPT) + 2, target.info.n_features, generator=g)
    policy = parse_tree_spec("full:3,2")
    roots = [4, 9, 2]
    for d in (a, b):
        d.prepare(policy, 64)
        d.reset(PROMPT, feats[: len(PROMPT)])
    empty = torch.zeros(0, dtype=torch.long)
    for i, r in enumerate(roots[:2]):
        f = feats[len(PROMPT) + i][None]
        a.start(r)
        a.commit(Tree.empty(), empty, f)
        b.defer(r, f)
    got, want = b.start(roots[2]), a.start(roots[2])
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


class ForcingHistory:
    """A stand-in for a grammar (penalties.RowProcessing's interface) that forces the next
    `k` tokens of `ref` on every other step and masks nothing: the decoder verifies them as a chain
    (step.forced_chain) instead of drafting."""

    def __init__(self, ref: list[int], k: int = 3):
        self.ref, self.k, self.done, self.asked = ref, k, 0, 0

    def process(self, row, path):
        return row

    def process_draft(self, rows, paths, token_map):
        return rows

    def extend(self, tokens):
        self.done += len(tokens)

    def forced(self):
        self.asked += 1
        return self.ref[self.done : self.done + self.k] if self.asked % 2 else []


@pytest.mark.parametrize("kind", ["model", "lookup", "eagle3", "mixed"])
def test_forced_chains_leave_the_draft_as_drafting_would(tmp_path, kind):
    """Steps whose tree is a grammar's forced chain (the draft makes no call; it takes the
    committed tokens as deferred ones) between drafted steps: the output is vanilla's, the target's
    cache a fresh prefill, and the draft's next start equals a fresh draft's reset on the committed
    tokens (with the target's features of them)."""
    m = varied_model("llama")
    m.feature_layers = default_aux_layers(m.config.n_layers)
    target = TorchEngine(m)
    v = m.config.vocab_size
    ref = SpeculativeDecoder(target, mode="vanilla").generate(PROMPT, N).tokens
    draft = make_draft(kind, m, tmp_path, v)
    dec = SpeculativeDecoder(target, draft, tree="full:2,2")
    dec.start(PROMPT, N)
    dec._seq.history = hist = ForcingHistory(ref)
    out, forced_steps = [], 0
    while True:
        before = dec._seq.stats.steps
        new = dec.step().tokens
        if not new:
            break
        forced_steps += dec._seq.stats.steps > before and hist.asked % 2 == 1 and len(new) > 1
        out += new
    assert out == ref and forced_steps >= 3, forced_steps
    seq = PROMPT + out[:-1]
    assert_cache_is_prefill(target, dec._cache, seq, "target cache")
    # a fresh draft reset on the committed tokens, with the target's features of them
    twin = make_draft(kind, m, tmp_path / "twin", v)
    n = len(seq)
    c = KVCache(target.info.cache, n, 1)
    _, feats = target.forward_features(
        torch.tensor([seq]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], c
    )
    twin.prepare(dec.policy, 128)
    twin.reset(seq, feats[0] if draft.needs_target_features else None)
    got, want = dec.draft.start(out[-1]), twin.start(out[-1])
    assert torch.allclose(got.float(), want.float(), atol=1e-4), float((got.float() - want.float()).abs().max())
