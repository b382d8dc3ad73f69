"""The server's generators: a pool of `Generator`s whose free slots the requests take.

Role in one decode step: none of its own; a request's generation runs on the generator it took
(runtime/generator.py), `slots` sequences of one generator decoded together (continuous batching,
runtime/batch_scheduler.py).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class GeneratorPool:
    """N generators with `slots` sequences each (their max_batch); `acquire()` blocks until a
    slot is free (the queue depth is what waits) and returns its generator: of the free ones, the
    one whose cache holds the longest start of the request's prompt (`Generator.cached_prefix`),
    so that a chat's next turn goes where its earlier turns are kept."""

    def __init__(self, factory: Callable[[], Any], workers: int, slots: int = 1):
        self.all = [factory() for _ in range(workers)]
        self.slots = slots
        self.free = [g for _ in range(slots) for g in self.all]
        self.waiting = 0
        self._cv = threading.Condition()

    def acquire(self, timeout: float | None = None, ids: list[int] | None = None):
        """A free generator (waiting up to `timeout` s; None: no limit; queue.Empty past it); with
        the prompt's `ids`, the free one that keeps most of it."""
        with self._cv:
            self.waiting += 1
            try:
                if not self._cv.wait_for(lambda: self.free, timeout):
                    raise queue.Empty
                best = 0
                gens = {id(g): g for g in self.free}  # a batching generator is free once per slot
                if ids is not None and len(gens) > 1:
                    kept = {k: g.cached_prefix(ids) for k, g in gens.items()}
                    best = max(range(len(self.free)), key=lambda i: kept[id(self.free[i])])
                return self.free.pop(best)
            finally:
                self.waiting -= 1

    def release(self, g) -> None:
        with self._cv:
            self.free.append(g)
            self._cv.notify()

    @property
    def busy(self) -> int:
        return len(self.all) * self.slots - len(self.free)

    @property
    def mean_batch(self) -> float:
        """Sequences per verify call, over every batched generator's steps so far."""
        sched = [g._batch for g in self.all if getattr(g, "_batch", None) is not None]
        steps = sum(b.steps for b in sched)
        return sum(b.batch_sizes for b in sched) / steps if steps else 0.0

    def close(self) -> None:
        for g in self.all:
            g.close()
