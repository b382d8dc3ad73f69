"""Log-probs of the generated tokens (`generate(logprobs=k)`, the server's `logprobs`): each
token's log-prob and its k most likely alternatives, taken from the verify call's row that
predicted it, checked against an independent reference (one causal forward over prompt + output,
log-softmax at every position), for vanilla, chain and tree decoding, alone and batched, greedy
and sampled (raw log-probs: before temperature and top-p)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model, tiny_config, tiny_text_export, truncated

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.kvcache import KVCache


@pytest.fixture(scope="module")
def pair():
    m = random_model(tiny_config("llama"), seed=4, scale=1.0)
    return TorchEngine(m), TorchEngine(truncated(m, 1))


def reference(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-softmax of the target at the positions that predict `tokens` [n, V], one causal call."""
    seq = prompt + tokens
    n = len(seq)
    cache = KVCache(engine.info.cache, n, 1)
    logits = engine.forward(
        torch.tensor([seq]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None], cache
    )
    return torch.log_softmax(logits[0, len(prompt) - 1 : n - 1].double(), -1)


@pytest.mark.parametrize("mode,tree,batch", [("vanilla", None, 1), ("tree", "full:2,2", 1), ("chain", "chain:3", 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_one_causal_forward(pair, mode, tree, batch, temperature):
    target, draft = pair
    g = Generator(target, None if mode == "vanilla" else draft, mode=mode, tree=tree or "full:3,2", max_batch=batch)
    prompt = [5, 17, 3, 42, 8]
    c = g.generate(prompt, 20, temperature=temperature, top_p=0.9, seed=3, logprobs=3)
    g.close()
    assert len(c.logprobs) == len(c.tokens) == 20
    ref = reference(target, prompt, c.tokens)
    for j, (tok, lp, top) in enumerate(c.logprobs):
        assert tok == c.tokens[j]
        assert lp == pytest.approx(float(ref[j, tok]), abs=1e-4)
        want = torch.topk(ref[j], 3)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    if mode != "vanilla":
        assert c.stats.steps < 20  # several tokens a verify call: the rows of accepted nodes were read


def test_logprobs_off_by_default_and_checked(pair):
    target, draft = pair
    g = Generator(target, draft, tree="full:2,2")
    assert g.generate([1, 2, 3], 4).logprobs is None
    assert [top for _, _, top in g.generate([1, 2, 3], 4, logprobs=0).logprobs] == [[]] * 4
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(InputError, match="logprobs"):
            g.generate([1, 2, 3], 4, logprobs=bad)


@pytest.mark.parametrize("batch,chunk", [(1, 512), (1, 3), (2, 4)])
def test_prompt_logprobs_equal_one_causal_forward(pair, batch, chunk, monkeypatch):
    """The prompt's log-probs come from the prefill's rows, chunk by chunk (a long prompt is
    several causal calls): each equals the reference's; the first token has none."""
    from arborspec.runtime.decode import SpeculativeDecoder

    monkeypatch.setattr(SpeculativeDecoder, "prefill_chunk", chunk)
    target, draft = pair
    g = Generator(target, draft, tree="full:2,2", max_batch=batch)
    prompt = [5, 17, 3, 42, 8, 11, 60, 2, 9, 31]
    c = g.generate(prompt, 6, logprobs=1, prompt_logprobs=2)
    plain = g.generate(prompt, 6)
    g.close()
    assert c.tokens == plain.tokens and plain.prompt_logprobs is None  # asking for them changes nothing else
    assert c.prompt_logprobs[0] == (prompt[0], None, [])
    ref = reference(target, prompt[:1], prompt[1:])  # the rows predicting prompt[1:]
    assert [t for t, _, _ in c.prompt_logprobs] == prompt
    for j, (tok, lp, top) in enumerate(c.prompt_logprobs[1:]):
        assert lp == pytest.approx(float(ref[j, tok]), abs=1e-4)
        want = torch.topk(ref[j], 2)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    # the generated tokens' log-probs continue where the prompt's end (the same reference)
    ref_out = reference(target, prompt, c.tokens)
    assert [lp for _, lp, _ in c.logprobs] == pytest.approx(
        [float(ref_out[j, t]) for j, t in enumerate(c.tokens)], abs=1e-4
    )


def test_prompt_logprobs_of_one_token_and_checked(pair):
    target, draft = pair
    g = Generator(target, draft, tree="full:2,2")
    assert g.generate([7], 2, prompt_logprobs=3).prompt_logprobs == [(7, None, [])]
    for bad in (-1, 21, "2"):
        with pytest.raises(InputError, match="logprobs"):
            g.generate([1, 2, 3], 4, prompt_logprobs=bad)
    g.close()


@pytest.mark.parametrize("batch", [1, 2])
def test_stream_pairs_each_chunk_with_its_tokens_logprobs(batch, tmp_path):
    """stream(logprobs=k) yields (text, entries): the texts join to generate's text, the entries
    to generate's log-probs, each entry arriving with (or before) the chunk that shows its text;
    with a stop string too (the tokens read up to the one that completed it)."""
    g = Generator.from_export(tiny_text_export(tmp_path / "e", seed=9), tree="full:2,2", max_batch=batch)
    for stop in (None, "ok"):
        want = g.generate("hello hello", 24, logprobs=2, stop=stop)
        assert stop is None or want.stop_reason == "stop"
        pairs = list(g.stream("hello hello", 24, logprobs=2, stop=stop))
        assert "".join(t for t, _ in pairs) == want.text
        entries = [e for _, es in pairs for e in es]
        assert [t for t, _, _ in entries] == want.tokens
        assert [lp for _, lp, _ in entries] == pytest.approx([lp for _, lp, _ in want.logprobs], abs=1e-6)
        shown, toks = "", []
        for text, es in pairs:  # the text shown so far never runs ahead of the tokens paired so far
            shown, toks = shown + text, toks + [t for t, _, _ in es]
            assert g.tokenizer.decode(toks, skip_special_tokens=True).startswith(shown)
    chunks = list(g.stream("hello hello", 6, ids=True, logprobs=0))
    assert [t for chunk, _ in chunks for t in chunk] == [t for _, es in chunks for t, _, _ in es]
    g.close()
