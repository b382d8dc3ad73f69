"""Negative controls: the exact lossless checks of tests/runtime/test_exact_lossless.py, run on a
deliberately wrong accept rule, must fail, for every rule (top-k, sample, sample-unique, the
seed write-up's) and every draft kind (model, lookup, EAGLE-3, mixed, batched). The wrong rules
are the planted bugs of tests/mutants.py, swapped into the running code (the function's code
object replaced, restored afterwards), so the checks are shown able to see each bug."""

from __future__ import annotations

import types
from contextlib import contextmanager
from pathlib import Path

import pytest
from lossless_util import ACCEPT_SITE, seed_rule_accept
from mutants import MUTANTS
from test_exact_lossless import FORK_TREE, TOL, batch_tv, generation_tv, step_tv, target_module  # noqa: F401

from arborspec.runtime import accept as accept_mod
from arborspec.runtime.sampling import SamplingParams

BY_NAME = {m.name: m for m in MUTANTS}


@contextmanager
def mutated(module, name: str):
    """Run `module` with mutant `name` (its snippet replaced) applied to its functions."""
    m = BY_NAME[name]
    src = Path(module.__file__).read_text()
    assert src.count(m.snippet) == 1, f"mutant {name!r}: snippet not found once in {module.__file__}"
    ns = {"__name__": module.__name__, "__package__": module.__package__, "__file__": module.__file__}
    exec(compile(src.replace(m.snippet, m.replacement), module.__file__, "exec"), ns)
    saved = []
    for key, fn in vars(module).items():
        new = ns.get(key)
        if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__ and new.__code__ != fn.__code__:
            saved.append((fn, fn.__code__))
            fn.__code__ = new.__code__
    assert saved, f"mutant {name!r} changed no function"
    try:
        yield
    finally:
        for fn, code in saved:
            fn.__code__ = code


@contextmanager
def seed_rule():
    mod, name = ACCEPT_SITE
    orig = getattr(mod, name)
    setattr(
        mod,
        name,
        lambda logits, tree, sp, rng, root_probs=None, hooks=None: seed_rule_accept(
            logits, tree, sp, rng
        ),
    )
    try:
        yield
    finally:
        setattr(mod, name, orig)


TOPK_BUGS = ["topk keeps the rejected token", "topk: depth >= 3 accepted unconditionally"]
SP = SamplingParams(1.0, 3)


@pytest.mark.parametrize("bug", TOPK_BUGS)
@pytest.mark.parametrize(
    "kind,tree",
    [
        ("model", "full:3,2"),
        ("lookup", "full:3,2"),
        ("eagle3", "full:3,2"),
        ("mixed", "dynamic:2,3,6"),
        ("suffix", "full:3,2"),
        ("eagle3+suffix", "dynamic:2,3,6"),
    ],
)
def test_topk_rule_bugs_are_seen(target_module, tmp_path, kind, tree, bug):  # noqa: F811
    if kind != "model" and "depth" in bug:
        pytest.skip("depth-3 acceptances are rare with this draft: the model draft carries this control")
    with mutated(accept_mod, bug):
        assert generation_tv(target_module, tmp_path, kind, tree, SP, stop_above=10 * TOL) > 10 * TOL


@pytest.mark.parametrize(
    "bug,kind,cand",
    [
        ("residual not updated after a rejection", "model", "sample"),
        ("residual not updated after a rejection", "lookup", "sample"),
        ("residual not updated after a rejection", "mixed", "sample"),
        ("sampled accepted when p/q >= 0.5, no draw", "model", "sample"),
        ("sampled: depth >= 3 accepted unconditionally", "model", "sample"),
        ("sample-unique keeps the rejected token in q", "model", "sample-unique"),
        ("sample-unique keeps the rejected token in q", "eagle3", "sample-unique"),
    ],
)
def test_sampled_rule_bugs_are_seen(target_module, tmp_path, bug, kind, cand):  # noqa: F811
    sp = SamplingParams(1.0, 2 if cand == "sample" and kind == "model" else 3)
    with mutated(accept_mod, bug):
        assert step_tv(target_module, tmp_path, kind, cand, FORK_TREE, sp, stop_above=10 * TOL) > 10 * TOL


def test_the_seed_rule_is_seen(target_module, tmp_path):  # noqa: F811
    with seed_rule():
        assert (
            generation_tv(target_module, tmp_path, "model", "full:2,2", SP, keep_q=True, stop_above=10 * TOL) > 10 * TOL
        )


@pytest.mark.parametrize(
    "cand,bug", [("topk", "topk keeps the rejected token"), ("sample", "residual not updated after a rejection")]
)
def test_batched_rule_bugs_are_seen(target_module, tmp_path, cand, bug):  # noqa: F811
    with mutated(accept_mod, bug):
        assert batch_tv(target_module, tmp_path, cand, stop_above=10 * TOL) > 10 * TOL


def test_every_mutant_names_code_that_exists():
    """Each mutant's snippet stands exactly once in its file: a refactor that moves the code
    must move the mutant too (tests/mutation.py would report it `stale`, not `killed`)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for m in MUTANTS:
        src = (root / m.file).read_text()
        assert src.count(m.snippet) == 1, f"mutant {m.name!r}: snippet found {src.count(m.snippet)} times in {m.file}"
