"""A completions or chat request's choices: admitted, decoded, answered whole or streamed.

Role in one decode step: none of its own; prompt k's choice i is one sequence (a job) decoded on
a pooled generator with seed + i (tools/serve/generation.py), the jobs of one request concurrently
(batched together when the generators batch). Sequences beyond the pool's slots + max_queue are
refused at once with a 503 and Retry-After.
"""

from __future__ import annotations

import time
import uuid

from arborspec.runtime.errors import ArborspecError, one_line
from arborspec.tools.serve.generation import run_choice
from arborspec.tools.serve.middleware import note_tokens
from arborspec.tools.serve.responses import whole_response
from arborspec.tools.serve.state import ApiError, ServerState, server_state
from arborspec.tools.serve.streaming import stream_response
from arborspec.tools.serve.validation import read_body, request_params


async def answer_request(request, route: str, prompts_of):
    """A completions or chat route's answer: the body read, its parameters validated, its
    prompts read by prompts_of(state, body, params) (the route's own fields), then answered."""
    state = server_state(request)
    state.metrics.requests.labels(route).inc()
    body = await read_body(request)
    params = request_params(state, body)
    prompts = prompts_of(state, body, params)
    return await answer(state, request, body, prompts, params, chat=route == "chat")


async def answer(state: ServerState, request, body: dict, prompts: list, params: dict, chat: bool):
    """The response to a request of these prompts and (validated) params."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    # prompt k's choice i (index k * n + i) draws with seed + i; each is a sequence of its own
    jobs = [(pr, {**params, "seed": params["seed"] + i}) for pr in prompts for i in range(params["n"])]
    _admit(state, len(jobs))
    if body.get("stream"):
        return stream_response(state, request, body, jobs, params, chat, rid, created)
    try:
        runs = await _run_all(state, jobs, chat)
    finally:
        state.finished(len(jobs))
    for r in runs:
        if isinstance(r, ArborspecError):
            raise ApiError(400, one_line(r))
        if isinstance(r, BaseException):
            raise r
    note_tokens(request, sum(r["completion_tokens"] for r in runs))
    return whole_response(chat, state.settings.model_name, rid, created, runs, params["n"])


def _admit(state: ServerState, n: int) -> None:
    """Admit n sequences, or the 400 (more than ever admitted) / 503 (busy now) that refuses them."""
    limit = state.settings.max_queue
    if limit is not None and n > state.slots + limit:
        raise ApiError(400, f"{n} sequences (prompts x n) are more than this server admits ({state.slots + limit})")
    if not state.admit(n):
        busy = f"the server is busy ({max(0, state.admitted - state.slots)} sequences wait for {state.slots} slots)"
        raise ApiError(503, busy + "; retry later", etype="server_error", code="overloaded", headers={"Retry-After": "1"})


async def _run_all(state: ServerState, jobs: list, chat: bool) -> list:
    """Every job's record (or the exception it raised), each run in a worker thread."""
    import asyncio

    import anyio

    return await asyncio.gather(
        *(anyio.to_thread.run_sync(lambda j=j: run_choice(state, *j, chat)) for j in jobs), return_exceptions=True
    )
