"""The OpenAI-compatible HTTP app of `arborspec serve` (FastAPI, run by uvicorn).

Role in one decode step: none of its own; each request becomes one generation on a
`Generator` (runtime/generator.py) taken from a pool, run in a worker thread, its steps streamed
out as server-sent events when asked. Routes: POST /v1/completions, POST /v1/chat/completions
(streaming and not), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text).

Concurrency: `workers` generators, each decoding up to `max_batch` sequences together (one
verify call per step for all of them: continuous batching, runtime/batch_scheduler.py); requests
beyond workers x max_batch wait in a queue (`arborspec_queue_depth`).
Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}} with a 4xx status;
an API key, when set, is checked on every route but /health.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
import uuid
from itertools import accumulate
from typing import Any, Callable

from fastapi import Request  # module level: FastAPI resolves the (string) annotations here

from arborspec.runtime.chat import ToolCallStream, chat_messages, render_chat, tool_spec
from arborspec.runtime.errors import ArborspecError, one_line
from arborspec.runtime.generator import PENALTIES, sampling_params
from arborspec.runtime.stop_strings import parse_stop

MAX_STOP = 4  # stop strings a request may give (OpenAI's limit)
MAX_N = 16  # choices a request may ask for (`n`): each is a sequence of its own, decoded concurrently
MAX_CHOICES = 64  # prompts x n of one completions request
# request fields that would change the answer and that this server does not implement, with the
# values that mean "off": any other value is a 400 naming the field, never a silently other answer
UNSUPPORTED = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # the legacy form of tools
    "function_call": (None,),
}


def completion_prompts(prompt) -> list | None:
    """A completions request's `prompt` as a list of prompts (each text or token ids): a string,
    a list of token ids, or a list of either (OpenAI's batch form); None for anything else."""

    def one(p) -> bool:
        text = isinstance(p, str) and p != ""
        ids = isinstance(p, list) and p != [] and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        return text or ids

    if one(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(one(p) and not isinstance(p, int) for p in prompt):
        return list(prompt)
    return None


def chat_logprob(word: str, lp: float, top: list) -> dict:
    """One token of a chat choice's `logprobs.content` (OpenAI's shape)."""
    entry = {"token": word, "logprob": lp, "bytes": list(word.encode())}
    return entry | {"top_logprobs": [{"token": w, "logprob": v, "bytes": list(w.encode())} for w, v in top]}


def text_logprobs(run: dict, start: int = 0) -> dict | None:
    """A completions choice's `logprobs` (OpenAI's legacy shape), or None when not asked for; with
    echo the prompt's tokens come first, the first of them with null log-probs (it has no row).
    start: where the first token's text begins (a streamed chunk's: the text sent before it)."""
    if run["logprobs"] is None:
        return None
    words = [w for w, _, _ in run["logprobs"]]
    offsets = list(accumulate(map(len, words), initial=start))[: len(words)]  # where each token's text begins
    return {
        "tokens": words,
        "token_logprobs": [lp for _, lp, _ in run["logprobs"]],
        "top_logprobs": [None if lp is None else dict(top) for _, lp, top in run["logprobs"]],
        "text_offset": offsets,
    }


def served_model_name(manifest_data: dict, export_dir) -> str:
    """The model id clients send: the export's source model as a clean name (a registry name as
    is; a path's last part without .gguf/.pt: `./tiny-llama` -> `tiny-llama`), else the
    export folder's name."""
    from pathlib import Path

    src = str((manifest_data.get("source") or {}).get("model") or "").rstrip("/\\")
    name = Path(src).name if src else ""
    for ext in (".gguf", ".pt", ".safetensors"):
        name = name.removesuffix(ext)
    return name or Path(export_dir).resolve().name


def _ort_shared_pool() -> bool:
    """Whether ONNX Runtime sessions of this process run on the shared pool (False without ORT)."""
    try:
        from arborspec.runtime.backends.onnxruntime import shared_pool

        return shared_pool()
    except ArborspecError:
        return False


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
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    reg = CollectorRegistry()
    m_requests = Counter("arborspec_requests", "requests served", ["route"], registry=reg)
    m_errors = Counter("arborspec_request_errors", "requests that failed", ["status"], registry=reg)
    m_tokens = Counter("arborspec_generated_tokens", "tokens generated", registry=reg)
    m_steps = Counter("arborspec_verify_steps", "target verify calls", registry=reg)
    m_decode_s = Counter("arborspec_decode_seconds", "time spent decoding", registry=reg)
    g_queue = Gauge("arborspec_queue_depth", "requests waiting for a generator", registry=reg)
    g_active = Gauge("arborspec_active_sequences", "sequences being decoded", registry=reg)
    g_tps = Gauge("arborspec_tokens_per_second", "decode tokens/s of the last request", registry=reg)
    g_acc = Gauge("arborspec_mean_accepted", "tokens per verify call over all requests", registry=reg)
    g_pool = Gauge(
        "arborspec_ort_shared_pool",
        "1: this process's ONNX Runtime sessions share one intra-op thread pool (arborspec.enable_shared_pool)",
        registry=reg,
    )
    g_batch = Gauge("arborspec_mean_batch_size", "sequences per verify call (batched decoding)", registry=reg)
    g_batch.set_function(lambda: getattr(pool, "mean_batch", 0.0))
    g_queue.set_function(lambda: pool.waiting)
    g_active.set_function(lambda: pool.busy)
    totals = {"tokens": 0, "steps": 0}

    app = FastAPI(title="arborspec", docs_url=None, redoc_url=None)

    def error(
        status: int,
        message: str,
        etype: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        m_errors.labels(str(status)).inc()
        return JSONResponse(
            {"error": {"message": message, "type": etype, "param": param, "code": code}},
            status_code=status,
            headers=headers,
        )

    # admission: sequences admitted and not finished; beyond the slots + max_queue a request is
    # refused at once (a 503 a client retries) instead of waiting without bound
    slots = len(pool.all) * pool.slots
    vocab_size = pool.all[0].target.info.vocab_size  # where a logit_bias's token ids must lie
    admitted = {"n": 0}
    admit_lock = threading.Lock()

    def admit(n: int) -> bool:
        with admit_lock:
            if max_queue is not None and admitted["n"] + n > slots + max_queue:
                return False
            admitted["n"] += n
            return True

    def finished(n: int = 1) -> None:
        with admit_lock:
            admitted["n"] -= n

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "malformed JSON body"
        return error(400, f"{msg}" + (f" ({loc})" if loc else ""), param=loc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return error(
            exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error"
        )

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path != "/health":
            got = request.headers.get("authorization", "")
            if got != f"Bearer {api_key}":
                return error(
                    401,
                    "invalid or missing API key (Authorization: Bearer KEY)",
                    "authentication_error",
                    code="invalid_api_key",
                )
        return await call_next(request)

    if access_log is not None:

        @app.middleware("http")
        async def _log(request: Request, call_next):
            t0 = time.perf_counter()
            request.state.tokens = {"n": None}  # _run fills it in
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

    def _count(request: Request, n: int) -> None:
        tokens = getattr(request.state, "tokens", None)
        if tokens is not None:
            tokens["n"] = n

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name}

    model_card = {"id": model_name, "object": "model", "owned_by": "arborspec", "created": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):  # OpenAI's retrieve (openai-python's `client.models.retrieve`)
        if model != model_name:
            msg = f"model {model!r} does not exist (this server serves {model_name!r})"
            return error(404, msg, param="model", code="model_not_found")
        return model_card

    @app.get("/metrics")
    async def metrics():
        g_acc.set(totals["tokens"] / totals["steps"] if totals["steps"] else 0.0)
        g_pool.set(1.0 if _ort_shared_pool() else 0.0)
        return PlainTextResponse(generate_latest(reg).decode(), media_type="text/plain; version=0.0.4")

    async def _body(request: Request) -> dict | JSONResponse:
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "malformed JSON body")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        return body

    def _params(body: dict) -> dict | JSONResponse:
        model = body.get("model")
        if model not in (None, model_name):
            return error(
                404,
                f"model {model!r} does not exist (this server serves {model_name!r})",
                param="model",
                code="model_not_found",
            )
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            return error(400, f"n must be an integer in [1, {MAX_N}]", param="n")
        mt = body.get("max_tokens")
        mt = body.get("max_completion_tokens") if mt is None else mt
        echo = body.get("echo", False)
        if not (echo is None or isinstance(echo, bool)):
            return error(400, "echo must be a boolean", param="echo")
        # absent or null: up to the end of the context (OpenAI's and vLLM's default), EOS or a stop string;
        # 0 with echo: the prompt alone (scored with logprobs: what lm-evaluation-harness asks)
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < (0 if echo else 1)):
            return error(400, "max_tokens must be an integer >= 1 (0 only with echo)", param="max_tokens")
        if mt is not None and mt > max_context:
            return error(400, f"max_tokens {mt} is beyond the model's context of {max_context}", param="max_tokens")
        out = {"max_new_tokens": mt, "echo": bool(echo)}
        for key, default in (("temperature", 1.0), ("top_p", 1.0)):
            v = body.get(key, default)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return error(400, f"{key} must be a number", param=key)
            out[key] = float(v)
        if not 0 <= out["temperature"] <= 2:
            return error(400, "temperature must be in [0, 2]", param="temperature")
        if not 0 < out["top_p"] <= 1:
            return error(400, "top_p must be in (0, 1]", param="top_p")
        top_k = body.get("top_k", 0)  # an extension (vLLM, llama.cpp's server): 0 or -1 = off
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
            return error(400, "top_k must be an integer >= -1 (0 or -1: off)", param="top_k")
        out["top_k"] = max(top_k, 0)
        seed = body.get("seed")
        if seed is None:  # as OpenAI's: another sample each time (a fixed default repeated one answer)
            seed = secrets.randbelow(2**63)
        if not isinstance(seed, int) or isinstance(seed, bool):
            return error(400, "seed must be an integer", param="seed")
        out["seed"], out["n"] = seed, n
        stop = body.get("stop")
        try:
            out["stop"] = parse_stop(stop)
        except ArborspecError as e:
            return error(400, one_line(e), param="stop")
        if len(out["stop"]) > MAX_STOP:
            return error(400, f"at most {MAX_STOP} stop strings, got {len(out['stop'])}", param="stop")
        # vLLM's: the stop string kept at the end of the text; only the prompt's last k tokens read
        include = body.get("include_stop_str_in_output")
        if include is not None and not isinstance(include, bool):
            return error(400, "include_stop_str_in_output must be a boolean", param="include_stop_str_in_output")
        out["include_stop_str_in_output"] = bool(include)
        k = body.get("truncate_prompt_tokens")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            return error(400, "truncate_prompt_tokens must be an integer >= 1", param="truncate_prompt_tokens")
        out["truncate_prompt_tokens"] = k
        lp = body.get("logprobs")  # completions: the number of alternatives; chat: a flag + top_logprobs
        top = body.get("top_logprobs")
        if lp is not None and (not isinstance(lp, (bool, int)) or (not isinstance(lp, bool) and not 0 <= lp <= 5)):
            return error(
                400, "logprobs must be a boolean (chat) or an integer in [0, 5] (completions)", param="logprobs"
            )
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
            return error(400, "top_logprobs must be an integer in [0, 20]", param="top_logprobs")
        # completions' 0: the chosen tokens' log-probs, no alternatives (not "off": 0 == False in Python)
        out["logprobs"] = None if lp is None or lp is False else (int(top or 0) if lp is True else int(lp))
        pen = {}  # penalties, min_p, logit_bias (runtime/penalties.py): null or absent is off
        for key in PENALTIES:
            v = body.get(key)
            if v is None:
                continue
            if key == "logit_bias" and not isinstance(v, dict):
                return error(
                    400, 'logit_bias must be an object mapping token ids to biases, e.g. {"198": -100}', param=key
                )
            numeric = key not in ("logit_bias", "min_tokens", "stop_token_ids", "ignore_eos")  # (their own checks)
            if numeric and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                return error(400, f"{key} must be a number", param=key)
            pen[key] = v
        try:
            sampling_params(out["temperature"], out["top_k"], out["top_p"], pen, vocab_size)
        except ArborspecError as e:
            msg = one_line(e)
            bad = next((k for k in pen if k.replace("_", "-") in msg or k in msg), None)
            return error(400, msg, param=bad)
        # structured output (runtime/structured.py): compiled once per schema; vLLM's guided_* fields too
        guided = [
            k
            for k in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if body.get(k) is not None
        ]
        if len(guided) > 1:
            return error(400, f"give one of {', '.join(guided)}", param=guided[1])
        if guided:
            key, v = guided[0], body[guided[0]]
            rf = {
                "response_format": v,
                "guided_json": {"type": "json_schema", "json_schema": {"name": "guided", "schema": v}},
                "guided_regex": {"type": "regex", "regex": v},
                "guided_choice": {"type": "choice", "choices": v},
                "guided_grammar": {"type": "grammar", "grammar": v},
            }[key]
            if key == "guided_json" and isinstance(v, str):  # vLLM takes the schema as JSON text too
                try:
                    rf["json_schema"]["schema"] = json.loads(v)
                except json.JSONDecodeError:
                    return error(400, "guided_json must be a JSON schema (an object, or its JSON text)", param=key)
            try:
                pool.all[0].grammar(rf)
            except ArborspecError as e:
                return error(400, one_line(e), param=key)
            pen["response_format"] = rf
        out["penalties"] = pen
        for key, default in UNSUPPORTED.items():  # never a silently different answer
            if key in body and body[key] not in default:
                return error(400, f"{key} is not supported by this server", param=key)
        return out

    def _run(prompt, params: dict, chat: bool, on_chunk=None, cancelled=lambda: False) -> dict:
        """One generation on a pooled generator (a worker thread): text, tokens, stats.
        on_chunk(text, logprobs): each streamed piece, with its tokens' log-probs (as _result's
        `logprobs`) when the request asked for them, else None."""
        first = pool.all[0]  # the generators share one tokenizer: the prompt's ids before choosing one
        if chat:
            if first.tokenizer is None:
                raise ArborspecError("this model has no tokenizer: chat needs one")
            prompt = render_chat(first.tokenizer, prompt, params.get("tools"))
        ids = first.encode_prompt(prompt)
        k = params.get("truncate_prompt_tokens")
        cut = k is not None and len(ids) > k
        if cut:  # vLLM's truncate_prompt_tokens: the prompt's last k tokens
            ids = ids[-k:]
        g = pool.acquire(ids=ids)
        try:
            if params["max_new_tokens"] is None:  # the rest of the context
                if len(ids) >= max_context:
                    raise ArborspecError(f"the prompt ({len(ids)} tokens) fills the model's context of {max_context}")
                params = {**params, "max_new_tokens": max_context - len(ids)}
            if len(ids) + params["max_new_tokens"] > max_context:
                raise ArborspecError(
                    f"the prompt ({len(ids)} tokens) plus max_tokens ({params['max_new_tokens']}) "
                    f"is beyond the model's context of {max_context}"
                )
            keys = ("temperature", "top_k", "top_p", "seed", "stop", "include_stop_str_in_output")
            kw = {k: params[k] for k in keys if k in params} | params["penalties"]
            lp, echo = params.get("logprobs"), params.get("echo")
            head = (
                (prompt if isinstance(prompt, str) and not cut else g.tokenizer.decode(ids))
                if echo and g.tokenizer
                else ""
            )
            # one call: the prompt alone, or log-probs not streamed or with the prompt's (echo) first
            if params["max_new_tokens"] == 0 or (lp is not None and (on_chunk is None or echo)):
                only_prompt = params["max_new_tokens"] == 0  # echo of the prompt alone: its one token dropped
                plp = lp if echo else None  # echo: the prompt's log-probs first
                c = g.generate(ids, max(params["max_new_tokens"], 1), logprobs=lp, prompt_logprobs=plp, **kw)
                text, lps, reason = ("", [], "length") if only_prompt else (c.text, c.logprobs, c.stop_reason)
                lps = None if lp is None else named(g, (c.prompt_logprobs or []) + lps)
                if on_chunk and head + text:
                    on_chunk(head + text, lps)
                return _result(g, head + text, len(ids), reason, params, lps, 0 if only_prompt else None)
            if on_chunk and head:
                on_chunk(head, None)
            text = [head]
            it = g.stream(ids, params["max_new_tokens"], logprobs=lp, **kw)
            try:
                for piece in it:
                    chunk, entries = piece if lp is not None else (piece, None)
                    text.append(chunk)
                    if on_chunk:
                        on_chunk(chunk, None if entries is None else named(g, entries))
                    if cancelled():
                        break
            finally:
                it.close()  # a disconnect frees the generator here
            return _result(g, "".join(text), len(ids), getattr(g, "last_stop_reason", ""), params)
        finally:
            pool.release(g)

    def named(g, entries: list) -> list:
        """Log-prob entries (token id, log-prob, [(id, log-prob)]) with each token as its text."""

        def word(t: int) -> str:
            return g.tokenizer.decode([t]) if g.tokenizer is not None else str(t)

        return [(word(t), lp, [(word(a), alp) for a, alp in top]) for t, lp, top in entries]

    def _result(g, text: str, n_prompt: int, stop_reason, params: dict, logprobs=None, completion_tokens=None) -> dict:
        """One generation's record (its stats counted in the metrics); logprobs: `named` entries;
        completion_tokens: what the client is told, when not the tokens decoded (an echo of the
        prompt alone decodes one and returns none)."""
        st = g.last_stats
        totals["tokens"] += st.new_tokens
        totals["steps"] += st.steps
        m_tokens.inc(st.new_tokens)
        m_steps.inc(st.steps)
        m_decode_s.inc(st.decode_s)
        g_tps.set(st.tokens_per_s)
        spec, calls = params.get("tools"), []
        if spec is not None:  # a chat with tools: the answer's <tool_call> blocks are its calls
            content, calls = spec.parse(text)
            text = content if calls else text
        return {
            "text": text,
            "tool_calls": calls,
            "prompt_tokens": n_prompt,
            "cached_tokens": st.cached_tokens,
            "completion_tokens": st.new_tokens if completion_tokens is None else completion_tokens,
            # calls: "tool_calls", unless max_tokens cut the answer (a last call cut off is dropped)
            "finish_reason": "length" if stop_reason not in ("eos", "stop") else "tool_calls" if calls else "stop",
            "mean_accepted": st.mean_accepted,
            "seed": params["seed"],
            "logprobs": logprobs,
        }

    def _usage(runs: list[dict], n: int) -> dict:
        """One request's usage: each prompt once (runs k*n .. k*n+n-1 share prompt k), the tokens of
        all its choices."""
        prompt = sum(r["prompt_tokens"] for r in runs[::n])
        completion = sum(r["completion_tokens"] for r in runs)
        cached = sum(r["cached_tokens"] for r in runs[::n])  # the prompt's tokens a previous request's prefill left
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return usage | {"prompt_tokens_details": {"cached_tokens": cached}}

    def _response(kind: str, rid: str, created: int, runs: list[dict], n: int) -> dict:
        if kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r["text"]}
                    | ({"tool_calls": r["tool_calls"]} if r["tool_calls"] else {}),
                    "finish_reason": r["finish_reason"],
                }
                for i, r in enumerate(runs)
            ]
            for c, r in zip(choices, runs):
                if r["logprobs"] is not None:
                    c["logprobs"] = {"content": [chat_logprob(w, lp, top) for w, lp, top in r["logprobs"]]}
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": r["text"], "finish_reason": r["finish_reason"], "logprobs": text_logprobs(r)}
                for i, r in enumerate(runs)
            ]
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": _usage(runs, n),
            # an extension: the seed that drew choice 0 (choice i: seed + i; send it back to repeat)
            "seed": runs[0]["seed"],
        }

    async def _handle(request: Request, chat: bool):
        import anyio

        route = "chat" if chat else "completions"
        m_requests.labels(route).inc()
        body = await _body(request)
        if not isinstance(body, dict):
            return body
        params = _params(body)
        if not isinstance(params, dict):
            return params
        if chat and params["echo"]:
            return error(400, "echo is for /v1/completions (a chat answer is the assistant's message)", param="echo")
        if chat:
            try:
                prompts = [chat_messages(body.get("messages"))]
            except ArborspecError as e:
                return error(400, one_line(e), param="messages")
            try:  # tools (runtime/chat.py): "required" / a named function constrain the answer
                spec = params["tools"] = tool_spec(
                    body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), pool.all[0].tokenizer
                )
                given = params["penalties"].get("response_format")
                rf = spec.answer_format(given) if spec is not None else given
                if rf is not given:  # the tools' grammar
                    pool.all[0].grammar(rf)
                    params["penalties"] = {**params["penalties"], "response_format": rf}
            except ArborspecError as e:
                return error(400, one_line(e), param=getattr(e, "param", "tools"))
        else:
            for key in ("tools", "tool_choice"):
                if body.get(key) is not None:
                    return error(400, f"{key} is for /v1/chat/completions", param=key)
            prompts = completion_prompts(body.get("prompt"))
            if prompts is None:
                return error(
                    400,
                    "prompt must be a non-empty string, a list of token ids, or a list of either",
                    param="prompt",
                )
            if len(prompts) * params["n"] > MAX_CHOICES:
                return error(400, f"prompts x n must be at most {MAX_CHOICES}", param="prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        # prompt k's choice i (index k * n + i) draws with seed + i; each is a sequence of its own
        # (batched together when the generators batch)
        jobs = [(pr, {**params, "seed": params["seed"] + i}) for pr in prompts for i in range(params["n"])]
        if max_queue is not None and len(jobs) > slots + max_queue:
            return error(
                400, f"{len(jobs)} sequences (prompts x n) are more than this server admits ({slots + max_queue})"
            )
        if not admit(len(jobs)):
            busy = f"the server is busy ({max(0, admitted['n'] - slots)} sequences wait for {slots} slots); retry later"
            return error(503, busy, etype="server_error", code="overloaded", headers={"Retry-After": "1"})
        if not body.get("stream"):
            import asyncio

            try:
                runs = await asyncio.gather(
                    *(anyio.to_thread.run_sync(lambda j=j: _run(*j, chat)) for j in jobs), return_exceptions=True
                )
            finally:
                finished(len(jobs))
            for r in runs:
                if isinstance(r, ArborspecError):
                    return error(400, one_line(r))
                if isinstance(r, BaseException):
                    raise r
            _count(request, sum(r["completion_tokens"] for r in runs))
            return _response("chat" if chat else "text", rid, created, runs, params["n"])

        # streaming: each choice runs in a worker thread and hands its chunks over one queue
        q: queue.Queue = queue.Queue()
        stop = threading.Event()

        def work(i: int, prompt, p: dict):
            try:
                r = _run(prompt, p, chat, on_chunk=lambda c, lps: q.put(("chunk", i, (c, lps))), cancelled=stop.is_set)
                _count(request, r["completion_tokens"])
                q.put(("done", i, r))
            except ArborspecError as e:
                q.put(("error", i, one_line(e)))
            except Exception as e:  # noqa: BLE001 - a bug: reported to the client, logged by uvicorn
                q.put(("error", i, f"internal error: {type(e).__name__}"))
                raise
            finally:
                finished()

        for i, (pr, p) in enumerate(jobs):
            threading.Thread(target=work, args=(i, pr, p), daemon=True).start()
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        offset = [0] * len(jobs)  # completions: the text each choice has sent (its tokens' text_offset)
        # a chat with tools: each choice's text is held back from <tool_call> on (runtime/chat.py)
        held = [ToolCallStream(params["tools"]) if chat and params.get("tools") else None for _ in jobs]

        def event(delta: dict | None = None, finish=None, usage=None, index: int = 0, lps=None) -> str:
            if chat:
                choice = {"index": index, "delta": delta or {}, "finish_reason": finish}
                if lps is not None:
                    choice["logprobs"] = {"content": [chat_logprob(w, lp, top) for w, lp, top in lps]}
                obj = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }
            else:
                choice = {
                    "index": index,
                    "text": (delta or {}).get("content", ""),
                    "finish_reason": finish,
                    "logprobs": text_logprobs({"logprobs": lps}, offset[index]),
                }
                offset[index] += len(choice["text"])
                obj = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }
            if usage is not None:
                obj["choices"], obj["usage"] = [], usage
            return f"data: {json.dumps(obj)}\n\n"

        async def sse():
            done: dict[int, dict] = {}
            try:
                if chat:
                    for i in range(len(jobs)):
                        yield event({"role": "assistant", "content": ""}, index=i)
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
                            yield event({"content": text}, index=i, lps=payload[1])
                    elif kind == "error":
                        m_errors.labels("stream").inc()
                        yield f"data: {json.dumps({'error': {'message': payload, 'type': 'invalid_request_error', 'param': None, 'code': None}})}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        done[i] = payload
                        if payload["tool_calls"]:  # each call whole, in one delta (OpenAI's shape)
                            calls = [{"index": k} | c for k, c in enumerate(payload["tool_calls"])]
                            yield event({"tool_calls": calls}, index=i)
                        elif held[i] is not None and held[i].held:  # no call after all: it was text
                            yield event({"content": held[i].held}, index=i)
                        yield event(finish=payload["finish_reason"], index=i)
                        if len(done) < len(jobs):
                            continue
                        if include_usage:
                            yield event(usage=_usage([done[j] for j in range(len(jobs))], params["n"]))
                        yield "data: [DONE]\n\n"
                        return
            finally:
                stop.set()  # client gone or server shutting down: the worker stops after its step

        return StreamingResponse(sse(), media_type="text/event-stream")

    # vLLM's /tokenize and /detokenize: what a client counts a prompt with (the chat template and
    # the tools applied as /v1/chat/completions applies them)
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _body(request)
        if not isinstance(body, dict):
            return body
        tok = pool.all[0].tokenizer
        if tok is None:
            return error(400, "this model has no tokenizer")
        try:
            if body.get("messages") is not None:
                spec = tool_spec(body.get("tools"), body.get("tool_choice"), tokenizer=tok)
                prompt = render_chat(tok, chat_messages(body["messages"]), spec)
            elif isinstance(body.get("prompt"), str):
                prompt = body["prompt"]
            else:
                return error(400, "give prompt (text) or messages", param="prompt")
        except ArborspecError as e:
            return error(400, one_line(e), param=getattr(e, "param", "messages"))
        ids = pool.all[0].encode_prompt(prompt) if prompt else []
        return {"count": len(ids), "max_model_len": max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _body(request)
        if not isinstance(body, dict):
            return body
        ids = body.get("tokens")
        ok = isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        if not ok or any(not 0 <= t < vocab_size for t in ids):
            return error(400, f"tokens must be a list of token ids in [0, {vocab_size})", param="tokens")
        tok = pool.all[0].tokenizer
        if tok is None:
            return error(400, "this model has no tokenizer")
        return {"prompt": tok.decode(ids)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    return app
