"""Per-generation statistics: what a step cost and what it bought.

Role in one decoding step: every phase of the step (draft, verify, accept+KV, other) adds its
wall time here, and every target call its committed token count, so `mean_accepted` (tokens
per target call) and the time split come out of the same run that produced the text.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    mode: str = "tree"
    tree: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V a previous prefill left in the cache (PrefixCache)
    new_tokens: int = 0
    steps: int = 0  # decode steps (= verify calls after the prefill)
    target_calls: int = 0  # verify calls + prefill calls
    draft_calls: int = 0
    tree_nodes: int = 0  # drafted nodes verified, summed over steps
    held_steps: int = 0  # steps the governor ran without a tree, where it measured the tree not paying
    prefill_s: float = 0.0
    draft_s: float = 0.0
    draft_model_s: float = 0.0  # inside draft engine calls (part of draft_s)
    verify_s: float = 0.0
    accept_kv_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    ttft_s: float | None = None  # time to first token: from the call to the first committed token
    accepted_hist: dict = field(default_factory=dict)  # tokens committed per step -> count

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per verify call (drafted tokens accepted + the target's own one)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens over decode time (prefill excluded)."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def overhead_per_step_ms(self) -> float:
        """The runtime's own time per step, model calls excluded: tree building (draft time
        outside draft engine calls) + flatten + accept + KV commits + loop bookkeeping."""
        own = self.draft_s - self.draft_model_s + self.accept_kv_s + self.other_s
        return 1e3 * own / self.steps if self.steps else 0.0

    def record_step(self, tree_nodes: int, draft_calls: int, n_new: int, elapsed: float) -> None:
        """One decode step's counts (the one place both decoders record them): one verify call
        over `tree_nodes` drafted nodes that cost `draft_calls`, `n_new` tokens committed,
        `elapsed` seconds since the generation started."""
        self.steps += 1
        self.target_calls += 1
        self.draft_calls += draft_calls
        self.tree_nodes += tree_nodes
        self.new_tokens += n_new
        self.accepted_hist[n_new] = self.accepted_hist.get(n_new, 0) + 1
        self.total_s = elapsed
        if self.ttft_s is None:
            self.ttft_s = elapsed

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted=self.mean_accepted,
            tokens_per_s=self.tokens_per_s,
            decode_s=self.decode_s,
            overhead_per_step_ms=self.overhead_per_step_ms,
        )
        return d


class Timer:
    """Accumulates wall time into a stats field: `with timer("verify_s"): ...`."""

    def __init__(self, stats: GenerationStats, sync=None):
        self.stats = stats
        self.sync = sync  # e.g. torch.cuda.synchronize, so GPU time lands in the right bucket

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            setattr(self.stats, name, getattr(self.stats, name) + time.perf_counter() - t0)
