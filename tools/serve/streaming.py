"""Streaming: a request's choices as server-sent events (`data: {...}` chunks, then `data: [DONE]`).

Role in one decode step: none of its own; each choice runs in a worker thread
(tools/serve/generation.py) and hands every piece its decode steps produce to one queue, which
the response drains as OpenAI's chunks (chat.completion.chunk / text_completion). A client that
disconnects stops every worker after its step.
"""

from __future__ import annotations

import json
import queue
import threading

from arborspec.runtime.chat import ToolCallStream
from arborspec.runtime.errors import ArborspecError, one_line
from arborspec.tools.serve.generation import run_choice
from arborspec.tools.serve.middleware import note_tokens
from arborspec.tools.serve.responses import chat_logprobs, text_logprobs, usage
from arborspec.tools.serve.state import ServerState

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ChunkWriter:
    """The chunks of one streamed request (its id, creation time, model); completions' chunks
    carry the text offset each choice has reached."""

    def __init__(self, chat: bool, model_name: str, rid: str, created: int, choices: int):
        self.chat, self.model_name, self.rid, self.created = chat, model_name, rid, created
        self.offset = [0] * choices  # completions: the text each choice has sent (its tokens' text_offset)

    def event(self, delta: dict | None = None, finish=None, usage=None, index: int = 0, lps=None) -> str:
        if self.chat:
            choice = {"index": index, "delta": delta or {}, "finish_reason": finish}
            if lps is not None:
                choice["logprobs"] = chat_logprobs(lps)
            obj = self._chunk("chat.completion.chunk", choice)
        else:
            choice = {
                "index": index,
                "text": (delta or {}).get("content", ""),
                "finish_reason": finish,
                "logprobs": text_logprobs({"logprobs": lps}, self.offset[index]),
            }
            self.offset[index] += len(choice["text"])
            obj = self._chunk("text_completion", choice)
        if usage is not None:
            obj["choices"], obj["usage"] = [], usage
        return sse(obj)

    def _chunk(self, obj: str, choice: dict) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_name, "choices": [choice]}


def start_workers(state: ServerState, request, jobs: list, chat: bool, q: queue.Queue, stop: threading.Event):
    """A thread per choice: ("chunk", i, (text, logprobs)) per piece, then ("done", i, record) or
    ("error", i, message) on q; each admitted sequence finished when its thread ends."""

    def work(i: int, prompt, p: dict):
        try:
            put = lambda c, lps: q.put(("chunk", i, (c, lps)))  # noqa: E731
            r = run_choice(state, prompt, p, chat, on_chunk=put, cancelled=stop.is_set)
            note_tokens(request, r["completion_tokens"])
            q.put(("done", i, r))
        except ArborspecError as e:
            q.put(("error", i, one_line(e)))
        except Exception as e:  # noqa: BLE001 - a bug: reported to the client, logged by uvicorn
            q.put(("error", i, f"internal error: {type(e).__name__}"))
            raise
        finally:
            state.finished()

    for i, (pr, p) in enumerate(jobs):
        threading.Thread(target=work, args=(i, pr, p), daemon=True).start()


def stream_response(state: ServerState, request, body: dict, jobs: list, params: dict, chat: bool, rid, created):
    """The StreamingResponse of a request's choices (jobs: (prompt, params) each), started now."""
    from fastapi.responses import StreamingResponse

    q: queue.Queue = queue.Queue()
    stop = threading.Event()
    start_workers(state, request, jobs, chat, q, stop)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    writer = ChunkWriter(chat, state.settings.model_name, rid, created, len(jobs))
    # a chat with tools: each choice's text is held back from <tool_call> on (runtime/chat.py)
    held = [ToolCallStream(params["tools"]) if chat and params.get("tools") else None for _ in jobs]
    events = _events(state, request, q, stop, writer, held, params["n"] if include_usage else None)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(state: ServerState, request, q: queue.Queue, stop, writer: ChunkWriter, held: list, usage_n):
    """The events of the workers' queue until every choice is done (usage_n: the request's n when
    the last chunk carries its usage, else None), an error, or the client leaves."""
    import anyio

    done: dict[int, dict] = {}
    try:
        if writer.chat:
            for i in range(len(held)):
                yield writer.event({"role": "assistant", "content": ""}, index=i)
        while True:
            if await request.is_disconnected():
                stop.set()
                return
            try:
                kind, i, payload = await anyio.to_thread.run_sync(lambda: q.get(timeout=0.2))
            except queue.Empty:
                continue
            if kind == "chunk":
                text = held[i].push(payload[0]) if held[i] is not None else payload[0]
                if text or payload[1] is not None:
                    yield writer.event({"content": text}, index=i, lps=payload[1])
            elif kind == "error":
                state.metrics.errors.labels("stream").inc()
                yield sse({"error": {"message": payload, "type": "invalid_request_error", "param": None, "code": None}})
                yield DONE
                return
            else:
                done[i] = payload
                for event in _choice_end(writer, held[i], i, payload):
                    yield event
                if len(done) < len(held):
                    continue
                if usage_n is not None:
                    yield writer.event(usage=usage([done[j] for j in range(len(held))], usage_n))
                yield DONE
                return
    finally:
        stop.set()  # client gone or server shutting down: the worker stops after its step


def _choice_end(writer: ChunkWriter, held: ToolCallStream | None, i: int, r: dict) -> list[str]:
    """The last events of choice i: its tool calls (each whole, in one delta: OpenAI's shape) or
    the text held back for a call that did not come, then its finish reason."""
    out = []
    if r["tool_calls"]:
        out.append(writer.event({"tool_calls": [{"index": k} | c for k, c in enumerate(r["tool_calls"])]}, index=i))
    elif held is not None and held.held:  # no call after all: it was text
        out.append(writer.event({"content": held.held}, index=i))
    out.append(writer.event(finish=r["finish_reason"], index=i))
    return out
