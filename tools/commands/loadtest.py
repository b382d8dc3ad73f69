"""`arborspec loadtest`: concurrent clients against an OpenAI-compatible server (ours or another).

Role in one decode step: none; measures what a server's steps deliver to C concurrent clients:
aggregate tokens/s, latency and time-to-first-token percentiles, errors, and whether every
response came back to the request that asked for it.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import atomic_write_json
from arborspec.tools.commands.options import add_json_output_args, command_parser

EXAMPLE = """examples:
  arborspec loadtest --url http://127.0.0.1:8000 --concurrency 4 --requests 40 --stream --max-tokens 64
  arborspec loadtest --url http://127.0.0.1:8000 --concurrency 1 --requests 10 --chat --json-out one.json
  arborspec loadtest --url http://127.0.0.1:8000 --chat --turns 4 --requests 8 --stream   # 8 chats of 4 turns
"""
FOLLOW_UPS = ["Tell me more.", "Now say it in one sentence.", "Give an example.", "Why?", "And then?"]
PROMPTS = [
    "Write a haiku about trees.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip.",
    "Summarise: the harbour was quiet at dawn, the boats rocked.",
    "Count from one to ten in words.",
    "What is the capital of France?",
]


def register(sub) -> None:
    p = command_parser(sub, "loadtest", "concurrent clients against an OpenAI-compatible server", __doc__, EXAMPLE)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=4, help="clients sending at once (default 4)")
    p.add_argument("--requests", type=int, default=20, help="requests in all (default 20)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--stream", action="store_true", help="stream (measures time to first token)")
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="with --chat: each of --requests is a conversation of T turns, each turn the whole "
        "conversation so far (its answers and a follow-up); time to first token reported per turn",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sent with each request (default 0: greedy)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM's field): every answer runs to --max-tokens, a fixed-length load",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    add_json_output_args(p, " (the summary line then goes to stderr)")
    p.set_defaults(run=run)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def one_request(
    client,
    i: int,
    chat: bool,
    stream: bool,
    max_tokens: int,
    temperature: float,
    messages: list | None = None,
    extra: dict | None = None,
) -> dict:
    """One request tagged with its index (the nonce in the prompt lets the check tell answers
    apart); `messages`: a conversation to send instead of request i's first message; `extra`:
    more fields for its body (ignore_eos)."""
    prompt = f"[{i}] {PROMPTS[i % len(PROMPTS)]}"
    body = {"max_tokens": max_tokens, "temperature": temperature, "stream": stream, **(extra or {})}
    if stream:
        body["stream_options"] = {"include_usage": True}  # exact token counts (a chunk may hold several)
    if chat:
        body["messages"] = messages or [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    route = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    ttft, text, tokens, status, usage = None, "", 0, None, {}
    try:
        if stream:
            with client.stream("POST", route, json=body) as r:
                status = r.status_code
                if status != 200:
                    r.read()
                    return {"i": i, "ok": False, "status": status, "error": r.text[:200]}
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        return {"i": i, "ok": False, "status": status, "error": obj["error"]["message"]}
                    if obj.get("usage"):
                        tokens, usage = obj["usage"]["completion_tokens"], obj["usage"]
                    for ch in obj.get("choices", []):
                        piece = ch["delta"].get("content", "") if chat else ch.get("text", "")
                        if piece and ttft is None:
                            ttft = time.perf_counter() - t0
                        text += piece
        else:
            r = client.post(route, json=body)
            status = r.status_code
            if status != 200:
                return {"i": i, "ok": False, "status": status, "error": r.text[:200]}
            obj = r.json()
            ch = obj["choices"][0]
            text = ch["message"]["content"] if chat else ch["text"]
            tokens, usage = obj["usage"]["completion_tokens"], obj["usage"]
    except Exception as e:  # noqa: BLE001 - a failed request is a measured error, not a crash
        return {"i": i, "ok": False, "status": status, "error": f"{type(e).__name__}: {e}"[:200]}
    return {
        "i": i,
        "ok": True,
        "status": status,
        "latency_s": time.perf_counter() - t0,
        "ttft_s": ttft,
        "tokens": tokens,
        "text": text,
        # the prompt tokens the server says it reused (OpenAI's usage.prompt_tokens_details), if it says
        "cached": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


def one_conversation(
    client, i: int, turns: int, stream: bool, max_tokens: int, temperature: float, extra: dict | None = None
) -> list[dict]:
    """Conversation i: `turns` chat requests, each the conversation so far (the answers and a
    follow-up appended), as a chat client sends them; stops at the first failed turn."""
    msgs = [{"role": "user", "content": f"[{i}] {PROMPTS[i % len(PROMPTS)]}"}]
    out = []
    for t in range(turns):
        r = one_request(client, i, True, stream, max_tokens, temperature, messages=list(msgs), extra=extra) | {
            "turn": t
        }
        out.append(r)
        if not r["ok"]:
            break
        msgs += [
            {"role": "assistant", "content": r["text"]},
            {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]},
        ]
    return out


def loadtest(
    url: str,
    concurrency: int,
    requests: int,
    *,
    max_tokens: int = 64,
    stream: bool = False,
    chat: bool = False,
    temperature: float = 0.0,
    api_key: str | None = None,
    timeout: float = 600.0,
    turns: int = 1,
    ignore_eos: bool = False,
) -> dict:
    import httpx

    extra = {"ignore_eos": True} if ignore_eos else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    local = threading.local()

    def work(i):
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=url, headers=headers, timeout=timeout)
        if turns > 1:
            return one_conversation(local.c, i, turns, stream, max_tokens, temperature, extra)
        return [one_request(local.c, i, chat, stream, max_tokens, temperature, extra=extra)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        results = [r for conv in ex.map(work, range(requests)) for r in conv]
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    toks = sum(r["tokens"] for r in ok)
    seen = sorted({r["i"] for r in results}) if turns > 1 else sorted(r["i"] for r in results)
    by_turn = [[r["ttft_s"] for r in ok if r.get("turn") == t and r.get("ttft_s") is not None] for t in range(turns)]
    cached = [r["cached"] for r in ok if r.get("cached") is not None]
    return {
        "url": url,
        "concurrency": concurrency,
        "requests": requests * turns,
        "stream": stream,
        "chat": chat,
        "max_tokens": max_tokens,
        "wall_s": wall,
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "tokens": toks,
        "tokens_per_s": toks / wall if wall else 0.0,
        "latency_p50_s": _pct(lat, 0.5),
        "latency_p99_s": _pct(lat, 0.99),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "mean_latency_s": statistics.mean(lat) if lat else None,
        "all_answered_once": seen == list(range(requests)),
        "turns": turns,
        "ttft_p50_s_by_turn": [_pct(x, 0.5) for x in by_turn] if turns > 1 else None,
        "cached_tokens": sum(cached) if cached else None,  # None: the server reports none
        "error_samples": [r["error"] for r in results if not r["ok"]][:5],
    }


def run(args) -> int:
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1 or args.turns < 1:
        raise InputError("--concurrency, --requests, --max-tokens and --turns must be >= 1")
    if args.turns > 1 and not args.chat:
        raise InputError("--turns makes conversations: give --chat")
    if not args.url.startswith(("http://", "https://")):
        raise InputError(f"--url must start with http:// or https://, got {args.url!r}")
    res = loadtest(
        args.url.rstrip("/"),
        args.concurrency,
        args.requests,
        max_tokens=args.max_tokens,
        stream=args.stream,
        chat=args.chat,
        temperature=args.temperature,
        api_key=args.api_key,
        timeout=args.timeout,
        turns=args.turns,
        ignore_eos=args.ignore_eos,
    )
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print(
        f"{res['ok']}/{res['requests']} ok, {res['errors']} errors, {res['tokens']} tokens in {res['wall_s']:.1f} s "
        f"= {res['tokens_per_s']:.1f} tok/s | latency p50 {f(res['latency_p50_s'])} s p99 {f(res['latency_p99_s'])} s"
        f" | ttft p50 {f(res['ttft_p50_s'])} s p99 {f(res['ttft_p99_s'])} s"
        + (
            " | ttft p50 by turn " + " ".join(f(x) for x in res["ttft_p50_s_by_turn"]) + " s"
            if res.get("ttft_p50_s_by_turn")
            else ""
        )
        + (f" | {res['cached_tokens']} prompt tokens reused" if res.get("cached_tokens") is not None else ""),
        file=sys.stderr if args.json else sys.stdout,
    )
    if res["ok"] and res["tokens"] / res["ok"] <= 2 < args.max_tokens and not args.chat:
        print(
            f"arborspec: warning: the answers average {res['tokens'] / res['ok']:.1f} tokens: a chat/instruct model "
            "ends raw-text completions at once (no chat template); measure with --chat",
            file=sys.stderr,
        )
    if res["errors"]:  # say why, not only how many (a server that is not up: ConnectError)
        print(
            f"arborspec: error: {res['errors']} of {res['requests']} requests failed; the first: {res['error_samples'][0]}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(res))
    if args.json_out is not None:
        atomic_write_json(args.json_out, res, indent=1)
    return 0 if res["errors"] == 0 else 1
