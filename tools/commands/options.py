"""The options several commands take, declared once: each `add_*` adds a group's flags to a
parser (or argument group), its `*_from_args` reads them back.

Role in one decode step: none; the flags become a `SamplingParams` (runtime/sampling.py), a
response_format's grammar (runtime/structured.py) or a `Generator`'s settings. A command's
--help shows them with the same names, defaults and help texts wherever they appear
(tests/tools/test_cli_options.py checks that).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from arborspec.tools.options import JSON_HELP, JSON_OUT_HELP, PREFIX_CACHE, QUIET_HELP, TREE_HELP


def command_parser(sub, name: str, help: str, doc: str, example: str, description: str | None = None):
    """A command's parser: its one-line help in `arborspec --help`, its module docstring's
    first paragraph (or `description`) above its flags, its examples below them."""
    return sub.add_parser(
        name,
        help=help,
        description=summary(doc) if description is None else description,
        epilog=example,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_export_dir_arg(p, help: str = "export folder from `arborspec export`") -> None:
    """--export-dir DIR, required (build, compare, serve)."""
    p.add_argument("--export-dir", type=Path, required=True, help=help)


def add_tree_arg(g, note: str = "") -> None:
    """--tree SPEC, one tree policy (generate, chat, serve): TREE_HELP, then the command's `note`."""
    g.add_argument("--tree", default=None, help=TREE_HELP + note)


def add_seed_arg(g, help: str = "sampling seed (default 0)") -> None:
    """--seed N, default 0 (add_sampling_args', bench's, compare's, tune's, train-draft's)."""
    g.add_argument("--seed", type=int, default=0, help=help)


def add_prefix_cache_arg(g, help: str) -> None:
    """--prefix-cache auto|on|off (chat, serve): `PREFIX_CACHE[args.prefix_cache]` is Generator's."""
    g.add_argument("--prefix-cache", choices=list(PREFIX_CACHE), default="auto", help=help)


def add_quiet_progress_args(g) -> None:
    """--quiet (dest no_progress) and its old name --no-progress (bench, compare)."""
    g.add_argument("--quiet", dest="no_progress", action="store_true", help=QUIET_HELP)
    g.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)  # the old name


def add_json_output_args(g, json_note: str) -> None:
    """--json (the result on stdout; json_note: where the text goes instead) and --json-out FILE
    (bench, loadtest)."""
    g.add_argument("--json", action="store_true", help=JSON_HELP + json_note)
    g.add_argument("--json-out", type=Path, default=None, metavar="OUT.json", help=JSON_OUT_HELP)


def check_decoding_args(args) -> None:
    """The cheap checks of generate's and chat's decoding flags, before any model loads: one
    InputError line for --max-new-tokens below 1, a bad sampling flag, a malformed --json-schema
    or --grammar, or a --tree that does not parse (auto is resolved once the models are open)."""
    from arborspec.runtime.errors import InputError
    from arborspec.runtime.structured import schema_of
    from arborspec.runtime.trees import parse_tree_spec

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling_from_args(args)
    schema_of(response_format_from_args(args))  # a malformed schema: one line before the models load
    if args.tree and args.tree.strip().lower() != "auto":
        parse_tree_spec(args.tree)


def add_sampling_args(g, seed_help: str = "sampling seed (default 0)") -> None:
    """--temperature, --top-k, --top-p, --min-p, the penalties, --logit-bias, --seed (generate,
    chat); `sampling_from_args` reads them."""
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (0: all; default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    g.add_argument(
        "--min-p", type=float, default=0.0, help="keep tokens at least MIN_P times as likely as the top one (0: off)"
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the logits of prompt and output tokens by it (HF's rule; 1: off; greedy too)",
    )
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract it from generated tokens' logits (-2..2)"
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract it per occurrence from generated tokens' logits (-2..2)",
    )
    g.add_argument(
        "--logit-bias",
        action="append",
        default=None,
        metavar="TOKEN=BIAS",
        help="add BIAS (-100..100) to token id TOKEN's logit (repeatable)",
    )
    add_seed_arg(g, seed_help)
    g.add_argument("--min-tokens", type=int, default=0, help="no end of the answer before N tokens (default 0)")
    g.add_argument(
        "--ignore-eos", action="store_true", help="decode through end-of-sequence to --max-new-tokens (benchmarks)"
    )
    add_format_args(g)


def add_format_args(g) -> None:
    """--json-object, --json-schema, --grammar (generate, chat, bench); `response_format_from_args`
    reads them."""
    g.add_argument(
        "--json-object", action="store_true", help="answer with a JSON object (structured output; needs llguidance)"
    )
    g.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="answer with JSON that follows SCHEMA: a JSON Schema file, or the schema itself as JSON text",
    )
    g.add_argument(
        "--grammar",
        default=None,
        metavar="GRAMMAR",
        help="answer in GRAMMAR's language: a grammar file, or the grammar itself (Lark, or GBNF as llama.cpp writes it)",
    )


def response_format_from_args(args) -> dict | None:
    """OpenAI's response_format of --json-object / --json-schema / --grammar (None: plain text);
    one InputError line for a schema that is not a readable JSON object, or a grammar that is not
    a file or grammar text."""
    import json
    from pathlib import Path

    from arborspec.runtime.errors import InputError

    grammar = getattr(args, "grammar", None)
    if grammar is not None:
        if args.json_schema is not None or args.json_object:
            raise InputError("give one of --grammar, --json-schema, --json-object")
        path = Path(grammar).expanduser()
        if "\n" not in grammar and path.is_file():
            grammar = path.read_text(encoding="utf-8", errors="replace")
        elif ":" not in grammar:  # every Lark rule (start: ...) and GBNF rule (root ::= ...) has one
            raise InputError(f"--grammar: no such file {grammar} (give a grammar file or the grammar as text)")
        return {"type": "grammar", "grammar": grammar}
    if args.json_schema is None:
        return {"type": "json_object"} if args.json_object else None
    if args.json_object:
        raise InputError("give --json-object or --json-schema, not both")
    text = args.json_schema
    if not text.lstrip().startswith(("{", "[")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise InputError(f"--json-schema: no such file {text} (give a schema file or the schema as JSON text)")
        text = path.read_text(encoding="utf-8", errors="replace")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"--json-schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InputError("--json-schema must be a JSON object (a JSON Schema)")
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


def with_response_format(sp, rf, models):
    """`sp` with the grammar of `rf` (response_format_from_args') compiled for these models'
    tokenizer (runtime/structured.py); `sp` itself for None (generate, chat, bench)."""
    from dataclasses import replace

    from arborspec.runtime.errors import InputError
    from arborspec.runtime.structured import GrammarCompiler

    if rf is None:
        return sp
    if models.tokenizer is None:
        raise InputError("--json-object / --json-schema need a tokenizer: this model has none")
    compiler = GrammarCompiler(models.tokenizer, models.target.info.vocab_size, models.tokenizer.eos_token_ids)
    return replace(sp, grammar=compiler.grammar(rf))


def sampling_from_args(args):
    """The SamplingParams of add_sampling_args' flags (one InputError line for a bad value)."""
    from arborspec.runtime.errors import InputError
    from arborspec.runtime.sampling import SamplingParams

    bias = {}
    for item in args.logit_bias or []:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)  # (no "=": float("") fails too)
        except ValueError:
            raise InputError(f"--logit-bias takes TOKEN=BIAS (a token id and a number), got {item!r}") from None
    return SamplingParams(
        args.temperature,
        args.top_k,
        args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=bias,
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
    )


def summary(doc: str) -> str:
    """A module docstring's first paragraph as one line: the description a command's --help shows."""
    return " ".join(doc.strip().split("\n\n")[0].split())


