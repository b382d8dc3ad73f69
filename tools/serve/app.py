"""The OpenAI-compatible HTTP app of `arborspec serve` (FastAPI, run by uvicorn): its factory.

Role in one decode step: none of its own; each request becomes one generation per choice on a
`Generator` (runtime/generator.py) taken from a pool (tools/serve/pool.py), run in a worker
thread, its steps streamed out as server-sent events when asked (tools/serve/streaming.py).
Routes, a module each: POST /v1/completions (completions.py), POST /v1/chat/completions with
tools (chat.py), GET /v1/models[/{id}] (models.py), POST /tokenize and /detokenize (tokens.py),
GET /health and /metrics (health.py, Prometheus text). A request body becomes the runtime's
parameters in validation.py; the pool, settings and metrics the routes share are state.py's.

Concurrency: `workers` generators, each decoding up to `max_batch` sequences together (one
verify call per step for all of them: continuous batching, runtime/batch_scheduler.py); requests
beyond workers x max_batch wait in a queue (`arborspec_queue_depth`).
Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}} with a 4xx status;
an API key, when set, is checked on every route but /health.
"""

from __future__ import annotations

from typing import Callable

from arborspec.tools.serve.pool import GeneratorPool
from arborspec.tools.serve.state import ServerSettings, ServerState, served_model_name

__all__ = ["GeneratorPool", "create_app", "served_model_name"]


def create_app(
    pool: GeneratorPool,
    model_name: str,
    *,
    api_key: str | None = None,
    max_context: int = 2048,
    access_log: Callable[[str], None] | None = None,
    max_queue: int | None = None,
):
    """The app. access_log: called with one line per request (method, path, status, generated
    tokens, ms) once its response (or stream) has ended; None: no access log. max_queue: how
    many sequences may wait beyond the pool's slots (workers x max_batch); a request that would
    pass it gets a 503 with Retry-After at once (None: no limit)."""
    from fastapi import FastAPI

    from arborspec.tools.serve import chat, completions, health, middleware, models, tokens

    state = ServerState(pool, ServerSettings(model_name, api_key, max_context, max_queue))
    app = FastAPI(title="arborspec", docs_url=None, redoc_url=None)
    app.state.arborspec = state
    middleware.install_error_handlers(app, state)
    middleware.install_auth(app, state)
    if access_log is not None:
        middleware.install_access_log(app, access_log)
    for routes in (health, models, completions, chat, tokens):
        app.include_router(routes.router)
    return app
