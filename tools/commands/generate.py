"""`arborspec generate`: run vanilla, chain or tree speculative decoding and print the text.

Role: the user-facing loop around runtime.decode.SpeculativeDecoder: opens the engines for a
backend, tokenizes the prompt (optionally through the chat template), streams the text as
each step commits tokens, and reports the step statistics (or one JSON object with --json).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from arborspec.runtime.errors import InputError
from arborspec.tools.commands.options import (
    add_sampling_args,
    add_tree_arg,
    check_decoding_args,
    command_parser,
    response_format_from_args,
    sampling_from_args,
)
from arborspec.tools.engines import add_model_args, open_models, resolved_config
from arborspec.tools.options import JSON_HELP, PREFIX_CACHE

EXAMPLE = """examples:
  arborspec generate --model smollm2-135m --draft layers:4 --mode tree --tree full:3,2 \\
      --chat --prompt 'Write a haiku about trees.' --max-new-tokens 64
  arborspec generate --export-dir ~/.cache/arborspec/exports/smollm2 --backend onnxruntime \\
      --temperature 0.8 --top-p 0.95 --n 3 --seed 1 --prompt 'Once upon a time' --json
  arborspec generate --export-dir E3Q --draft export+lookup --tree auto --chat --prompt 'Sort: pears, apples'
  arborspec generate --export-dir E3Q --chat --prompt 'List three fruits.' --stop $'\\n\\n' --stop '4.'
  arborspec generate --export-dir E3Q --chat --prompt 'Name ten animals.' --repetition-penalty 1.2 --logit-bias 198=-5
  arborspec generate --export-dir E3Q --chat --prompt 'Maria, 34, lives in Porto. As JSON.' --json-schema person.json
  arborspec generate --model tiny.pt --draft bigram --prompt-ids 1,2,3 --json"""


def register(sub) -> None:
    p = command_parser(sub, "generate", "generate text with vanilla / chain / tree decoding", __doc__, EXAMPLE)
    add_model_args(p)
    g = p.add_argument_group("decoding")
    g.add_argument(
        "--mode",
        choices=["vanilla", "chain", "tree"],
        default=None,
        help="default: tree when there is a draft (an export's own, or --draft), else vanilla",
    )
    add_tree_arg(g, "; chain mode: chain:4")
    g.add_argument(
        "--candidates",
        choices=["topk", "sample", "sample-unique"],
        default=None,
        help="how draft children are chosen when sampling (default: what `tune --temperature` chose for "
        "--tree auto, else topk)",
    )
    add_sampling_args(g)
    g.add_argument("--n", type=int, default=1, help="independent completions (seeds seed..seed+N-1)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the text before the first TEXT (repeatable; stop reason 'stop'; needs a tokenizer)",
    )
    g.add_argument(
        "--include-stop",
        action="store_true",
        help="keep the stop string that ended the text at its end (vLLM's include_stop_str_in_output)",
    )
    pr = p.add_argument_group("prompt (one of)")
    pr.add_argument("--prompt", help="the prompt text")
    pr.add_argument("--prompt-file", type=Path, help="a UTF-8 text file holding the prompt")
    pr.add_argument("--prompt-ids", help="comma-separated token ids (models without a tokenizer)")
    pr.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    pr.add_argument("--system", default=None, help="system message with --chat")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help=JSON_HELP)
    o.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --json: each new token's log-prob under the target and the K (0-20) most likely there",
    )
    o.add_argument(
        "--vs-vanilla",
        action="store_true",
        help="also run vanilla decoding on the same backend and print both stats (each decoder runs once "
        "untimed first: first-call costs such as CUDA graph captures stay out of the speed-up)",
    )
    p.set_defaults(run=run)


def _check_one_prompt(args) -> None:
    if sum(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids)) != 1:
        raise InputError("give exactly one of --prompt, --prompt-file, --prompt-ids")


def prompt_ids(args, tok) -> list[int]:
    _check_one_prompt(args)
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not ids:
            raise InputError("empty prompt: --prompt-ids has no ids")
        return ids
    text = args.prompt if args.prompt is not None else _read(args.prompt_file)
    if not text.strip():
        raise InputError("empty prompt")
    if tok is None:
        raise InputError("this model has no tokenizer: give --prompt-ids")
    if args.chat:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        msgs.append({"role": "user", "content": text})
        text = tok.apply_chat(msgs)
        return tok.encode(text, add_bos=False)
    return tok.encode(text)


def _read(path: Path) -> str:
    from arborspec.runtime.fileio import read_text_file

    return read_text_file(path, "prompt file")


def resolve_mode(models, args) -> None:
    """args.mode for these models: as serve and Generator.from_export, tree when there is a
    draft, else vanilla; one line when a mode or --tree asks for a draft there is not."""
    if args.mode is None:
        if models.draft is None and args.tree:
            raise InputError(f"--tree {args.tree} needs a draft: {_draft_hint(args)} (or leave --tree out)")
        args.mode = "tree" if models.draft is not None else "vanilla"
    if args.mode != "vanilla" and models.draft is None:
        raise InputError(f"--mode {args.mode} needs a draft: {_draft_hint(args)} (or --mode vanilla)")


def make_generator(models, args, mode: str | None = None):
    """The embedding API's Generator over the opened models (what a production app runs), its
    configuration the flags' through the one resolver (runtime/decoder_config.resolve_config:
    mode, tree, the tuned tree, node limits); `mode`: another than --mode (--vs-vanilla's)."""
    from arborspec.runtime.decoder_config import DecoderConfig
    from arborspec.runtime.generator import Generator

    mode = mode or args.mode
    asked = DecoderConfig(
        mode=mode,
        tree=args.tree,
        candidates=args.candidates,
        prefix_cache=PREFIX_CACHE[getattr(args, "prefix_cache", "auto")],
    )
    tok = models.tokenizer
    return Generator(
        models.target,
        models.draft if mode != "vanilla" else None,
        tok,
        resolved_config(models, args, asked),
        eos_token_ids=tok.eos_token_ids if tok is not None else [],
    )


def make_request(args, ids: list[int], seed: int, text: bool = True):
    """The GenerationRequest of the flags for prompt `ids` (text=False: without stop strings and
    log-probs: --vs-vanilla's runs); one line for a bad sampling flag or a response format
    without a tokenizer."""
    from arborspec.runtime.request import GenerationRequest

    rf = response_format_from_args(args)
    return GenerationRequest(
        ids,
        args.max_new_tokens,
        seed=seed,
        logprobs=getattr(args, "logprobs", None) if text else None,
        sampling=sampling_from_args(args),
        stop=getattr(args, "stop", None) if text else None,
        include_stop_str_in_output=bool(getattr(args, "include_stop", False)) and text,
        response_format=rf,
    )


def _check_limits(models, n_prompt: int, max_new: int) -> None:
    ctx = models.limits.get("max_context")
    if ctx and n_prompt + max_new > ctx:
        raise InputError(
            f"prompt ({n_prompt} tokens) + max-new-tokens ({max_new}) exceeds the export's max context of {ctx}"
        )


def _stats_line(st) -> str:
    return (
        f"[{st.mode}{' ' + st.tree if st.tree else ''}] {st.new_tokens} tokens in {st.decode_s:.2f} s "
        f"= {st.tokens_per_s:.1f} tok/s | mean accepted {st.mean_accepted:.2f}/target call | "
        f"target calls {st.target_calls} draft calls {st.draft_calls} | split: draft {st.draft_s:.2f}s "
        f"verify {st.verify_s:.2f}s accept+kv {st.accept_kv_s:.3f}s other {st.other_s:.3f}s | "
        f"prefill {st.prefill_s:.2f}s" + (f" | first token {1e3 * st.ttft_s:.0f} ms" if st.ttft_s is not None else "")
    )


def _check_output_args(args) -> list[str]:
    """The cheap checks of --n, --logprobs, --stop and the prompt flags, before any model loads;
    returns --stop's strings."""
    if args.n < 1:
        raise InputError(f"--n must be >= 1, got {args.n}")
    check_decoding_args(args)  # the cheap things before loading models
    _check_one_prompt(args)  # before the models load
    if args.logprobs is not None:
        from arborspec.runtime.decode import MAX_LOGPROBS

        if not 0 <= args.logprobs <= MAX_LOGPROBS:
            raise InputError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {args.logprobs}")
        if not args.json:
            raise InputError("--logprobs is printed with --json")
    from arborspec.runtime.stop_strings import parse_stop

    stops = parse_stop(args.stop)
    if args.include_stop and not stops:
        raise InputError("--include-stop keeps the stop string: give --stop TEXT too")
    if stops and args.prompt_ids is not None:
        raise InputError("--stop matches text: give a text prompt (--prompt or --prompt-file)")
    if args.prompt_file is not None:
        _read(args.prompt_file)  # missing or not UTF-8: one line before the models load
    return stops


@dataclass
class _Completions:
    """The --n completions of one prompt: (tokens, stats, stop reason), text and log-probs each."""

    runs: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    lps: list = field(default_factory=list)

    def add(self, c, text: bool) -> None:
        """One Completion (runtime/generator.py); text: whether there is a tokenizer."""
        self.runs.append((c.tokens, c.stats, c.stop_reason))
        self.texts.append(c.text if text else None)
        self.lps.append(c.logprobs)


def run(args) -> int:
    stops = _check_output_args(args)
    models = open_models(args, need_draft=args.mode != "vanilla")
    with models:  # closes the engines it opened (TensorRT-RTX saves its runtime cache)
        resolve_mode(models, args)
        tok = models.tokenizer
        ids = prompt_ids(args, tok)
        _check_limits(models, len(ids), args.max_new_tokens)
        if tok is None and response_format_from_args(args) is not None:
            raise InputError("--json-object / --json-schema need a tokenizer: this model has none")
        gen = make_generator(models, args)
        vgen = None
        if args.vs_vanilla and args.mode != "vanilla":
            # a speed comparison: each decoder once untimed first, so that neither's figure holds
            # first-call costs (CUDA graph captures: a one-shot GPU run printed 0.67x for 1.20x)
            vgen = make_generator(models, args, mode="vanilla")
            for g in (gen, vgen):
                g.generate(make_request(args, ids, args.seed, text=False))
        stream_text = not args.json and args.n == 1 and tok is not None
        if stops and tok is None:
            raise InputError("--stop matches text: this model has no tokenizer")
        done = _Completions()
        for i in range(args.n):
            req = make_request(args, ids, args.seed + i)
            done.add(_streamed(gen, req) if stream_text else gen.generate(req), tok is not None)
        if args.prompt_ids is None and not args.chat:
            from arborspec.runtime.generator import warn_if_empty_answer

            warn_if_empty_answer(tok, len(done.runs[0][0]), done.runs[0][2], "--chat")
        vanilla = vgen.generate(make_request(args, ids, args.seed, text=False)) if vgen is not None else None
        if args.json:
            print(json.dumps(_json_result(args, ids, done, vanilla, models)))
            return 0
        _print_text(args, done, stream_text, vanilla, stops)
        return 0


def _streamed(gen, req):
    """One completion streamed to stdout as its text becomes final -> a Completion."""
    from arborspec.runtime.generator import Completion

    chunks, pieces = gen.stream(req), []
    for text in chunks:
        pieces.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    res = chunks.result
    return Completion("".join(pieces), chunks.tokens, len(req.prompt), res.stop_reason, res.stats)


def _json_result(args, ids: list[int], done: _Completions, vanilla, models) -> dict:
    """--json's one object: text, tokens, stats (aggregated over --n), log-probs, vanilla's run."""
    tok, runs = models.tokenizer, done.runs
    stats = [s.to_dict() | {"stop_reason": r} for _, s, r in runs]
    out = {
        "prompt_tokens": len(ids),
        "text": done.texts[0] if args.n == 1 else done.texts,
        "tokens": runs[0][0] if args.n == 1 else [t for t, _, _ in runs],
        "stats": stats[0] if args.n == 1 else _aggregate(stats),
        "model": models.describe,
    }
    if args.n > 1:
        out["stats_per_run"] = stats
    if args.logprobs is not None:  # per token: its id, text, log-prob, and the K most likely
        word = (lambda t: tok.decode([t])) if tok is not None else str  # noqa: E731
        rows = [
            [
                {"token": t, "text": word(t), "logprob": lp, "top": [[a, word(a), v] for a, v in top]}
                for t, lp, top in run
            ]
            for run in done.lps
        ]
        out["logprobs"] = rows[0] if args.n == 1 else rows
    if vanilla is not None:
        out["vanilla"] = {
            "text": tok.decode(vanilla.tokens, skip_special_tokens=True) if tok else None,
            "tokens": vanilla.tokens,
            "stats": vanilla.stats.to_dict(),
            "speedup": (runs[0][1].tokens_per_s / vanilla.stats.tokens_per_s if vanilla.stats.tokens_per_s else None),
        }
    return out


def _print_text(args, done: _Completions, stream_text: bool, vanilla, stops) -> None:
    """The texts not streamed already on stdout, each run's stats line (and vanilla's) on stderr."""
    runs = done.runs
    for i, (toks, st, reason) in enumerate(runs):
        if not stream_text:
            if args.n > 1:
                print(f"--- completion {i + 1} (seed {args.seed + i})")
            print(done.texts[i] if done.texts[i] is not None else ",".join(map(str, toks)))
        print(_stats_line(st) + f" | stop: {reason}", file=sys.stderr)
    if vanilla is not None:
        st = runs[0][1]
        print(_stats_line(vanilla.stats), file=sys.stderr)
        same = (vanilla.tokens[: len(runs[0][0])] if stops else vanilla.tokens) == runs[0][0]
        sp = st.tokens_per_s / vanilla.stats.tokens_per_s if vanilla.stats.tokens_per_s else float("nan")
        print(f"speed-up {sp:.2f}x vs vanilla" + (" | identical tokens" if same else ""), file=sys.stderr)


def _draft_hint(args) -> str:
    """The drafts this backend takes, for the 'needs a draft' line."""
    if args.model and (args.backend or "torch") == "torch":
        return "give --draft layers:K|bigram|lookup[:N]|eagle3[:DIR]|MODEL"
    return "this export has no draft; give --draft lookup[:N] (or export one: arborspec export --draft layers:K)"


def _aggregate(stats: list[dict]) -> dict:
    n_tok = sum(s["new_tokens"] for s in stats)
    steps = sum(s["steps"] for s in stats)
    dec_s = sum(s["decode_s"] for s in stats)
    agg = {
        k: sum(s[k] for s in stats)
        for k in (
            "new_tokens",
            "steps",
            "target_calls",
            "draft_calls",
            "draft_s",
            "verify_s",
            "accept_kv_s",
            "other_s",
            "prefill_s",
            "total_s",
        )
    }
    agg.update(
        mean_accepted=n_tok / steps if steps else 0.0, tokens_per_s=n_tok / dec_s if dec_s else 0.0, runs=len(stats)
    )
    return agg
