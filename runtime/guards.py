"""Numerical guards: NaN or Inf in an engine's logits is an error at the step it appears.

Role in one decode step: after the verify call (step 3), before accepting (step 4), the rows the
accept rule will read are checked: a broken engine or an fp16 overflow surfaces as one
`NumericalError` naming the step and the engine, never as silent tokens. Cheap: a reduction
over the rows used (the accepted path's rows and the next token's), not the whole [T, V] block
(on the CPU one float64 numpy sum: about 5 us per 49k row).
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
