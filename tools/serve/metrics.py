"""The server's Prometheus metrics (GET /metrics): requests, errors, tokens, verify calls, queue.

Role in one decode step: none; each finished generation adds its statistics (a Completion's or Stream's `stats`:
tokens, verify calls, decode seconds) here.
"""

from __future__ import annotations

from arborspec.runtime.errors import ArborspecError


def _ort_shared_pool() -> bool:
    """Whether ONNX Runtime sessions of this process run on the shared pool (False without ORT)."""
    try:
        from arborspec.runtime.backends.ort_loader import shared_pool

        return shared_pool()
    except ArborspecError:
        return False


class ServerMetrics:
    """One registry of the server's counters and gauges; the pool's queue, busy slots and batch
    size are read when scraped."""

    def __init__(self, pool):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        reg = self.registry = CollectorRegistry()
        self.requests = Counter("arborspec_requests", "requests served", ["route"], registry=reg)
        self.errors = Counter("arborspec_request_errors", "requests that failed", ["status"], registry=reg)
        self.tokens = Counter("arborspec_generated_tokens", "tokens generated", registry=reg)
        self.steps = Counter("arborspec_verify_steps", "target verify calls", registry=reg)
        self.decode_s = Counter("arborspec_decode_seconds", "time spent decoding", registry=reg)
        queue = Gauge("arborspec_queue_depth", "requests waiting for a generator", registry=reg)
        active = Gauge("arborspec_active_sequences", "sequences being decoded", registry=reg)
        self.tokens_per_s = Gauge("arborspec_tokens_per_second", "decode tokens/s of the last request", registry=reg)
        self.accepted = Gauge("arborspec_mean_accepted", "tokens per verify call over all requests", registry=reg)
        self.ort_pool = Gauge(
            "arborspec_ort_shared_pool",
            "1: this process's ONNX Runtime sessions share one intra-op thread pool (arborspec.enable_shared_pool)",
            registry=reg,
        )
        batch = Gauge("arborspec_mean_batch_size", "sequences per verify call (batched decoding)", registry=reg)
        batch.set_function(lambda: getattr(pool, "mean_batch", 0.0))
        queue.set_function(lambda: pool.waiting)
        active.set_function(lambda: pool.busy)
        self.totals = {"tokens": 0, "steps": 0}

    def count_generation(self, st) -> None:
        """Add one generation's statistics (a Completion's or a Stream's `stats`)."""
        self.totals["tokens"] += st.new_tokens
        self.totals["steps"] += st.steps
        self.tokens.inc(st.new_tokens)
        self.steps.inc(st.steps)
        self.decode_s.inc(st.decode_s)
        self.tokens_per_s.set(st.tokens_per_s)

    def render(self) -> str:
        """The Prometheus text of every metric now."""
        from prometheus_client import generate_latest

        totals = self.totals
        self.accepted.set(totals["tokens"] / totals["steps"] if totals["steps"] else 0.0)
        self.ort_pool.set(1.0 if _ort_shared_pool() else 0.0)
        return generate_latest(self.registry).decode()
