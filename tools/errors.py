"""How a tool's `main` ends on a caller's mistake: one line `PROG: error: MESSAGE` on stderr and
exit status 2, the `arborspec` command's own form; anything else (a bug) keeps its traceback.

Role in one decode step: none; the `python -m arborspec.tools...` measuring and training tools
wrap their `main` in it.

    @reports_mistakes("head_history")
    def main(argv=None) -> int: ...
"""

from __future__ import annotations

import functools
import sys

from arborspec.runtime.errors import ArborspecError, one_line


def reports_mistakes(prog: str):
    """Decorate a `main(argv) -> int`: an ArborspecError it raises becomes one line and status 2."""

    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except ArborspecError as e:
                print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
                return 2

        return run

    return wrap
