"""One request object, one result object (runtime/request.py): a GenerationRequest gives what the
keyword form gives through Generator, the unbatched and the batched decoder; a step returns a
StepResult, a generation a GenerationResult (no side channels on the decoder)."""

from __future__ import annotations

import pytest
from conftest import truncated, varied_model

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.request import GenerationRequest, GenerationResult, StepResult, as_request
from arborspec.runtime.sampling import SamplingParams

PROMPT = [1, 5, 7, 9, 3, 11]


def close(a: list, b: list) -> bool:
    """Two log-prob lists: the same tokens and alternatives, log-probs within float noise."""
    flat = lambda lps: [(t, lp) for tok, p, alts in lps for t, lp in [(tok, p)] + list(alts)]  # noqa: E731
    fa, fb = flat(a), flat(b)
    return [t for t, _ in fa] == [t for t, _ in fb] and all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(fa, fb))


@pytest.fixture(scope="module")
def pair():
    m = varied_model("llama")
    return TorchEngine(m), TorchEngine(truncated(m, 1))


def test_the_short_form_is_the_request_in_field_order():
    req = as_request(PROMPT, 12, [4], 7, 2)
    assert req == GenerationRequest(PROMPT, max_new_tokens=12, eos_token_ids=[4], seed=7, logprobs=2)
    assert as_request(req) is req
    with pytest.raises(TypeError):
        as_request(req, 12)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decoder_request_equals_short_form_and_result_is_the_streams(pair, temperature):
    target, draft = pair
    sp = SamplingParams(temperature, repetition_penalty=1.2)
    dec = SpeculativeDecoder(target, draft, tree="full:2,2", sampling=sp)
    short = dec.generate(PROMPT, 20, (), 5, 1)
    req = GenerationRequest(PROMPT, 20, seed=5, logprobs=1, sampling=sp)
    got = SpeculativeDecoder(target, draft, tree="full:2,2").generate(req)  # the request's sampling, not the default
    assert isinstance(got, GenerationResult) and got.tokens == short.tokens and len(got.tokens) == 20
    assert [e[0] for e in got.logprobs] == got.tokens and got.logprobs == short.logprobs
    stream = dec.stream(req)
    assert stream.result is None  # nothing started before the first chunk
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        assert stream.result.tokens == sum(chunks, [])  # live
    res = stream.result
    assert res.tokens == got.tokens and res.stats.steps == len(chunks) and res.stop_reason == "length"
    assert res.stats.total_s > 0 and res.prompt_logprobs is None


def test_step_results_commit_what_they_say(pair):
    target, draft = pair
    dec = SpeculativeDecoder(target, draft, tree="full:2,2")
    ref = SpeculativeDecoder(target, mode="vanilla").generate(PROMPT, 16, [2]).tokens
    seq = dec.start(GenerationRequest(PROMPT, 16, [2]))
    out, steps = [], 0
    while True:
        step = dec.step()
        assert isinstance(step, StepResult)
        if not step.tokens:
            break
        steps += 1
        assert step.keep == [0] + [i + 1 for i in step.path.tolist()] and len(step.keep) == len(step.tokens)
        out += step.tokens
    assert out == ref == seq.tokens and step.stop_reason == seq.stop_reason == seq.result().stop_reason
    assert steps < len(ref) or seq.stop_reason == "eos"  # the draft was used


def test_batched_requests_equal_alone(pair):
    target, draft = pair
    sps = [SamplingParams(), SamplingParams(0.8, top_p=0.9)]
    reqs = [GenerationRequest(PROMPT[: 3 + i], 14, seed=i, sampling=sp, logprobs=0) for i, sp in enumerate(sps)]
    alone = [SpeculativeDecoder(target, draft, tree="full:2,2").generate(r) for r in reqs]
    bd = BatchDecoder(target, draft, tree="full:2,2", max_batch=2)
    seqs = [bd.add(r) for r in reqs]
    while any(not s.done for s in bd.seqs):
        bd.step()
    for s, a in zip(seqs, alone):
        r = s.result()
        assert r.tokens == a.tokens and close(r.logprobs, a.logprobs) and s.request is reqs[seqs.index(s)]


@pytest.mark.parametrize("max_batch", [1, 2])
def test_generator_request_form_equals_keyword_form(pair, max_batch):
    target, draft = pair
    with Generator(target, draft, tree="full:2,2", eos_token_ids=[3], max_batch=max_batch) as gen:
        kw = gen.generate(PROMPT, 18, temperature=0.7, top_k=20, seed=4, logprobs=2, frequency_penalty=0.3)
        req = gen.request(PROMPT, 18, temperature=0.7, top_k=20, seed=4, logprobs=2, frequency_penalty=0.3)
        assert req.sampling == SamplingParams(0.7, 20, frequency_penalty=0.3) and req.seed == 4
        got = gen.generate(req)
        assert got.tokens == kw.tokens and got.stop_reason == kw.stop_reason
        assert close(got.logprobs, kw.logprobs) and not hasattr(gen, "last_stats")
        it = gen.stream(req, ids=True)
        pairs = list(it)  # the stream's outcome comes back with it, as generate()'s Completion does
        assert it.result.tokens == kw.tokens and it.result.stop_reason == kw.stop_reason
        assert it.stats.new_tokens == kw.stats.new_tokens == len(kw.tokens)
        assert sum((c for c, _ in pairs), []) == kw.tokens and close(sum((e for _, e in pairs), []), kw.logprobs)
        # eos_token_ids: None is the generator's, a list replaces it
        greedy = gen.generate(GenerationRequest(PROMPT, 30))
        assert greedy.tokens == gen.generate(PROMPT, 30).tokens
        e = greedy.tokens[len(greedy.tokens) // 2]
        own = gen.generate(GenerationRequest(PROMPT, 30, eos_token_ids=[e]))
        assert own.tokens == greedy.tokens[: greedy.tokens.index(e) + 1] and own.stop_reason == "eos"
        with pytest.raises(InputError, match="no other arguments"):
            gen.generate(req, temperature=0.5)
        with pytest.raises(InputError, match="unexpected keyword argument 'top_n'"):
            gen.request(PROMPT, 4, top_n=3)
        with pytest.raises(InputError, match="prompt_logprobs"):
            next(gen.stream(PROMPT, 4, prompt_logprobs=1))
