"""User-facing errors: what a caller (or the CLI) reports as one line.

Role in one decode step: none directly; every check that guards a step (bad prompt, tree spec,
export folder, engine, NaN logits) raises one of these, and the CLI turns exactly these into
one line and exit status 2. Anything else is a bug and keeps its traceback.

`ArborspecError` subclasses ValueError so `except ValueError` in existing callers keeps
working; the file errors also subclass FileNotFoundError.
"""

from __future__ import annotations


class ArborspecError(ValueError):
    """A mistake in the caller's input or files, reported as one line."""


class InputError(ArborspecError):
    """Bad call arguments: prompt, sampling values, token budget, mode, draft spec."""


class TreeSpecError(ArborspecError):
    """A malformed or impossible tree spec."""


class ExportDirError(ArborspecError):
    """An export folder (or engines folder) that cannot be used."""


class MissingFileError(ArborspecError, FileNotFoundError):
    """A file or folder the caller named (or a manifest lists) does not exist."""


class EngineError(ArborspecError):
    """An engine that cannot be built, loaded or called with these shapes."""


class NumericalError(ArborspecError):
    """NaN or Inf in an engine's output: reported with the step and the engine."""


class OutputError(ArborspecError):
    """Output that cannot be written (full disk, file-size limit, permissions)."""


class DeviceError(EngineError, RuntimeError):
    """The device asked for is not usable here (no CUDA GPU, a CPU-only ONNX Runtime)."""


class InexactSpeculationWarning(UserWarning):
    """The target's logits depend on how many tokens one call carries (e.g. ONNX Runtime's
    MatMulNBits with int8 activations), so chain and tree decoding can differ from vanilla
    decoding of the same export: the one correctness promise arborspec cannot keep there."""


class ThreadPoolWarning(UserWarning):
    """A model draft and the target on ONNX Runtime's CPU, each session on a thread pool of its
    own: every call pays its pool's wake-up, and on a fast (int4) target that can make speculation
    slower than vanilla decoding. `arborspec.enable_shared_pool()` before opening fixes it."""


class EmptyCompletionWarning(UserWarning):
    """A text prompt answered with EOS at once by a model that has a chat template: an
    instruct model asked without its template (the fix: chat=True / `--chat`)."""


def one_line(e: BaseException) -> str:
    """The first line of an error's message (its type's name when the message is empty): what
    the CLI, a tool or the server reports of a caller's mistake."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
