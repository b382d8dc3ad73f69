"""The shapes of the server's answers: a whole completions or chat response, usage, log-probs.

Role in one decode step: none; a generation's record (tools/serve/generation.py) becomes OpenAI's
JSON here. The streamed chunks (tools/serve/streaming.py) take their log-probs from here too.
"""

from __future__ import annotations

from itertools import accumulate


def chat_logprob(word: str, lp: float, top: list) -> dict:
    """One token of a chat choice's `logprobs.content` (OpenAI's shape)."""
    entry = {"token": word, "logprob": lp, "bytes": list(word.encode())}
    return entry | {"top_logprobs": [{"token": w, "logprob": v, "bytes": list(w.encode())} for w, v in top]}


def chat_logprobs(entries: list) -> dict:
    """A chat choice's `logprobs` of named entries (word, log-prob, [(word, log-prob)])."""
    return {"content": [chat_logprob(w, lp, top) for w, lp, top in entries]}


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


def usage(runs: list[dict], n: int) -> dict:
    """One request's usage: each prompt once (runs k*n .. k*n+n-1 share prompt k), the tokens of
    all its choices."""
    prompt = sum(r["prompt_tokens"] for r in runs[::n])
    completion = sum(r["completion_tokens"] for r in runs)
    cached = sum(r["cached_tokens"] for r in runs[::n])  # the prompt's tokens a previous request's prefill left
    total = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}


def _chat_choice(i: int, r: dict) -> dict:
    message = {"role": "assistant", "content": r["text"]} | ({"tool_calls": r["tool_calls"]} if r["tool_calls"] else {})
    choice = {"index": i, "message": message, "finish_reason": r["finish_reason"]}
    if r["logprobs"] is not None:
        choice["logprobs"] = chat_logprobs(r["logprobs"])
    return choice


def _text_choice(i: int, r: dict) -> dict:
    return {"index": i, "text": r["text"], "finish_reason": r["finish_reason"], "logprobs": text_logprobs(r)}


def whole_response(chat: bool, model_name: str, rid: str, created: int, runs: list[dict], n: int) -> dict:
    """The response of a request not streamed: its choices (prompt k's choice i at k * n + i)."""
    choice = _chat_choice if chat else _text_choice
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model_name,
        "choices": [choice(i, r) for i, r in enumerate(runs)],
        "usage": usage(runs, n),
        # an extension: the seed that drew choice 0 (choice i: seed + i; send it back to repeat)
        "seed": runs[0]["seed"],
    }
