"""`arborspec chat`: talk to a model in the terminal, one turn per line, the answers streamed.

Role: the conversation loop around the embedding API's runtime.generator.Generator: each turn renders the
whole conversation through the model's chat template (what a chat client sends a server) and
decodes the answer; a turn's prompt starts like the last one, so the decoder's prefix reuse
(runtime/kvcache.PrefixCache) prefills only the new message where it is on. The oldest turns
are dropped when the conversation would pass the context. Lines from a pipe work the same.
"""

from __future__ import annotations

import argparse
import sys

from arborspec.runtime.errors import InputError
from arborspec.tools.commands.options import (
    add_prefix_cache_arg,
    add_sampling_args,
    add_tree_arg,
    check_decoding_args,
    command_parser,
)
from arborspec.tools.engines import add_model_args, open_models

EXAMPLE = """examples:
  arborspec chat --export-dir ~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24
  arborspec chat --model smollm2-135m --draft eagle3 --system 'Answer in one sentence.' --stats
  printf 'Hi!\\nWhat did I just say?\\n' | arborspec chat --export-dir E3Q --max-new-tokens 64

In the conversation: /reset clears it, /exit (or Ctrl-D) ends it, Ctrl-C stops an answer."""


def register(sub) -> None:
    p = command_parser(
        sub, "chat", "talk to a model in the terminal (the chat template, answers streamed)", __doc__, EXAMPLE
    )
    add_model_args(p)
    g = p.add_argument_group("decoding")
    g.add_argument("--mode", choices=["vanilla", "chain", "tree"], default=None, help="default: tree with a draft")
    add_tree_arg(g)
    g.add_argument("--candidates", choices=["topk", "sample", "sample-unique"], default=None, help=argparse.SUPPRESS)
    add_sampling_args(g, "sampling seed of the first answer (then +1 a turn)")
    g.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most (default 512)")
    add_prefix_cache_arg(
        g,
        "prefill only a turn's new tokens: auto (default) = where exact (the int4 export), on, off",
    )
    c = p.add_argument_group("conversation")
    c.add_argument("--system", default=None, help="a system message first")
    c.add_argument("--stats", action="store_true", help="a statistics line on stderr after each answer")
    p.set_defaults(run=run)


def fit(tok, system: list, history: list, budget: int) -> tuple[list[int] | None, int]:
    """The conversation's prompt ids within `budget` tokens, dropping the oldest turns (a user
    message and its answer at a time; the system message stays) -> (ids or None when the last
    message alone does not fit, messages dropped)."""
    dropped = 0
    while True:
        ids = tok.encode(tok.apply_chat(system + history[dropped:]), add_bos=False)
        if len(ids) <= budget:
            return ids, dropped
        if len(history) - dropped <= 1:
            return None, dropped
        dropped += 2


def run(args) -> int:
    from arborspec.tools.commands.generate import _stats_line, make_generator, make_request, resolve_mode

    check_decoding_args(args)
    models = open_models(args, need_draft=args.mode != "vanilla")
    with models:
        resolve_mode(models, args)
        tok = models.tokenizer
        if tok is None or not tok.chat_template:
            raise InputError("this model has no chat template: use `arborspec generate` for plain prompts")
        gen = make_generator(models, args)
        ctx = models.limits.get("max_context") or models.target.info.max_position
        if args.max_new_tokens >= ctx:
            raise InputError(f"--max-new-tokens {args.max_new_tokens} leaves no room in the context of {ctx}")
        system = [{"role": "system", "content": args.system}] if args.system else []
        tty = sys.stdin.isatty()
        tree = gen.tree_spec(args.temperature > 0)
        reuse = "on" if gen.reuses_prefix else "off"
        say(f"chatting with {models.describe}: {gen.mode}{' ' + tree if tree else ''}, prefix cache {reuse}; /reset, /exit or Ctrl-D")
        history: list[dict] = []
        turn = 0
        while True:
            if tty:
                sys.stderr.write(">>> ")
                sys.stderr.flush()
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the conversation
                sys.stderr.write("\n")
                return 0
            if not line:
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() in ("/exit", "/quit"):
                break
            if text.strip() == "/reset":
                history = []
                say("conversation cleared")
                continue
            history.append({"role": "user", "content": text})
            ids, dropped = fit(tok, system, history, ctx - args.max_new_tokens)
            if ids is None:
                history.pop()
                say(f"that message is longer than the context leaves room for ({ctx - args.max_new_tokens} tokens)")
                continue
            if dropped:
                history = history[dropped:]
                say(f"dropped the {dropped // 2} oldest turn(s): the conversation passed the context of {ctx}")
            answer = []
            stop, chunks = None, gen.stream(make_request(args, ids, args.seed + turn))
            try:
                for text in chunks:
                    answer.append(text)
                    sys.stdout.write(text)
                    sys.stdout.flush()
                stop = chunks.result.stop_reason
            except KeyboardInterrupt:  # Ctrl-C stops this answer; what it said so far is kept
                stop = "interrupted"
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": "".join(answer)})
            if args.stats and chunks.result is not None:
                st = chunks.result.stats
                say(f"{_stats_line(st)} | prompt {st.prompt_tokens} tokens, {st.cached_tokens} reused | stop: {stop}")
            turn += 1
    return 0


def say(line: str) -> None:
    sys.stderr.write(f"arborspec: {line}\n")
    sys.stderr.flush()
