"""Request validation: an OpenAI/vLLM request body -> the runtime's parameters, or an ApiError.

Role in one decode step: none; what it returns is what each choice's generation is given
(`Generator.generate` / `stream` keywords, runtime/generator.py). Every check of every route is
here, in the order a body is read: the first wrong field is the one the 400 names (`param`).

`request_params(state, body)` -> a dict: max_new_tokens (None: to the end of the context), echo,
temperature, top_p, top_k, seed, n, stop, include_stop_str_in_output, truncate_prompt_tokens,
logprobs (None: off; else the alternatives per token), penalties (runtime/penalties.py's keywords,
min_p, logit_bias and a response_format); a chat adds tools (a ToolSpec or None).
"""

from __future__ import annotations

import json
import secrets

from arborspec.runtime.chat import chat_messages, render_chat, tool_spec
from arborspec.runtime.errors import ArborspecError, one_line
from arborspec.runtime.generator import PENALTIES, sampling_params
from arborspec.runtime.stop_strings import parse_stop
from arborspec.tools.serve.state import ApiError, ServerState

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
# vLLM's guided_* fields as the response_format each means
GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


async def read_body(request) -> dict:
    """The request's JSON object."""
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "malformed JSON body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_model(model, model_name: str) -> None:
    """A request's (or a path's) model id: absent or this server's (a 404 else, as OpenAI's)."""
    if model not in (None, model_name):
        raise ApiError(
            404,
            f"model {model!r} does not exist (this server serves {model_name!r})",
            param="model",
            code="model_not_found",
        )


def request_params(state: ServerState, body: dict) -> dict:
    """The parameters of a completions or chat request (the fields both take)."""
    check_model(body.get("model"), state.settings.model_name)
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in [1, {MAX_N}]", param="n")
    out = _length(body, state.settings.max_context)
    out |= _sampling(body)
    out["n"] = n
    out |= _stops(body)
    out["logprobs"] = _logprobs(body)
    pen = _penalties(body, out, state.vocab_size)
    rf = _guided_format(body, state.first.grammar)
    if rf is not None:
        pen["response_format"] = rf
    out["penalties"] = pen
    for key, default in UNSUPPORTED.items():  # never a silently different answer
        if key in body and body[key] not in default:
            raise ApiError(400, f"{key} is not supported by this server", param=key)
    return out


def _length(body: dict, max_context: int) -> dict:
    """max_new_tokens and echo."""
    mt = body.get("max_tokens")
    mt = body.get("max_completion_tokens") if mt is None else mt
    echo = body.get("echo", False)
    if not (echo is None or isinstance(echo, bool)):
        raise ApiError(400, "echo must be a boolean", param="echo")
    # absent or null: up to the end of the context (OpenAI's and vLLM's default), EOS or a stop string;
    # 0 with echo: the prompt alone (scored with logprobs: what lm-evaluation-harness asks)
    if mt is not None and (not _is_int(mt) or mt < (0 if echo else 1)):
        raise ApiError(400, "max_tokens must be an integer >= 1 (0 only with echo)", param="max_tokens")
    if mt is not None and mt > max_context:
        raise ApiError(400, f"max_tokens {mt} is beyond the model's context of {max_context}", param="max_tokens")
    return {"max_new_tokens": mt, "echo": bool(echo)}


def _sampling(body: dict) -> dict:
    """temperature, top_p, top_k and seed (OpenAI's defaults: 1.0, 1.0, off, another each time)."""
    out = {}
    for key, default in (("temperature", 1.0), ("top_p", 1.0)):
        v = body.get(key, default)
        if not _is_number(v):
            raise ApiError(400, f"{key} must be a number", param=key)
        out[key] = float(v)
    if not 0 <= out["temperature"] <= 2:
        raise ApiError(400, "temperature must be in [0, 2]", param="temperature")
    if not 0 < out["top_p"] <= 1:
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
    top_k = body.get("top_k", 0)  # an extension (vLLM, llama.cpp's server): 0 or -1 = off
    if not _is_int(top_k) or top_k < -1:
        raise ApiError(400, "top_k must be an integer >= -1 (0 or -1: off)", param="top_k")
    out["top_k"] = max(top_k, 0)
    seed = body.get("seed")
    if seed is None:  # as OpenAI's: another sample each time (a fixed default repeated one answer)
        seed = secrets.randbelow(2**63)
    if not _is_int(seed):
        raise ApiError(400, "seed must be an integer", param="seed")
    out["seed"] = seed
    return out


def _stops(body: dict) -> dict:
    """stop, include_stop_str_in_output and truncate_prompt_tokens."""
    try:
        stop = parse_stop(body.get("stop"))
    except ArborspecError as e:
        raise ApiError(400, one_line(e), param="stop") from None
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop strings, got {len(stop)}", param="stop")
    # vLLM's: the stop string kept at the end of the text; only the prompt's last k tokens read
    include = body.get("include_stop_str_in_output")
    if include is not None and not isinstance(include, bool):
        raise ApiError(400, "include_stop_str_in_output must be a boolean", param="include_stop_str_in_output")
    k = body.get("truncate_prompt_tokens")
    if k is not None and (not _is_int(k) or k < 1):
        raise ApiError(400, "truncate_prompt_tokens must be an integer >= 1", param="truncate_prompt_tokens")
    return {"stop": stop, "include_stop_str_in_output": bool(include), "truncate_prompt_tokens": k}


def _logprobs(body: dict) -> int | None:
    """Alternatives per token whose log-probs the answer carries (None: no log-probs).
    Completions: logprobs is that number; chat: a flag, with top_logprobs the number."""
    lp = body.get("logprobs")
    top = body.get("top_logprobs")
    if lp is not None and (not isinstance(lp, (bool, int)) or (not isinstance(lp, bool) and not 0 <= lp <= 5)):
        raise ApiError(400, "logprobs must be a boolean (chat) or an integer in [0, 5] (completions)", param="logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise ApiError(400, "top_logprobs must be an integer in [0, 20]", param="top_logprobs")
    # completions' 0: the chosen tokens' log-probs, no alternatives (not "off": 0 == False in Python)
    return None if lp is None or lp is False else (int(top or 0) if lp is True else int(lp))


def _penalties(body: dict, sampling: dict, vocab_size: int) -> dict:
    """The penalties, min_p, logit_bias ... (runtime/penalties.py) the body gives (null or absent:
    off), checked as the runtime checks them."""
    pen = {}
    for key in PENALTIES:
        v = body.get(key)
        if v is None:
            continue
        if key == "logit_bias" and not isinstance(v, dict):
            raise ApiError(
                400, 'logit_bias must be an object mapping token ids to biases, e.g. {"198": -100}', param=key
            )
        numeric = key not in ("logit_bias", "min_tokens", "stop_token_ids", "ignore_eos")  # (their own checks)
        if numeric and not _is_number(v):
            raise ApiError(400, f"{key} must be a number", param=key)
        pen[key] = v
    try:
        sampling_params(sampling["temperature"], sampling["top_k"], sampling["top_p"], pen, vocab_size)
    except ArborspecError as e:
        msg = one_line(e)
        bad = next((k for k in pen if k.replace("_", "-") in msg or k in msg), None)
        raise ApiError(400, msg, param=bad) from None
    return pen


def _guided_format(body: dict, compile_grammar) -> dict | None:
    """The response_format of response_format or one of vLLM's guided_* fields (None: plain
    text), compiled once here (runtime/structured.py) so that a bad one is this request's 400."""
    guided = [k for k in GUIDED if body.get(k) is not None]
    if len(guided) > 1:
        raise ApiError(400, f"give one of {', '.join(guided)}", param=guided[1])
    if not guided:
        return None
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
            raise ApiError(400, "guided_json must be a JSON schema (an object, or its JSON text)", param=key) from None
    try:
        compile_grammar(rf)
    except ArborspecError as e:
        raise ApiError(400, one_line(e), param=key) from None
    return rf


def completion_prompts(prompt) -> list | None:
    """A completions request's `prompt` as a list of prompts (each text or token ids): a string,
    a list of token ids, or a list of either (OpenAI's batch form); None for anything else."""

    def one(p) -> bool:
        text = isinstance(p, str) and p != ""
        ids = isinstance(p, list) and p != [] and all(_is_int(t) for t in p)
        return text or ids

    if one(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(one(p) and not isinstance(p, int) for p in prompt):
        return list(prompt)
    return None


def completions_prompts(state: ServerState, body: dict, params: dict) -> list:
    """A /v1/completions request's prompts (text or token ids each)."""
    for key in ("tools", "tool_choice"):
        if body.get(key) is not None:
            raise ApiError(400, f"{key} is for /v1/chat/completions", param=key)
    prompts = completion_prompts(body.get("prompt"))
    if prompts is None:
        raise ApiError(400, "prompt must be a non-empty string, a list of token ids, or a list of either", param="prompt")
    if len(prompts) * params["n"] > MAX_CHOICES:
        raise ApiError(400, f"prompts x n must be at most {MAX_CHOICES}", param="prompt")
    return prompts


def chat_prompts(state: ServerState, body: dict, params: dict) -> list:
    """A /v1/chat/completions request's one prompt (its messages); sets params' tools (runtime/
    chat.py: "required" or a named function constrain the answer with the tools' grammar)."""
    if params["echo"]:
        raise ApiError(400, "echo is for /v1/completions (a chat answer is the assistant's message)", param="echo")
    try:
        prompts = [chat_messages(body.get("messages"))]
    except ArborspecError as e:
        raise ApiError(400, one_line(e), param="messages") from None
    try:
        spec = params["tools"] = tool_spec(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), state.first.tokenizer
        )
        given = params["penalties"].get("response_format")
        rf = spec.answer_format(given) if spec is not None else given
        if rf is not given:  # the tools' grammar
            state.first.grammar(rf)
            params["penalties"] = {**params["penalties"], "response_format": rf}
    except ArborspecError as e:
        raise ApiError(400, one_line(e), param=getattr(e, "param", "tools")) from None
    return prompts


def tokenize_prompt(state: ServerState, body: dict) -> str:
    """The text a /tokenize request counts: its prompt, or its messages (and tools) as the chat
    template renders them for /v1/chat/completions."""
    tok = state.first.tokenizer
    if tok is None:
        raise ApiError(400, "this model has no tokenizer")
    try:
        if body.get("messages") is not None:
            spec = tool_spec(body.get("tools"), body.get("tool_choice"), tokenizer=tok)
            return render_chat(tok, chat_messages(body["messages"]), spec)
        if isinstance(body.get("prompt"), str):
            return body["prompt"]
    except ArborspecError as e:
        raise ApiError(400, one_line(e), param=getattr(e, "param", "messages")) from None
    raise ApiError(400, "give prompt (text) or messages", param="prompt")


def detokenize_ids(state: ServerState, body: dict) -> list[int]:
    """A /detokenize request's token ids (each in the vocabulary)."""
    ids = body.get("tokens")
    ok = isinstance(ids, list) and all(_is_int(t) for t in ids)
    if not ok or any(not 0 <= t < state.vocab_size for t in ids):
        raise ApiError(400, f"tokens must be a list of token ids in [0, {state.vocab_size})", param="tokens")
    if state.first.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    return ids
