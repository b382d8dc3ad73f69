"""What the commands and the libraries under tools/ share about their options, without the CLI.

Role in one decode step: none. The values an option means (--prefix-cache's choices ->
`Generator(prefix_cache=...)`), the help texts of the options several commands take (one
vocabulary for the same idea in every --help), and `UserError`, a bad option value as one line
on stderr and exit status 2 (tools/commands/cli.py). tools/engines.py and tools/serve/ take them
from here, never from the command-line module.
"""

from __future__ import annotations

from arborspec.runtime.decoder_config import DEFAULT_TREE
from arborspec.runtime.errors import InputError


class UserError(InputError):
    """A mistake in the user's command-line input: reported as one line, exit status 2."""


# --prefix-cache's choices -> Generator(prefix_cache=...): None = where exact (row-invariant targets)
PREFIX_CACHE = {"auto": None, "on": True, "off": False}
TREE_HELP = (
    "tree policy: chain:K | full:D,W | beam:n1,n2,... | dynamic:K,D,N[,P] | static:FILE.json | "
    f"auto (the tree `arborspec tune` chose) (default: the export's tree, else {DEFAULT_TREE})"
)
DRAFT_HELP = (
    "draft: layers:K (the target's first K layers), bigram (a table from the target), "
    "lookup[:N] (n-gram prompt lookup; any backend), suffix[:nodes=24,alpha=1,prob=0.1,min=1,mem=0] (min=4 when mixed) "
    "(suffix-tree draft: chains as long as the text's earlier match; any backend), eagle3[:DIR] (an "
    "EAGLE-3 head; torch backend), none, a model NAME|PATH with the same vocabulary (torch backend), or "
    "BASE+lookup[:N] / BASE+suffix[:...] (a model draft mixed with lookup, or its tree merged with the "
    "suffix draft's: eagle3+suffix; export+lookup for an export folder's own draft). "
    "With --export-dir: export (its own draft; default), none, lookup[:N], suffix[:...], "
    "export+lookup[:N] or export+suffix[:...]"
)
DRAFT_HELP_EXPORT = (
    "draft: export (the folder's own draft; default), none, lookup[:N] (n-gram prompt lookup), "
    "suffix[:...] (suffix-tree draft), or export+lookup[:N] / export+suffix[:...] (the folder's draft "
    "mixed with lookup, or merged with the suffix draft's trees)"
)
DEVICE_HELP = "cpu or cuda[:N] (default cpu)"
QUIET_HELP = "no progress bars (they are drawn only when stderr is a terminal anyway)"
JSON_HELP = "print the result as one JSON object on stdout (instead of text)"
JSON_OUT_HELP = "also write the results to this JSON file"


def tool_parser(doc: str, prog: str | None = None, example: str | None = None):
    """The argument parser of a `python -m arborspec.tools...` module: the docstring's first
    paragraph as its description; `example` as its epilog, else the docstring's last paragraph
    (its example) kept as written."""
    import argparse

    first = doc.split("\n\n")[0]
    if example is not None:
        return argparse.ArgumentParser(prog=prog, description=first, epilog=example)
    return argparse.ArgumentParser(
        prog=prog, description=first, epilog=doc.split("\n\n")[-1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
