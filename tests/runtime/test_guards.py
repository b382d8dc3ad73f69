"""NaN / Inf in an engine's logits is reported at the step where it appears, naming the engine,
as one ArborspecError line: never turned into tokens."""

from __future__ import annotations

import pytest
import torch

from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.errors import ArborspecError, NumericalError
from arborspec.runtime.guards import check_logits


class BreaksAtCall:
    """An engine wrapper whose logits turn NaN (or Inf) from its n-th call on."""

    def __init__(self, engine, n: int, value=float("nan")):
        self.engine, self.n, self.value, self.calls = engine, n, value, 0
        self.info, self.device, self.caps = engine.info, engine.device, engine.caps

    def forward(self, *a):
        self.calls += 1
        out = self.engine.forward(*a)
        if self.calls >= self.n:
            out = out.clone()
            out[..., 3] = self.value
        return out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("mode,tree", [("vanilla", "full:2,2"), ("tree", "full:2,2"), ("tree", "dynamic:2,2,4")])
def test_nan_logits_stop_decoding_at_that_step(llama_pair, value, mode, tree):
    target, draft = llama_pair
    broken = BreaksAtCall(target, n=4, value=value)  # the prefill is call 1: decode step 3 breaks
    dec = SpeculativeDecoder(broken, draft if mode == "tree" else None, mode=mode, tree=tree)
    got, stream = [], dec.stream([1, 5, 7, 9], 20)
    with pytest.raises(NumericalError) as e:
        for chunk in stream:
            got += chunk
    msg = str(e.value)
    assert ("NaN" if value != value else "Inf") in msg and "decode step 3" in msg and target.info.name in msg
    assert "\n" not in msg and isinstance(e.value, ArborspecError)
    ref = SpeculativeDecoder(target, draft if mode == "tree" else None, mode=mode, tree=tree).generate([1, 5, 7, 9], 20)
    assert got == ref.tokens[: len(got)] and stream.result.stats.steps == 2  # two good steps, then the error


def test_check_logits_reads_only_the_rows_it_is_given():
    x = torch.zeros(4, 10)
    x[2, 5] = float("nan")
    check_logits(x, [0, 1, 3], 1, "e")  # the broken row is not one the accept rule read
    with pytest.raises(NumericalError, match="NaN in the logits of e at decode step 7"):
        check_logits(x, [0, 2], 7, "e")


def test_a_batchs_root_reductions_are_each_rows_own():
    """guards.root_reductions (a roots-only batch step, every row at once) gives each row what
    accept_greedy and check_logits give it alone: the first index of the maximum (ties too) and
    whether the row is finite (a NaN, +Inf or -Inf anywhere in it makes it not)."""
    from arborspec.runtime.accept import accept_greedy
    from arborspec.runtime.guards import root_reductions
    from arborspec.runtime.trees import Tree

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 300, generator=g)
    x[1, 0, [7, 250]] = 9.0  # a tie: the first index wins
    x[2, 0, 11] = float("nan")
    x[3, 0, 5] = float("inf")
    x[4, 0, 299] = float("-inf")
    best, finite = root_reductions(x)
    assert finite == [True, True, False, False, False, True]
    for r in (0, 1, 5):
        assert best[r] == accept_greedy(x[r], Tree.empty()).tokens[0]
    assert best[1] == 7
    for r in range(6):
        try:
            check_logits(x[r], [0], 1, "t")
            alone = True
        except NumericalError:
            alone = False
        assert finite[r] == alone
