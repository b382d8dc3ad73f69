"""The `arborspec` command line: one module per command (COMMANDS below).

Each command lives in its own module `arborspec.tools.commands.<name>` exposing
`register(subparsers)` (adds its parser, with an example in the help) and `run(args) -> int`.
A user mistake raises an `ArborspecError` (arborspec.runtime.errors; `UserError` here is one)
and ends as one clear line on stderr and exit status 2: never a traceback. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

COMMANDS = ["export", "build", "generate", "chat", "compare", "bench", "tune", "train-draft", "serve", "loadtest"]


from arborspec.runtime import settings  # noqa: E402
from arborspec.runtime.errors import ArborspecError, InputError, one_line  # noqa: E402


class UserError(InputError):
    """A mistake in the user's command-line input: reported as one line, exit status 2."""


# one vocabulary for the same idea in every command's help
# --prefix-cache's choices -> Generator(prefix_cache=...): None = where exact (row-invariant targets)
PREFIX_CACHE = {"auto": None, "on": True, "off": False}
TREE_HELP = (
    "tree policy: chain:K | full:D,W | beam:n1,n2,... | dynamic:K,D,N[,P] | static:FILE.json | "
    "auto (the tree `arborspec tune` chose) (default: the export's tree, else full:3,2)"
)
DRAFT_HELP = (
    "draft: layers:K (the target's first K layers), bigram (a table from the target), "
    "lookup[:N] (n-gram prompt lookup; any backend), eagle3[:DIR] (an EAGLE-3 head; torch backend), "
    "none, a model NAME|PATH with the same vocabulary (torch backend), or BASE+lookup[:N] (a model "
    "draft mixed with lookup: eagle3+lookup; export+lookup for an export folder's own draft). "
    "With --export-dir: export (its own draft; default), none, lookup[:N] or export+lookup[:N]"
)
DRAFT_HELP_EXPORT = (
    "draft: export (the folder's own draft; default), none, lookup[:N] (n-gram prompt lookup), "
    "or export+lookup[:N] (the folder's draft mixed with lookup)"
)
QUIET_HELP = "no progress bars (they are drawn only when stderr is a terminal anyway)"
JSON_HELP = "print the result as one JSON object on stdout (instead of text)"
JSON_OUT_HELP = "also write the results to this JSON file"


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
    g.add_argument("--seed", type=int, default=0, help=seed_help)
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


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as argparse does, without the usage block
        sys.stderr.write(f"arborspec: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    from arborspec import __version__

    p = _Parser(
        prog="arborspec",
        description="Tree speculative decoding with ONNX Runtime / TensorRT engines: "
        + " | ".join(COMMANDS)
        + ".\n`arborspec COMMAND --help` shows what a command takes, with examples.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  arborspec export --model smollm2-135m --draft layers:4 --out out/smollm2\n"
        "  arborspec generate --export-dir out/smollm2 --chat --prompt 'Write a haiku about trees.'\n"
        "  arborspec serve --export-dir out/smollm2 --port 8000",
    )
    p.add_argument("--version", action="version", version=f"arborspec {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"arborspec.tools.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as e:
            if e.name == f"arborspec.tools.commands.{name.replace('-', '_')}":
                continue
            raise
        mod.register(sub)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every `finally` and cleanup of partial output runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _install_signal_handlers() -> dict:
    """SIGTERM -> Terminated (cleanups run, exit 143); SIGXFSZ ignored, so a write past a
    file-size limit fails with EFBIG (one line) instead of killing the process mid-write.
    Main thread only; returns the previous handlers."""
    import signal
    import threading

    old = {}
    if threading.current_thread() is threading.main_thread():
        old[signal.SIGTERM] = signal.signal(signal.SIGTERM, _on_sigterm)
        if hasattr(signal, "SIGXFSZ"):
            old[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return old


# commands whose output files are written atomically (or removed) when interrupted
CLEANS_UP_OUTPUT = ("export", "build", "bench", "tune", "train-draft")

# commands that only decode: the `arborspec` command runs their ONNX Runtime sessions on one
# shared thread pool (runtime/backends/onnxruntime.py enable_shared_pool: faster, process-wide)
SHARED_POOL_COMMANDS = ("generate", "chat", "bench", "tune", "serve")


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """The runtime's warnings to a user (InexactSpeculationWarning): one line, no source
    location; any other warning keeps Python's format."""
    from arborspec.runtime.errors import EmptyCompletionWarning, InexactSpeculationWarning

    if issubclass(category, (InexactSpeculationWarning, EmptyCompletionWarning)):
        text = f"arborspec: warning: {str(message).splitlines()[0]}\n"
    else:
        text = warnings.formatwarning(message, category, filename, lineno, line)
    (file or sys.stderr).write(text)


def _signal_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM (Terminated) that an exception was raised while handling, or None.
    Some code wraps what it catches: Python turns an exception raised inside a class body's
    `__set_name__` into a RuntimeError, and SIGTERM during torch's lazy import of torch._dynamo
    (an export's first weight init) ended `export` with that traceback and exit 1, not 143."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _cleanup_note(args) -> str:
    return "; partial output was removed" if getattr(args, "command", None) in CLEANS_UP_OUTPUT else ""


def main(argv: list[str] | None = None, shared_pool: bool = False) -> int:
    """The CLI. shared_pool: let decoding commands turn on ONNX Runtime's process-wide shared
    thread pool (the `arborspec` command does; in-process callers keep per-session pools)."""
    import signal

    parser = build_parser()
    args = parser.parse_args(argv)
    debug = settings.flag("ARBORSPEC_DEBUG")
    old = _install_signal_handlers()
    old_show, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        if getattr(args, "command", None) in SHARED_POOL_COMMANDS:
            from arborspec.runtime.backends import onnxruntime as ortb

            if shared_pool:
                ortb.enable_shared_pool()
            else:  # an in-process caller keeps per-session pools, knowingly: no ThreadPoolWarning
                ortb.keep_session_pools()
        try:
            return int(args.run(args) or 0)
        except Exception as e:
            stop = _signal_behind(e)
            if stop is None:
                raise
            raise stop from None  # the Ctrl-C or SIGTERM itself, for the handlers below
    except Terminated:
        sys.stderr.write(f"arborspec: terminated (SIGTERM){_cleanup_note(args)}\n")
        return 143
    except KeyboardInterrupt:
        sys.stderr.write(f"arborspec: interrupted{_cleanup_note(args)}\n")
        return 130
    except BrokenPipeError:  # `arborspec generate ... | head`: the reader has all it wants
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's last flush cannot fail again
        return 141
    except ArborspecError as e:
        if debug:
            raise
        sys.stderr.write(f"arborspec: error: {one_line(e)}\n")
        return 2
    except OSError as e:  # the system refused a file the command needed: one line, not a traceback
        if debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        sys.stderr.write(f"arborspec: error: {where}{e.strerror or type(e).__name__}{_cleanup_note(args)}\n")
        return 2
    finally:
        warnings.showwarning = old_show
        for sig, handler in old.items():
            signal.signal(sig, handler)


def console_main() -> int:
    """The `arborspec` console script (and `python -m arborspec.tools.commands.cli`)."""
    return main(shared_pool=True)


if __name__ == "__main__":
    sys.exit(console_main())
