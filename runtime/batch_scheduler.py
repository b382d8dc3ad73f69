"""Continuous batching: a thread that runs a BatchDecoder for many concurrent callers.

Role in one decode step: none of its own; between steps it lets waiting requests join the batch
(up to max_batch), drops cancelled ones (a client that went away frees its row), runs ONE
`BatchDecoder.step()` for everyone, and hands each sequence's new tokens to its caller's
`BatchStream`. Callers in any thread iterate their stream; errors of a step reach every
sequence in it as the exception their iterator raises.
"""

from __future__ import annotations

import queue
import threading
from collections import deque

from .batch_decode import BatchDecoder, BatchSequence
from .errors import ArborspecError, InputError
from .request import GenerationRequest, GenerationResult, as_request
from .stats import GenerationStats


class BatchStream:
    """One request's token chunks (lists of ids), in order. `result`: its GenerationResult so far
    (live once it joined the batch: its tokens, stats, log-probs grow with it), final once the
    iterator is exhausted; `cancel()` (or `close()`) frees the row at the next step."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.cancelled = threading.Event()
        self._seq: BatchSequence | None = None  # set when it joins the batch
        self._q: queue.Queue = queue.Queue()
        self._finished = False

    @property
    def result(self) -> GenerationResult:
        if self._seq is None:  # not (yet) in the batch: refused, cancelled or waiting
            return GenerationResult([], GenerationStats())
        return self._seq.result()

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self._finished:
            raise StopIteration
        kind, payload = self._q.get()
        if kind == "tokens":
            return payload
        self._finished = True
        if kind == "error":
            raise payload
        raise StopIteration

    def cancel(self) -> None:
        self.cancelled.set()

    close = cancel

    # scheduler side
    def _put(self, tokens: list[int]) -> None:
        self._q.put(("tokens", tokens))

    def _end(self, error: BaseException | None = None) -> None:
        self._q.put(("error", error) if error is not None else ("done", None))


class BatchScheduler:
    def __init__(self, decoder: BatchDecoder):
        self.decoder = decoder
        self._waiting: deque[BatchStream] = deque()
        self._owner: dict[int, BatchStream] = {}
        self._cv = threading.Condition()
        self._closed = False
        self.steps = 0
        self.batch_sizes = 0  # sum over steps of the sequences in the step (mean batch size)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="arborspec-batch")
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self.decoder.seqs)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request, *args, **kw) -> BatchStream:
        """Queue a request (a GenerationRequest, or its fields as BatchDecoder.add takes them); its
        stream yields token chunks as the batch decodes it (its `result` with the log-probs asked
        for, as BatchDecoder.add says)."""
        stream = BatchStream(as_request(request, *args, **kw))
        with self._cv:
            if self._closed:
                raise InputError("this generator is closed")
            self._waiting.append(stream)
            self._cv.notify()
        return stream

    def _loop(self) -> None:
        dec = self.decoder
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not dec.seqs:
                    self._cv.wait()
                if self._closed:
                    break
                joining = []
                while self._waiting and len(dec.seqs) + len(joining) < dec.max_batch:
                    joining.append(self._waiting.popleft())
            for stream in joining:
                if stream.cancelled.is_set():
                    stream._end()
                    continue
                try:
                    seq = dec.add(stream.request)
                    self._owner[id(seq)] = stream
                    stream._seq = seq  # live: a caller that stops early still sees its stats
                except ArborspecError as e:
                    stream._end(e)
                except Exception as e:  # a bug: its caller sees it, the other sequences go on
                    stream._end(e)
            for seq in list(dec.seqs):
                stream = self._owner[id(seq)]
                if stream.cancelled.is_set():
                    seq.stop_reason = "cancelled"
                    self._finish(seq, stream)
            if not dec.seqs:
                continue
            try:
                out = dec.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails every sequence in it
                for seq in list(dec.seqs):
                    self._finish(seq, self._owner[id(seq)], e)
                continue
            self.steps += 1
            self.batch_sizes += len(out)
            for seq, new in out:
                stream = self._owner[id(seq)]
                if seq.error is not None:  # its own row went bad: only this caller sees the error
                    self._finish(seq, stream, seq.error)
                    continue
                stream._put(new)
                if seq.done:
                    self._finish(seq, stream)
        for seq in list(dec.seqs):  # closing: end every stream
            self._finish(seq, self._owner[id(seq)], InputError("the generator was closed"))
        for stream in self._waiting:
            stream._end(InputError("the generator was closed"))
        self._waiting.clear()

    def _finish(self, seq: BatchSequence, stream: BatchStream, error: BaseException | None = None) -> None:
        self.decoder.remove(seq)
        self._owner.pop(id(seq), None)
        stream._end(error)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
        self.decoder.close()
