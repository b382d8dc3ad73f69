"""What every route of the server shares: the pool, the settings, the metrics, the admission count.

Role in one decode step: none; a route takes a generator from `ServerState.pool` for each choice it
decodes. `ApiError` is a request's failure in OpenAI's shape ({"error": {"message", "type",
"param", "code"}}, a 4xx or 503 status), raised anywhere in a route and answered by the app.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerSettings:
    """model_name: the id clients send; api_key: checked on every route but /health (None: none);
    max_context: the model's context (prompt + answer tokens); max_queue: sequences that may wait
    beyond the pool's slots before a request gets 503 (None: no limit)."""

    model_name: str
    api_key: str | None = None
    max_context: int = 2048
    max_queue: int | None = None


class ApiError(Exception):
    """A request's failure as OpenAI answers it: status, message, type, param, code (+ headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        etype: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.etype = status, message, etype
        self.param, self.code, self.headers = param, code, headers

    def response(self):
        from fastapi.responses import JSONResponse

        body = {"error": {"message": self.message, "type": self.etype, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ServerState:
    """The pool, the settings and the metrics of one app, and the sequences it has admitted: those
    not finished; beyond the slots + max_queue a request is refused at once (a 503 a client retries)
    instead of waiting without bound."""

    def __init__(self, pool, settings: ServerSettings):
        from arborspec.tools.serve.metrics import ServerMetrics

        self.pool = pool
        self.settings = settings
        self.metrics = ServerMetrics(pool)
        self.slots = len(pool.all) * pool.slots
        self.vocab_size = pool.all[0].target.info.vocab_size  # where a logit_bias's token ids must lie
        self.admitted = 0
        self._lock = threading.Lock()

    @property
    def first(self):
        """The pool's first generator: its tokenizer and grammar compiler are every generator's."""
        return self.pool.all[0]

    def admit(self, n: int) -> bool:
        """Admit n sequences, unless that would pass slots + max_queue."""
        with self._lock:
            limit = self.settings.max_queue
            if limit is not None and self.admitted + n > self.slots + limit:
                return False
            self.admitted += n
            return True

    def finished(self, n: int = 1) -> None:
        with self._lock:
            self.admitted -= n

    def error(self, e: ApiError):
        """The JSON response of `e`, counted in the metrics."""
        self.metrics.errors.labels(str(e.status)).inc()
        return e.response()


def server_state(request) -> ServerState:
    """The ServerState of the app serving `request`."""
    return request.app.state.arborspec


def served_model_name(manifest_data: dict, export_dir) -> str:
    """The model id clients send: the export's source model as a clean name (a registry name as
    is; a path's last part without .gguf/.pt: `./tiny-llama` -> `tiny-llama`), else the
    export folder's name."""
    src = str((manifest_data.get("source") or {}).get("model") or "").rstrip("/\\")
    name = Path(src).name if src else ""
    for ext in (".gguf", ".pt", ".safetensors"):
        name = name.removesuffix(ext)
    return name or Path(export_dir).resolve().name
