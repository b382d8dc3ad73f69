"""What wraps every route: the API key check, the access log, errors in OpenAI's shape.

Role in one decode step: none. A request without the key (when one is set) gets a 401 before any
route runs (/health excepted); an `ApiError` a route raises, a body FastAPI cannot read, a
route that does not exist all answer {"error": {...}}; the access log writes one line per request
when its response, or its stream, has ended.
"""

from __future__ import annotations

import time
from typing import Callable

from fastapi import Request  # module level: FastAPI resolves the (string) annotations here

from arborspec.tools.serve.state import ApiError, ServerState


def install_error_handlers(app, state: ServerState) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return state.error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "malformed JSON body"
        return state.error(ApiError(400, f"{msg}" + (f" ({loc})" if loc else ""), param=loc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        etype = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return state.error(ApiError(exc.status_code, str(exc.detail), etype))


def install_auth(app, state: ServerState) -> None:
    """Every route but /health needs 'Authorization: Bearer KEY' when the settings have a key."""
    api_key = state.settings.api_key

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path != "/health":
            got = request.headers.get("authorization", "")
            if got != f"Bearer {api_key}":
                msg = "invalid or missing API key (Authorization: Bearer KEY)"
                return state.error(ApiError(401, msg, "authentication_error", code="invalid_api_key"))
        return await call_next(request)


def install_access_log(app, access_log: Callable[[str], None]) -> None:
    """access_log(line) once per request: method, path, status, generated tokens, ms."""

    @app.middleware("http")
    async def _log(request: Request, call_next):
        t0 = time.perf_counter()
        request.state.tokens = {"n": None}  # note_tokens fills it in
        resp = await call_next(request)

        def line():
            n = request.state.tokens["n"]
            ms = 1e3 * (time.perf_counter() - t0)
            toks = f"{n} tokens" if n is not None else "- tokens"
            access_log(f"{request.method} {request.url.path} {resp.status_code} {toks} {ms:.0f} ms")

        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            body = resp.body_iterator

            async def logged():  # a stream is logged when it ends (its tokens known)
                try:
                    async for chunk in body:
                        yield chunk
                finally:
                    line()

            resp.body_iterator = logged()
        else:
            line()
        return resp


def note_tokens(request: Request, n: int) -> None:
    """The tokens a request generated, for its access log line."""
    tokens = getattr(request.state, "tokens", None)
    if tokens is not None:
        tokens["n"] = n
