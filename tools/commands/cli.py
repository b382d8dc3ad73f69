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
from arborspec.runtime.errors import ArborspecError, one_line  # noqa: E402

# the shared vocabulary (tools/options.py) and option groups (tools/commands/options.py), re-exported:
# the commands and callers import them from here too
from arborspec.tools.commands.options import (  # noqa: E402, F401
    add_format_args,
    add_sampling_args,
    response_format_from_args,
    sampling_from_args,
    summary,
    with_response_format,
)
from arborspec.tools.options import (  # noqa: E402, F401
    DRAFT_HELP,
    DRAFT_HELP_EXPORT,
    JSON_HELP,
    JSON_OUT_HELP,
    PREFIX_CACHE,
    QUIET_HELP,
    TREE_HELP,
    UserError,
)


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
