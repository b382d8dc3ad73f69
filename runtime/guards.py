"""Numerical guards: NaN or Inf in an engine's logits is an error at the step it appears.

Role in one decode step: after the verify call (step 3), before accepting (step 4), the rows the
accept rule will read are checked: a broken engine or an fp16 overflow surfaces as one
`NumericalError` naming the step and the engine, never as silent tokens. Cheap: a reduction
over the rows used (the accepted path's rows and the next token's), not the whole [T, V] block
(on the CPU one float64 numpy sum per row).
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import NumericalError


def check_logits(logits: torch.Tensor, rows, step: int, engine_name: str) -> None:
    """logits [T, V]; rows: the row indices the accept rule reads (None: all)."""
    if logits.device.type == "cpu":  # SIMD sums of row views: NaN or Inf anywhere makes one non-finite
        a = logits.float().numpy()
        ok = bool(np.isfinite(a.sum() if rows is None else sum(float(a[r].sum()) for r in rows)))
    else:
        ok = bool(torch.isfinite(logits if rows is None else logits[rows]).all())
    if not ok:
        bad = "NaN" if bool(torch.isnan(logits if rows is None else logits[rows]).any()) else "Inf"
        raise NumericalError(
            f"{bad} in the logits of {engine_name or 'the target engine'} at decode step {step} "
            "(a broken engine or an fp16 overflow); no tokens were produced from it"
        )


def root_reductions(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """A roots-only batch call's logits [B, 1, V] -> every row's argmax and whether its logits are
    finite, reduced where the logits are and read back together: on a GPU two small copies a
    step instead of the [B, V] logits (25 MB at 128 rows of SmolLM2) or a device sync per row; on
    the CPU numpy's SIMD argmax and sums over the whole block (as check_logits and accept_greedy
    do one row at a time). The argmax is the first index of the maximum, as accept_greedy's."""
    x = logits[:, 0]
    if x.device.type == "cpu":
        a = x.float().numpy()
        return a.argmax(-1).tolist(), np.isfinite(a.sum(-1)).tolist()
    both = torch.stack([x.argmax(-1), torch.isfinite(x).all(-1).long()]).tolist()
    return both[0], [bool(ok) for ok in both[1]]
