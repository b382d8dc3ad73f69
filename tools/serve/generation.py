"""One choice of a request: its prompt's tokens, a pooled generator, the generation, its record.

Role in one decode step: none of its own; `run_choice` calls `Generator.generate` (one call) or
`Generator.stream` (a piece per decode step) on the generator the pool gives it, in a worker
thread, and returns the record the responses are made of (text, tool calls, token counts,
finish reason, seed, log-probs).
"""

from __future__ import annotations

from arborspec.runtime.chat import render_chat
from arborspec.runtime.errors import ArborspecError
from arborspec.tools.serve.state import ServerState

# the request parameters (tools/serve/validation.py) that are Generator keywords as they are
GENERATOR_KEYS = ("temperature", "top_k", "top_p", "seed", "stop", "include_stop_str_in_output")


def run_choice(state: ServerState, prompt, params: dict, chat: bool, on_chunk=None, cancelled=lambda: False) -> dict:
    """One generation on a pooled generator (a worker thread): text, tokens, stats.
    on_chunk(text, logprobs): each streamed piece, with its tokens' log-probs (as the record's
    `logprobs`) when the request asked for them, else None."""
    prompt, ids, cut = _prompt_ids(state, prompt, params, chat)
    g = state.pool.acquire(ids=ids)
    try:
        params = _fit_context(ids, params, state.settings.max_context)
        lp, echo = params.get("logprobs"), params.get("echo")
        head = (
            (prompt if isinstance(prompt, str) and not cut else g.tokenizer.decode(ids)) if echo and g.tokenizer else ""
        )
        # one call: the prompt alone, or log-probs not streamed or with the prompt's (echo) first
        if params["max_new_tokens"] == 0 or (lp is not None and (on_chunk is None or echo)):
            return _in_one_call(state, g, ids, head, params, on_chunk)
        return _streamed(state, g, ids, head, params, on_chunk, cancelled)
    finally:
        state.pool.release(g)


def _prompt_ids(state: ServerState, prompt, params: dict, chat: bool) -> tuple:
    """(prompt, its token ids, whether truncate_prompt_tokens cut them): a chat's messages
    rendered by the chat template first. The generators share one tokenizer: the ids are known
    before a generator is chosen."""
    first = state.first
    if chat:
        if first.tokenizer is None:
            raise ArborspecError("this model has no tokenizer: chat needs one")
        prompt = render_chat(first.tokenizer, prompt, params.get("tools"))
    ids = first.encode_prompt(prompt)
    k = params.get("truncate_prompt_tokens")
    cut = k is not None and len(ids) > k
    if cut:  # vLLM's truncate_prompt_tokens: the prompt's last k tokens
        ids = ids[-k:]
    return prompt, ids, cut


def _fit_context(ids: list[int], params: dict, max_context: int) -> dict:
    """params with max_new_tokens set (None: the rest of the context), checked against the context."""
    if params["max_new_tokens"] is None:  # the rest of the context
        if len(ids) >= max_context:
            raise ArborspecError(f"the prompt ({len(ids)} tokens) fills the model's context of {max_context}")
        params = {**params, "max_new_tokens": max_context - len(ids)}
    if len(ids) + params["max_new_tokens"] > max_context:
        raise ArborspecError(
            f"the prompt ({len(ids)} tokens) plus max_tokens ({params['max_new_tokens']}) "
            f"is beyond the model's context of {max_context}"
        )
    return params


def _keywords(params: dict) -> dict:
    return {k: params[k] for k in GENERATOR_KEYS if k in params} | params["penalties"]


def _in_one_call(state: ServerState, g, ids: list[int], head: str, params: dict, on_chunk) -> dict:
    """The choice as one `generate` call (its text handed to on_chunk whole)."""
    lp, echo = params.get("logprobs"), params.get("echo")
    only_prompt = params["max_new_tokens"] == 0  # echo of the prompt alone: its one token dropped
    plp = lp if echo else None  # echo: the prompt's log-probs first
    c = g.generate(ids, max(params["max_new_tokens"], 1), logprobs=lp, prompt_logprobs=plp, **_keywords(params))
    text, lps, reason = ("", [], "length") if only_prompt else (c.text, c.logprobs, c.stop_reason)
    lps = None if lp is None else named(g, (c.prompt_logprobs or []) + lps)
    if on_chunk and head + text:
        on_chunk(head + text, lps)
    return record(state, c.stats, head + text, (len(ids), reason), params, lps, 0 if only_prompt else None)


def _streamed(state: ServerState, g, ids: list[int], head: str, params: dict, on_chunk, cancelled) -> dict:
    """The choice as a `stream`, each piece handed to on_chunk; stops early once cancelled()."""
    lp = params.get("logprobs")
    if on_chunk and head:
        on_chunk(head, None)
    text = [head]
    it = g.stream(ids, params["max_new_tokens"], logprobs=lp, **_keywords(params))
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
    res = it.result  # final: the stream is closed
    return record(state, res.stats, "".join(text), (len(ids), res.stop_reason), params)


def named(g, entries: list) -> list:
    """Log-prob entries (token id, log-prob, [(id, log-prob)]) with each token as its text."""

    def word(t: int) -> str:
        return g.tokenizer.decode([t]) if g.tokenizer is not None else str(t)

    return [(word(t), lp, [(word(a), alp) for a, alp in top]) for t, lp, top in entries]


def record(
    state: ServerState, st, text: str, ended: tuple, params: dict, logprobs=None, completion_tokens=None
) -> dict:
    """One generation's record (its stats `st` counted in the metrics); ended: (prompt tokens,
    stop reason); logprobs: `named` entries; completion_tokens: what the client is told, when
    not the tokens decoded (an echo of the prompt alone decodes one and returns none)."""
    n_prompt, stop_reason = ended
    state.metrics.count_generation(st)
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
