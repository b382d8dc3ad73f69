"""Penalties, logit bias and min-p (runtime/penalties.py, runtime/sampling.py) against references
that share none of the runtime's code: greedy decoding written plainly (one causal call over the
whole sequence per token, the penalties applied token by token from their definitions:
lossless_util.reference_penalties) and transformers' own `generate` (RepetitionPenalty,
SequenceBias processors) on a checkpoint it wrote. Vanilla, chain and tree decoding, single and
batched, must give the penalised greedy tokens exactly; the lossless cases (exact enumeration,
tests/runtime/test_exact_lossless.py) carry penalised SamplingParams too. Each case is a negative
control of its own: the penalty must change the unpenalised answer."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import random_model, tiny_config, truncated
from lossless_util import plain_next_logits, reference_penalties

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.lookup import LookupDraft
from arborspec.runtime.drafts.model import ModelDraft
from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.penalties import TokenHistory
from arborspec.runtime.sampling import SamplingParams

V = 96
PROMPT = [5, 7, 9, 11, 5, 7, 9, 11, 5, 7]
N = 24
CASES = {
    "repetition": SamplingParams(repetition_penalty=1.6),
    "presence+frequency": SamplingParams(presence_penalty=1.2, frequency_penalty=0.9),
    "frequency<0": SamplingParams(frequency_penalty=-0.6),
    "bias": SamplingParams(logit_bias={"3": 6.0, 7: -100}),
    "all": SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={12: 3.0}),
}


@pytest.fixture(scope="module")
def target():
    """A random Llama whose logits sit in a trained model's range (a few units apart: the
    penalties can move them) and whose unpenalised greedy output repeats itself."""
    cfg = dataclasses.replace(tiny_config("llama", vocab=V), tie_embeddings=False)
    m = random_model(cfg, seed=1)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.04)
    return m


def reference_greedy(engine, prompt, n, sp) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        row = reference_penalties(plain_next_logits(engine, list(prompt) + out), prompt, out, sp)
        out.append(int(row.argmax()))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_penalised_greedy_is_the_reference_in_every_mode(target, name):
    """The penalties read each row's own history: vanilla, a chain and trees (a layer draft that
    proposes the unpenalised tokens, so rows deep in the tree are read and rejected; prompt
    lookup, whose proposals repeat the prompt) and a batch of two all give the plain loop's
    tokens; without the penalty the answer differs."""
    sp = CASES[name]
    eng = TorchEngine(target)
    want = reference_greedy(eng, PROMPT, N, sp)
    assert want != reference_greedy(eng, PROMPT, N, SamplingParams()), "the penalty changes nothing here"
    layer = ModelDraft(TorchEngine(truncated(target, 2)))
    assert SpeculativeDecoder(eng, mode="vanilla", sampling=sp).generate(PROMPT, N).tokens == want
    accepted = 0
    for draft, tree in (
        (layer, "chain:3"),
        (layer, "full:3,2"),
        (LookupDraft(V), "full:3,2"),
        (layer, "dynamic:2,3,6"),
    ):
        res = SpeculativeDecoder(
            eng, draft, mode="chain" if tree.startswith("chain") else "tree", tree=tree, sampling=sp
        ).generate(PROMPT, N)
        assert res.tokens == want, (name, tree)
        accepted = max(accepted, res.stats.mean_accepted)
    assert accepted > 1.3, "no tree path was accepted: the path-dependent rows went unchecked"
    bd = BatchDecoder(eng, layer, tree="full:3,2", max_batch=2)
    other = [4, 6, 8]
    rows = bd.generate_many([PROMPT, other], N, sampling=[sp, sp])
    assert rows[0].tokens == want and rows[1].tokens == reference_greedy(eng, other, N, sp)
    # a batch without trees reduces every root row at once (guards.root_reductions): a penalised
    # row is read on the host, processed; beside an unpenalised one that keeps the shortcut
    bv = BatchDecoder(eng, None, mode="vanilla", max_batch=2)
    rows = bv.generate_many([PROMPT, other], N, sampling=[sp, SamplingParams()])
    assert rows[0].tokens == want and rows[1].tokens == reference_greedy(eng, other, N, SamplingParams())


@pytest.mark.parametrize("tree", ["chain:3", "full:2,2"])
def test_the_draft_proposes_what_the_penalised_target_picks(target, tree):
    """The draft's rows are penalised along each node's path too (TokenHistory.process_draft):
    with the target itself as the draft, a penalised chain is accepted whole at every step but
    the last (without that, every penalised token it proposes unpenalised is rejected)."""
    sp = CASES["all"]
    eng = TorchEngine(target)
    res = SpeculativeDecoder(eng, ModelDraft(TorchEngine(target)), tree=tree, sampling=sp).generate(PROMPT, N)
    assert res.tokens == reference_greedy(eng, PROMPT, N, sp)
    depth = {"chain:3": 3, "full:2,2": 2}[tree]
    assert res.stats.target_calls - 1 <= -(-N // (depth + 1)), res.stats.target_calls  # (+1: the prefill)


def test_greedy_with_penalties_equals_transformers_generate(tmp_path):
    """transformers' generate(repetition_penalty=, sequence_bias=) on a Llama 3 checkpoint it
    wrote, loaded by our HF loader: the same tokens from our vanilla and tree decoding."""
    from test_families import make_family

    hf, ours, cfg = make_family("llama3", tmp_path)
    with torch.no_grad():  # logits a few units apart, as a trained model's
        hf.lm_head.weight.mul_(0.2)
        ours.lm_head.weight.mul_(0.2)
    prompt = [int(x) for x in torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3))]
    bias = {prompt[-1]: 2.5, 17: -3.0}
    theirs = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=N,
        do_sample=False,
        repetition_penalty=1.4,
        sequence_bias={(t,): b for t, b in bias.items()},
    )[0, len(prompt) :].tolist()
    plain = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False)[0, len(prompt) :].tolist()
    assert theirs != plain
    sp = SamplingParams(repetition_penalty=1.4, logit_bias=bias)
    eng = TorchEngine(ours)
    assert SpeculativeDecoder(eng, mode="vanilla", sampling=sp).generate(prompt, N).tokens == theirs
    draft = ModelDraft(TorchEngine(truncated(ours, 1)))
    assert SpeculativeDecoder(eng, draft, tree="full:3,2", sampling=sp).generate(prompt, N).tokens == theirs


def test_token_history_by_hand_counts_the_path_and_the_history():
    """One row by hand: repetition over prompt + output + path, presence/frequency over output +
    path (each occurrence), the bias, and the row it was given left as it was."""
    sp = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={4: 1.0})
    h = TokenHistory([1, 2], 6, sp)
    h.extend([3, 3])
    row = torch.tensor([1.0, 2.0, -2.0, 4.0, 1.0, 8.0])
    got = h.process(row, [5, 3])
    # token 1, 2: prompt (repetition only); 3: output x2 + path x1; 5: path x1; 4: bias only
    want = torch.tensor([1.0, 1.0, -4.0, 2.0 - (0.5 + 0.75), 2.0, 4.0 - (0.5 + 0.25)])  # 4: 1 + 1 (bias)
    assert torch.equal(got, want)
    assert torch.equal(row, torch.tensor([1.0, 2.0, -2.0, 4.0, 1.0, 8.0]))
    assert torch.equal(h.process(row, []), torch.tensor([1.0, 1.0, -4.0, 2.0 - 1.0, 2.0, 8.0]))


def test_generator_takes_penalties_and_says_what_is_wrong(target):
    """The embedding API: penalties as keyword arguments, one decoder per kind of call (not one
    per setting: each holds a KV cache), one-line errors for bad values and unknown keywords."""
    eng = TorchEngine(target)
    layer = ModelDraft(TorchEngine(truncated(target, 2)))
    sp = CASES["all"]
    with Generator(eng, layer, tree="full:3,2") as gen:
        got = gen.generate(
            PROMPT, N, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={12: 3.0}
        )
        assert got.tokens == reference_greedy(eng, PROMPT, N, sp)
        streamed = [t for chunk in gen.stream(PROMPT, N, ids=True, repetition_penalty=1.6) for t in chunk]
        assert streamed == reference_greedy(eng, PROMPT, N, CASES["repetition"])
        for t in (0.5, 0.7, 0.9):
            gen.generate(PROMPT, 4, temperature=t, min_p=0.1, frequency_penalty=t)
        assert len(gen._decoders) == 2
        for kw, msg in (
            ({"repetition_penalty": 0}, "repetition-penalty must be > 0"),
            ({"presence_penalty": 3}, "presence-penalty must be in [-2, 2]"),
            ({"min_p": 1.0}, "min-p must be in [0, 1)"),
            ({"logit_bias": {"x": 1}}, "logit-bias keys must be token ids"),
            ({"logit_bias": {5: 200}}, "logit-bias values must be in [-100, 100]"),
            ({"logit_bias": {V: 1.0}}, f"logit-bias token id {V} is outside the vocabulary"),
            ({"top_n": 3}, "unexpected keyword argument 'top_n'"),
        ):
            with pytest.raises(InputError, match=re.escape(msg)):
                gen.generate(PROMPT, 4, **kw)


EOS = 4


def reference_with_end(engine, prompt, n, sp, eos) -> list[int]:
    """The plain loop with the request's end: EOS (and stop_token_ids) masked before min_tokens,
    the answer cut at the first ending id (none with ignore_eos)."""
    end = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos))
    out: list[int] = []
    for _ in range(n):
        row = reference_penalties(plain_next_logits(engine, list(prompt) + out), prompt, out, sp)
        if len(out) < sp.min_tokens:
            for t in end:
                row[t] = float("-inf")
        out.append(int(row.argmax()))
        if out[-1] in end:
            break
    return out


def test_min_tokens_stop_token_ids_and_ignore_eos_in_every_mode(target):
    """vLLM's end-of-answer fields: an EOS the bias makes likely ends the answer at once; with
    min_tokens it cannot come before them (masked along each row's tree path); stop_token_ids end
    it too; ignore_eos runs to max tokens through EOS. Vanilla, tree and batched: the plain loop's."""
    eng = TorchEngine(target)
    layer = ModelDraft(TorchEngine(truncated(target, 2)))
    base = {"logit_bias": {EOS: 2.5}}
    plain = reference_with_end(eng, PROMPT, N, SamplingParams(**base), [EOS])
    assert plain[-1] == EOS and len(plain) < 8, plain
    unbiased = reference_with_end(eng, PROMPT, N, SamplingParams(), [EOS])
    assert len(unbiased) == N and EOS not in unbiased
    cases = [  # (the request, the answer it must differ from)
        ({**base, "min_tokens": 10}, plain),
        ({**base, "ignore_eos": True}, plain),
        ({**base, "min_tokens": 6, "ignore_eos": True}, plain),
        ({"stop_token_ids": [unbiased[5]]}, unbiased),
    ]
    for kw, other in cases:
        sp = SamplingParams(**kw)
        want = reference_with_end(eng, PROMPT, N, sp, [EOS])
        assert want != other, kw
        if sp.min_tokens and not sp.ignore_eos:
            assert EOS not in want[:10] and len(want) > 10
        if sp.ignore_eos:
            assert len(want) == N and EOS in want
        if sp.stop_token_ids:
            assert want[-1] == unbiased[5] and len(want) <= 6
        end = sp.end_ids([EOS])
        for draft, tree in ((None, None), (layer, "full:3,2"), (layer, "chain:3")):
            dec = SpeculativeDecoder(
                eng, draft, mode="vanilla" if draft is None else "tree", tree=tree or "full:3,2", sampling=sp
            )
            assert dec.generate(PROMPT, N, end).tokens == want, (kw, tree)
        bd = BatchDecoder(eng, layer, tree="full:3,2", max_batch=2)
        rows = bd.generate_many([PROMPT, [4, 6, 8]], N, end, sampling=[sp, sp])
        assert rows[0].tokens == want, kw
    with Generator(eng, layer, tree="full:3,2", eos_token_ids=[EOS]) as gen:
        c = gen.generate(PROMPT, N, min_tokens=10, **base)
        assert c.tokens == reference_with_end(eng, PROMPT, N, SamplingParams(**base, min_tokens=10), [EOS])
        assert c.stop_reason == "eos"
        assert len(gen.generate(PROMPT, N, ignore_eos=True, **base).tokens) == N
        for kw, msg in (
            ({"min_tokens": -1}, "min-tokens must be an integer >= 0"),
            ({"stop_token_ids": [V]}, f"stop-token-ids: {V} is outside the vocabulary"),
            ({"stop_token_ids": "3"}, "stop-token-ids must be a list of token ids"),
            ({"ignore_eos": "yes"}, "ignore-eos must be a boolean"),
        ):
            with pytest.raises(InputError, match=re.escape(msg)):
                gen.generate(PROMPT, 4, **kw)
