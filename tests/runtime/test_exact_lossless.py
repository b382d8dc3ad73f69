"""Lossless sampling, proven by exact computation: the decoder's output distribution over its
first tokens equals the warped target's, computed both ways without sampling noise.

The target side enumerates the target's support token by token (`exact_target_joint`). The
decoder side runs the real decoder with its random draws enumerated (`Enumeration`,
tests/lossless_util.py): every coin of the accept rule, every bonus/corrected token and every
sampled candidate set is a branch whose probability is the code's own, and the decoder is
re-run once per outcome combination that can change its output. Sums of float64 products of
the code's float32 probabilities: a correct decoder matches to ~1e-6 in total variation
(measured <= 3e-7); TOL = 1e-4 is a hundred times below the smallest planted bug seen by these
cases (the sample-unique rule that keeps the rejected token in q: TV >= 0.01 on the first token,
see docs/testing.md), so the power to detect a TV error of 0.01 is 1 (no randomness).

Two ways to run the decoder:
  * whole generations of M = 3 tokens (several steps: the draft's and the target's caches
    carried from step to step are part of what is checked), with top-k candidates (full,
    beam, dynamic trees with siblings, depth 3), and batched (each row of a batch of two);
  * the first step alone, completed with the target for the tokens it did not emit (a step is
    lossless iff that completion equals the target's joint over D + 1 tokens), with sampled
    candidates (`sample`, `sample-unique`), whose trees are random and would make whole
    generations too many branches. The per-step exactness chains: the step after a step
    starts from the committed tokens, which the multi-step cases check carry over exactly.
Supports are cut with top-k / top-p so the enumeration stays in the hundreds of runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_model, tiny_config
from lossless_util import (
    Enumeration,
    complete_with_target,
    draft_modules,
    exact_target_joint,
    excess,
    first_step,
    make_draft,
    memoized_forward,
    total_variation,
)

from arborspec.models.eagle3 import default_aux_layers
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.sampling import SamplingParams
from arborspec.runtime.trees import StaticTree

V = 8
M = 3
TOL = 1e-4
PROMPT = [1, 3, 2, 1, 3, 5, 1, 3]  # repeats itself: lookup proposes after "1 3"
# siblings at the root and at depth 2, depth 3: what sampled candidates are checked on
FORK_TREE = [[0], [1], [0, 0], [0, 0, 0], [0, 0, 1]]


@pytest.fixture(scope="module")
def target_module():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    cfg = dataclasses.replace(tiny_config("llama", vocab=V, layers=2, hidden=32), tie_embeddings=False)
    m = random_model(cfg, seed=5, scale=2.0)
    m.feature_layers = default_aux_layers(2)
    yield m
    torch.set_num_threads(threads)


def tree_of(spec):
    return StaticTree(spec) if isinstance(spec, list) else spec


def decoder_distribution(target_module, draft, run, focus=None, stop=None):
    with Enumeration(focus) as e, memoized_forward(target_module, *draft_modules(draft)):
        dist = e.distribution(run, stop)
    print(f"{e.runs} runs")
    return dist, e.runs


MULTI = [
    ("model", "full:3,2", SamplingParams(1.0, 3)),
    ("model", "beam:2,3,3", SamplingParams(0.8, 0, 0.8)),
    ("model", "dynamic:2,3,6", SamplingParams(0.7, 4, 0.95)),
    ("lookup", "full:3,2", SamplingParams(1.0, 3)),
    ("eagle3", "full:3,2", SamplingParams(1.0, 3)),
    ("mixed", "dynamic:2,3,6", SamplingParams(1.0, 3)),
    ("suffix", "full:3,2", SamplingParams(1.0, 3)),
    ("model+suffix", "full:2,2", SamplingParams(1.0, 3)),
    ("eagle3+suffix", "dynamic:2,3,6", SamplingParams(1.0, 3)),
    # the request's penalties read each row's tree path (runtime/penalties.py), min-p cuts
    ("model", "full:3,2", SamplingParams(1.0, 3, repetition_penalty=1.8, presence_penalty=0.8, logit_bias={6: 1.5})),
    ("lookup", "full:3,2", SamplingParams(0.8, 0, 0.9, min_p=0.15, frequency_penalty=0.7, repetition_penalty=1.5)),
    ("eagle3", "full:3,2", SamplingParams(1.0, 3, repetition_penalty=1.5, logit_bias={1: 1.0})),  # a token map
]


def stopper(want, stop_above, complete=None):
    """For the negative controls: end the enumeration once TV is surely above `stop_above`."""
    if stop_above is None:
        return None
    return lambda d: excess(complete(d) if complete else d, want) > stop_above


def generation_tv(target_module, folder, kind, tree, sp, keep_q=False, stop_above=None) -> float:
    """TV between the decoder's M-token generations (top-k candidates) and the target's (with
    stop_above: a lower bound, once it is above)."""
    eng = TorchEngine(target_module)
    draft = make_draft(kind, target_module, folder, V)
    want = exact_target_joint(eng, PROMPT, sp, M)
    assert max(len(k) for k in want) == M and len(want) >= 8  # a spread distribution
    dec = SpeculativeDecoder(eng, draft, tree=tree, candidates="topk", sampling=sp)
    dec.keep_draft_probs = keep_q  # the seed rule reads q for top-k candidates too
    run = lambda: tuple(dec.generate(PROMPT, M).tokens)  # noqa: E731
    got, runs = decoder_distribution(target_module, draft, run, stop=stopper(want, stop_above))
    return max(total_variation(got, want), excess(got, want))


def pen(sp) -> str:
    return "-penalised" if sp.processes_logits else ""


@pytest.mark.parametrize("kind,tree,sp", MULTI, ids=[f"{k}-{t}{pen(sp)}" for k, t, sp in MULTI])
def test_generations_are_exactly_the_target_distribution(target_module, tmp_path, kind, tree, sp):
    """Top-k candidates, M tokens over several steps: P_decoder(x1..x3) == P_target(x1..x3)."""
    tv = generation_tv(target_module, tmp_path, kind, tree, sp)
    assert tv < TOL, f"{kind} {tree}: TV {tv:.2e}"


STEP = [
    ("model", "sample", FORK_TREE, SamplingParams(1.0, 2)),
    ("model", "sample-unique", FORK_TREE, SamplingParams(1.0, 3)),
    ("model", "sample-unique", "full:3,2", SamplingParams(1.0, 2)),
    ("lookup", "sample", FORK_TREE, SamplingParams(1.0, 3)),
    ("eagle3", "sample-unique", FORK_TREE, SamplingParams(1.0, 3)),
    ("mixed", "sample", FORK_TREE, SamplingParams(1.0, 3)),
    ("suffix", "sample", FORK_TREE, SamplingParams(1.0, 3)),
    ("eagle3+suffix", "sample", FORK_TREE, SamplingParams(1.0, 3)),
    ("model", "sample-unique", FORK_TREE, SamplingParams(1.0, 3, repetition_penalty=1.6, frequency_penalty=0.9)),
]


@pytest.mark.parametrize(
    "kind,cand,tree,sp",
    STEP,
    ids=[f"{k}-{c}-{t if isinstance(t, str) else 'fork'}{pen(sp)}" for k, c, t, sp in STEP],
)
def test_one_step_is_exactly_lossless(target_module, tmp_path, kind, cand, tree, sp):
    """One step (any candidate mode), completed with the target: == the target's joint over
    depth + 1 tokens (every accepted depth, the bonus token included)."""
    tv = step_tv(target_module, tmp_path, kind, cand, tree, sp)
    assert tv < TOL, f"{kind} {cand}: TV {tv:.2e}"


def step_tv(target_module, folder, kind, cand, tree, sp, stop_above=None) -> float:
    """TV between one step completed with the target and the target, over depth + 1 tokens."""
    eng = TorchEngine(target_module)
    draft = make_draft(kind, target_module, folder, V)
    dec = SpeculativeDecoder(eng, draft, tree=tree_of(tree), candidates=cand, sampling=sp)
    m = dec.policy.depth + 1
    want = exact_target_joint(eng, PROMPT, sp, m)
    complete = lambda d: complete_with_target(d, want, m)  # noqa: E731
    stop = stopper(want, stop_above, complete)
    got, runs = decoder_distribution(target_module, draft, lambda: first_step(dec, PROMPT, m), stop=stop)
    if stop is None:  # some steps accept past depth 1 (the model draft: a whole depth-3 path)
        assert max(len(k) for k in got) >= (m if kind == "model" else 3)
    return max(total_variation(complete(got), want), excess(complete(got), want))


@pytest.mark.parametrize("cand", ["topk", "sample"])
def test_batched_rows_are_exactly_the_target_distribution(target_module, tmp_path, cand):
    """Two sequences of different lengths decoded together: each row's M tokens follow its own
    prompt's target distribution (the other row's draws held fixed)."""
    tv = batch_tv(target_module, tmp_path, cand)
    assert tv < TOL, f"TV {tv:.2e}"


def batch_tv(target_module, folder, cand, stop_above=None) -> float:
    """The larger TV of the two rows of a batch against their targets: M tokens of whole
    generations with top-k candidates, the first step completed with the target with sampled
    ones (as for one sequence)."""
    eng = TorchEngine(target_module)
    draft = make_draft("model", target_module, folder, V)
    prompts = [PROMPT, [4, 6]]
    sp = SamplingParams(1.0, 3 if cand == "topk" else 2)
    bd = BatchDecoder(
        eng, draft, tree=tree_of("full:3,2" if cand == "topk" else FORK_TREE), candidates=cand, max_batch=2
    )
    m = M if cand == "topk" else bd.policy.depth + 1

    def first_steps():
        seqs = [bd.add(p, m, (), seed, sampling=sp) for seed, p in enumerate(prompts)]
        out = dict(bd.step())
        for s in seqs:
            bd.remove(s)
        return [tuple(out[s]) for s in seqs]

    worst = 0.0
    for row, prompt in enumerate(prompts):
        want = exact_target_joint(eng, prompt, sp, m)
        if cand == "topk":
            got, _ = decoder_distribution(
                target_module,
                draft,
                lambda r=row: tuple(bd.generate_many(prompts, m, sampling=sp, seeds=[0, 1])[r].tokens),
                focus=row,
                stop=stopper(want, stop_above),
            )
        else:
            complete = lambda d: complete_with_target(d, want, m)  # noqa: E731
            stop = stopper(want, stop_above, complete)
            got, _ = decoder_distribution(target_module, draft, lambda r=row: first_steps()[r], focus=row, stop=stop)
            got = complete(got)
        worst = max(worst, total_variation(got, want), excess(got, want))
        if stop_above is not None and worst > stop_above:
            break
    return worst
