"""A prompt that starts like the previous one reuses the K/V its prefill left in the cache
(runtime/kvcache.PrefixCache): the next turn of a chat, a shared system prompt. On a
row-invariant target (the int4 export's layout) that is on by default and exact: every token
and every log-prob bit for bit what a fresh prefill gives, alone and batched, vanilla and
speculative; on a float target it is opt-in; an EAGLE-3 draft gets the kept tokens' features."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import random_model, tiny_config

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.generator import Generator
from arborspec.runtime.kvcache import KVCache
from arborspec.runtime.sampling import SamplingParams

BASE = [1, 5, 9, 2, 7, 7, 3, 11, 40, 6, 9, 2]


def turns(prev_tokens):
    """The prompts, each from the previous completion's tokens: a chat's next turn (prompt,
    answer, a new message), a prompt that diverges after 5 tokens, the same again, a shorter one,
    one with nothing in common."""
    yield BASE
    yield BASE + prev_tokens() + [21, 22]
    yield BASE[:5] + [60, 61, 62]
    yield BASE[:5] + [60, 61, 62]
    yield BASE[:3]
    yield [8, 8, 8, 8]


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_turns(g_on, g_off, exact: bool, **kw):
    """Each turn decoded with the reuse and without: the same tokens (and log-probs, bit for bit
    where exact); the reuse keeps what the cache holds: the previous prompt and its committed
    answer (all but the last token, the next root); batched, the finished row copied into the
    scratch cache that joining prompts are prefilled in."""
    held, last = [], None
    for prompt in turns(lambda: last.tokens):
        a = g_on.generate(prompt, 12, logprobs=2, **kw)
        b = g_off.generate(prompt, 12, logprobs=2, **kw)
        kept = common(prompt[:-1], held)
        assert (a.stats.cached_tokens, b.stats.cached_tokens) == (kept, 0), prompt
        assert a.tokens == b.tokens, prompt
        if exact:  # the same K/V bit for bit: the same log-probs bit for bit
            assert a.logprobs == b.logprobs, prompt
        else:
            assert [x for _, x, _ in a.logprobs] == pytest.approx([x for _, x, _ in b.logprobs], abs=1e-5)
        held, last = prompt + a.tokens[:-1], a
        assert kept > 0 or prompt in (BASE, [8, 8, 8, 8])  # every other turn reuses something
    return a


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from arborspec.export.export_folder import export_folder

    m = random_model(tiny_config("llama", vocab=128, layers=2, hidden=64, heads=4, kv=2), seed=3, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    out = tmp_path_factory.mktemp("int4") / "e"
    export_folder(lm, out, draft="layers:1", progress=False, quantize="int4", max_tree_nodes=32)
    return out


@pytest.mark.parametrize("mode,tree,batch", [("vanilla", None, 1), ("chain", "chain:3", 1), ("tree", "full:2,2", 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_row_invariant_target_reuses_the_prefix_exactly_by_default(tiny_int4, mode, tree, batch, temperature):
    kw = dict(mode=mode, tree=tree or "chain:2", max_batch=batch)
    with (
        Generator.from_export(tiny_int4, **kw) as g_on,
        Generator.from_export(tiny_int4, prefix_cache=False, **kw) as g_off,
    ):
        assert g_on.target.caps.row_invariant
        run_turns(g_on, g_off, exact=True, temperature=temperature, seed=4)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_float_target_reuses_only_when_asked_and_eagle3_gets_the_kept_features(tmp_path, batch):
    from test_eagle3 import _draft

    from arborspec.models.eagle3 import default_aux_layers

    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    m.feature_layers = default_aux_layers(4)
    eng = TorchEngine(m)
    draft = _draft(m, tmp_path)
    assert not eng.caps.row_invariant
    g_default = Generator(eng, draft, tree="full:2,2")
    g_default.generate(BASE, 4)
    assert g_default.generate(BASE + [3], 4).stats.cached_tokens == 0  # off by default: not exact here
    g_on = Generator(eng, draft, tree="full:2,2", prefix_cache=True, max_batch=batch)
    g_off = Generator(eng, draft, tree="full:2,2", prefix_cache=False, max_batch=batch)
    run_turns(g_on, g_off, exact=False)
    # the draft drafted from the same features (the prompt's and the committed answer's)
    first = g_on.generate(BASE, 24)
    nxt = BASE + first.tokens + [30, 31]
    a, b = (g.generate(nxt, 24) for g in (g_on, g_off))
    assert a.stats.cached_tokens == len(BASE) + len(first.tokens) - 1
    assert a.tokens == b.tokens
    # the features kept for the draft are the target's features of those tokens, row for row
    # (one causal call over them as the reference)
    kept = g_on._batch.decoder.kept_for(nxt) if batch > 1 else g_on._decoder(SamplingParams())._prefix
    assert len(kept.tokens) == kept.n_feats == len(nxt) + len(a.tokens) - 1
    seq = torch.tensor([kept.tokens])
    n = seq.shape[1]
    cache = KVCache(eng.info.cache, n, 1)
    _, ref = eng.forward_features(seq, torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], cache)
    assert torch.allclose(torch.cat(kept._feats), ref[0], atol=1e-4)


def test_prompt_logprobs_prefill_every_row(tiny_int4):
    with Generator.from_export(tiny_int4) as g:
        g.generate(BASE, 4)
        c = g.generate(BASE + [3], 4, prompt_logprobs=0)
        assert c.stats.cached_tokens == 0 and len(c.prompt_logprobs) == len(BASE) + 1
        assert g.generate(BASE + [3, 4], 4).stats.cached_tokens == len(BASE) + 1  # and it is kept again


@pytest.mark.parametrize("context", [None, 12])
def test_the_eagle3_head_keeps_its_entries_for_a_sequence_that_starts_the_same(tmp_path, context):
    """Eagle3Draft.reset keeps the entries its cache holds for the tokens a new sequence repeats
    (a chat's next turn): the head then reads only the rest, and its cache and its proposal for
    the next root are a fresh head's with the same window (context: its window start stays put
    until the window would hold twice `context` entries, then a fresh window)."""
    from test_eagle3 import _draft

    from arborspec.models.eagle3 import default_aux_layers
    from arborspec.runtime.trees import parse_tree_spec

    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    m.feature_layers = default_aux_layers(4)
    eng = TorchEngine(m)
    seq = [int(x) for x in torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(1))]
    other = seq[:25] + [(t + 7) % 96 for t in seq[25:]]  # the same first 25 tokens, then others

    def features(tokens):  # the target's, one causal call
        n = len(tokens)
        cache = KVCache(eng.info.cache, n, 1)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        return eng.forward_features(torch.tensor([tokens]), torch.arange(n)[None], mask, cache)[1][0]

    feats = {id(seq): features(seq), id(other): features(other)}
    policy = parse_tree_spec("chain:2")
    d = _draft(m, tmp_path)
    d.context = context
    d.prepare(policy, 128)

    def turn(draft, x, upto: int):  # a sequence of x[:upto + 1]: committed x[:upto], root x[upto]
        draft.reset(x[:upto], feats[id(x)][:upto])
        kept = draft.cache.length
        return kept, draft.start(x[upto])

    turn(d, seq, 20)
    w0 = 20 - 1 - context if context is not None else 0  # the first window's start
    # a longer turn of the same tokens; one that differs from token 25 on; past twice the context
    for x, upto, kept_want in ((seq, 30, 20 - w0), (other, 32, 24 - w0), (other, 50, None)):
        kept, got = turn(d, x, upto)
        if context is not None and kept_want is None:  # a fresh window, nothing kept
            assert kept == 0
        else:
            assert kept == (kept_want if kept_want is not None else 32)  # no window: all of other[:33] kept
            fresh = _draft(m, tmp_path)
            fresh.context = upto - 1 - w0 if context is not None else None  # the same window start
            fresh.prepare(policy, 128)
            _, want = turn(fresh, x, upto)
            assert torch.allclose(got, want, atol=1e-5)
            length = d.cache.length
            assert length == fresh.cache.length
            for a, b in ((d.cache.k, fresh.cache.k), (d.cache.v, fresh.cache.v)):
                assert torch.allclose(d.cache._seq(a, 0, length), fresh.cache._seq(b, 0, length), atol=1e-5)


def test_prefix_cache_false_starts_the_head_cold_too(tmp_path):
    """prefix_cache=False (a benchmark's cold requests): the head reads its whole context again
    on a repeated prompt, where the default keeps its entries and reads only the new ones."""
    from test_eagle3 import _draft

    from arborspec.models.eagle3 import default_aux_layers

    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    m.feature_layers = default_aux_layers(4)
    eng = TorchEngine(m)
    prompt = [int(x) for x in torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(2))]
    rows = {}
    for pc in (None, False):
        draft = _draft(m, tmp_path)
        g = Generator(eng, draft, tree="chain:2", prefix_cache=pc)
        g.generate(prompt, 4)
        seen, call = [], draft.engine.forward_hidden

        def counting(ids, *a, _call=call, _seen=seen):  # the entries the head runs
            _seen.append(ids.shape[1])
            return _call(ids, *a)

        draft.engine.forward_hidden = counting
        g.generate(prompt, 4)
        rows[pc] = sum(seen)
    assert rows[None] < 20 and rows[False] >= len(prompt) - 1, rows


def test_batched_generators_keep_one_conversation_per_row(tiny_int4):
    """Two chats interleaved through a batching generator (A, B, A, B, ...): each next turn finds
    its own earlier turn and answer, kept in a slot of its own (one slot kept only the last
    finished, so each turn found the other chat there), and decodes as without the reuse."""
    chats = {"A": [3, 5, 7, 9, 11, 13, 15, 17], "B": [4, 6, 8, 10, 12, 14, 16, 18]}
    with (
        Generator.from_export(tiny_int4, tree="chain:2", max_batch=2) as g,
        Generator.from_export(tiny_int4, tree="chain:2", max_batch=2, prefix_cache=False) as cold,
    ):
        for turn in range(3):
            for name, prompt in chats.items():
                a, b = g.generate(prompt, 6), cold.generate(prompt, 6)
                assert a.tokens == b.tokens
                assert a.stats.cached_tokens == (0 if turn == 0 else len(prompt) - 3), (name, turn)
                chats[name] = prompt + a.tokens + [20 + turn, 21 + turn]  # the next turn: answer + message


def test_a_shared_start_is_copied_without_overwriting_a_kept_conversation(tiny_int4):
    """Batched (4 rows, 4 kept conversations): a new conversation with the same system prompt as
    a kept one reuses that start (copied into a slot of its own), and the kept conversation's next
    turn still finds all of it (taking the slot with the longest match overwrote it)."""
    system = list(range(30, 50))
    a1 = system + [3, 5, 7]
    with (
        Generator.from_export(tiny_int4, tree="chain:2", max_batch=4) as g,
        Generator.from_export(tiny_int4, tree="chain:2", max_batch=4, prefix_cache=False) as cold,
    ):
        first = g.generate(a1, 6)
        for other in ([4, 6, 8], [9, 9, 9]):  # two other chats with the same system prompt
            c = g.generate(system + other, 6)
            assert c.stats.cached_tokens == len(system) and c.tokens == cold.generate(system + other, 6).tokens
        a2 = a1 + first.tokens + [11, 12]
        c = g.generate(a2, 6)
        assert c.stats.cached_tokens == len(a1) + len(first.tokens) - 1  # still kept whole
        assert c.tokens == cold.generate(a2, 6).tokens
