"""Code health from the AST: long functions and long parameter lists, per folder.

Not part of a decode step: a yardstick for refactors (issue 57). A function's length is
its source span (``def`` line to last line, decorators excluded); a nested function counts
on its own and inside its parent. Parameters count every named one (``self``/``cls``
excluded, ``*args``/``**kwargs`` included).

Example:
    .venv/bin/python benchmarks/code_health.py                 # runtime models tools export
    .venv/bin/python benchmarks/code_health.py tools --long 60 --json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FOLDERS = ("runtime", "models", "tools", "export")


def _param_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def _functions(path: Path):
    """Yield (qualified name, lines, parameters) for every function in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child.end_lineno - child.lineno + 1, _param_count(child)
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def measure(folders, long_lines=80, many_params=8):
    """Return {"long": [...], "folders": {folder: figures}} for the given top folders."""
    long_functions = []
    per_folder = defaultdict(lambda: {"functions": 0, "long": 0, "max_params": 0,
                                      "max_params_at": "", "many_params": 0})
    for top in folders:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            folder = str(rel.parent)
            figures = per_folder[folder]
            for name, lines, params in _functions(path):
                figures["functions"] += 1
                if lines > long_lines:
                    figures["long"] += 1
                    long_functions.append({"file": str(rel), "function": name, "lines": lines})
                if params >= many_params:
                    figures["many_params"] += 1
                if params > figures["max_params"]:
                    figures["max_params"] = params
                    figures["max_params_at"] = f"{rel}:{name}"
    long_functions.sort(key=lambda f: -f["lines"])
    return {"long_lines": long_lines, "many_params": many_params,
            "long": long_functions, "folders": dict(sorted(per_folder.items()))}


def _print(report) -> None:
    print(f"functions over {report['long_lines']} lines: {len(report['long'])}")
    for f in report["long"]:
        print(f"  {f['file']}:{f['function']}:{f['lines']}")
    print(f"\n{'folder':32} {'funcs':>5} {'>' + str(report['long_lines']):>5} "
          f"{'maxpar':>6} {'>=' + str(report['many_params']):>4}  max at")
    totals = {"functions": 0, "long": 0, "many_params": 0, "max_params": 0}
    for folder, f in report["folders"].items():
        print(f"{folder:32} {f['functions']:5} {f['long']:5} {f['max_params']:6} "
              f"{f['many_params']:4}  {f['max_params_at']}")
        for key in ("functions", "long", "many_params"):
            totals[key] += f[key]
        totals["max_params"] = max(totals["max_params"], f["max_params"])
    print(f"{'total':32} {totals['functions']:5} {totals['long']:5} "
          f"{totals['max_params']:6} {totals['many_params']:4}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: .venv/bin/python benchmarks/code_health.py tools runtime --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", default=list(DEFAULT_FOLDERS),
                        help="top folders under the repository (default: %(default)s)")
    parser.add_argument("--long", type=int, default=80, help="a long function has more lines")
    parser.add_argument("--params", type=int, default=8,
                        help="count functions with at least this many parameters")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    missing = [f for f in args.folders if not (ROOT / f).is_dir()]
    if missing:
        print(f"code_health: no such folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    report = measure(args.folders, args.long, args.params)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
