"""Sampling is lossless: the first two sampled tokens follow the target's exact (warped)
distribution under tree and chain modes, for top-k and sampled drafts, with temperature,
top-k and top-p; the seed write-up's accept rule, run through the same test, fails it."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from conftest import random_model, tiny_config, truncated
from lossless_util import (
    PROMPT,
    chi_square_pvalue,
    exact_two_token_distribution,
    sample_two_tokens,
    use_seed_rule,
)

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.sampling import SamplingParams

N = 2000
PASS_P = 1e-3


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    cfg = dataclasses.replace(tiny_config("llama", vocab=8, layers=2, hidden=32), tie_embeddings=False)
    m = random_model(cfg, seed=5, scale=2.0)
    yield TorchEngine(m), TorchEngine(truncated(m, 1))
    torch.set_num_threads(threads)


CASES = [
    ("tree", "full:2,3", "topk", SamplingParams(1.0)),
    ("tree", "full:2,3", "sample", SamplingParams(0.8, 0, 0.9)),
    ("tree", "full:2,3", "sample-unique", SamplingParams(1.0, 5, 1.0)),
    ("chain", "chain:2", "sample", SamplingParams(1.0)),
    ("chain", "chain:2", "topk", SamplingParams(0.8)),
    ("tree", "beam:3,4", "topk", SamplingParams(1.0, 0, 0.9)),
    ("tree", "dynamic:2,2,4", "topk", SamplingParams(0.7)),
]


@pytest.mark.parametrize("mode,tree,cand,sp", CASES, ids=[f"{c[1]}-{c[2]}-T{c[3].temperature}" for c in CASES])
def test_lossless(pair, mode, tree, cand, sp):
    target, draft = pair
    exact = exact_two_token_distribution(target, PROMPT, sp)
    dec = SpeculativeDecoder(target, draft, mode=mode, tree=tree, candidates=cand, sampling=sp)
    counts = sample_two_tokens(dec, PROMPT, N, seed0=zlib.crc32(f"{tree}/{cand}".encode()) % 10**6)
    p = chi_square_pvalue(counts, exact)
    assert p > PASS_P, f"{tree} {cand}: chi-square p = {p:.2e}"
    # the drafts were actually used: more than one token per verify call on average
    assert sum(dec.generate(PROMPT, 8, seed=s).stats.steps for s in range(20)) < 20 * 8


@pytest.mark.parametrize("cand", ["topk", "sample"])
def test_seed_rule_fails(pair, cand):
    """Same test, the seed's accept rule (independent sibling tests against the unmodified
    target distribution): the test tells it is not lossless."""
    target, draft = pair
    sp = SamplingParams(1.0)
    exact = exact_two_token_distribution(target, PROMPT, sp)
    dec = SpeculativeDecoder(target, draft, mode="tree", tree="full:2,3", candidates=cand, sampling=sp)
    dec.keep_draft_probs = True
    with use_seed_rule():
        counts = sample_two_tokens(dec, PROMPT, N, seed0=77)
    assert chi_square_pvalue(counts, exact) < 1e-6


@pytest.mark.parametrize("cand", ["topk", "sample"])
def test_lossless_lookup_draft(pair, cand):
    """A table draft with no model (n-gram lookup, most candidates at q = 0) is lossless too."""
    from arborspec.runtime.drafts.lookup import LookupDraft

    target, _ = pair
    sp = SamplingParams(1.0)
    prompt = [1, 3, 2, 1, 3, 5, 1, 3]
    exact = exact_two_token_distribution(target, prompt, sp)
    dec = SpeculativeDecoder(
        target, LookupDraft(8, max_ngram=2), mode="tree", tree="full:2,2", candidates=cand, sampling=sp
    )
    counts = sample_two_tokens(dec, prompt, N, seed0=4242)
    assert chi_square_pvalue(counts, exact) > PASS_P


@pytest.mark.parametrize("cand", ["topk", "sample"])
def test_lossless_suffix_draft(pair, cand):
    """The suffix draft proposes deterministic chains (top-k candidates whatever the mode): lossless."""
    from arborspec.runtime.drafts.spec import SuffixOptions
    from arborspec.runtime.drafts.suffix import SuffixDraft

    target, _ = pair
    sp = SamplingParams(1.0)
    prompt = [1, 3, 2, 1, 3, 5, 1, 3]
    exact = exact_two_token_distribution(target, prompt, sp)
    draft = SuffixDraft(8, SuffixOptions(min=1, alpha=2.0, paths=2))
    dec = SpeculativeDecoder(target, draft, mode="tree", tree="chain:1", candidates=cand, sampling=sp)
    counts = sample_two_tokens(dec, prompt, N, seed0=4343)
    assert chi_square_pvalue(counts, exact) > PASS_P


def test_sampled_candidates_need_a_fixed_structure(pair):
    target, draft = pair
    dec = SpeculativeDecoder(
        target, draft, mode="tree", tree="beam:3,4", candidates="sample", sampling=SamplingParams(1.0)
    )
    with pytest.raises(ValueError, match="candidates topk"):
        dec.generate(PROMPT, 2)
