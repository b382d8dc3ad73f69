"""arborspec.runtime stays embeddable: no module of it imports onnx, onnxscript, polygraphy,
transformers or the export/models/tools code, neither at the top nor lazily inside a function
(checked statically over every import statement), and every module imports with those blocked
(checked in a fresh interpreter). The whole package (runtime, models, export, tools) has no
import cycle, function-level imports included."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import arborspec.runtime
import arborspec.tools

FORBIDDEN = (
    "onnx",
    "onnxscript",
    "polygraphy",
    "transformers",
    "arborspec.models",
    "arborspec.export",
    "arborspec.tools",
)


def _modules(pkg):
    yield pkg.__name__, Path(pkg.__file__)
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        spec = m.module_finder.find_spec(m.name)
        yield m.name, Path(spec.origin)


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import statement in the file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _forbidden(mod: str) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)


def test_runtime_modules_import_nothing_forbidden_statically():
    found = []
    mods = list(_modules(arborspec.runtime))
    assert len(mods) >= 20  # the walk sees the whole package (sub-packages included)
    for name, path in mods:
        found += [f"{name}:{line} imports {mod}" for line, mod in _imports(name, path) if _forbidden(mod)]
    assert not found, "\n".join(found)


def test_the_static_check_catches_a_lazy_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from ..export import onnx_export\n    import onnx\n")
    mods = [m for _, m in _imports("arborspec.runtime.m", f)]
    assert "arborspec.export" in mods and "onnx" in mods
    assert any(_forbidden(m) for m in mods)


BLOCKER = """
import importlib.abc, sys
FORBIDDEN = %r
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, Block())
import importlib, pkgutil, arborspec.runtime as r
names = [r.__name__] + [m.name for m in pkgutil.walk_packages(r.__path__, r.__name__ + ".")]
for n in names:
    importlib.import_module(n)
loaded = [m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
assert not loaded, loaded
print(len(names))
"""


def test_runtime_modules_import_with_the_forbidden_ones_blocked():
    r = subprocess.run([sys.executable, "-c", BLOCKER % (FORBIDDEN,)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) >= 20


def _module_graph(pkgs) -> dict[str, set[str]]:
    """module -> the package modules it imports, at the top or inside a function (an import of
    `a.b.name` counts as one of the longest module prefix `a.b`)."""
    files = dict(m for pkg in pkgs for m in _modules(pkg))
    names = set(files)

    def owner(mod: str) -> str | None:
        while mod and mod not in names:
            mod = mod.rpartition(".")[0]
        return mod or None

    return {n: {owner(m) for _, m in _imports(n, path)} - {None, n} for n, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    seen, stack, cycles = set(), [], []

    def visit(n):
        if n in stack:
            cycles.append(stack[stack.index(n) :] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            visit(d)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    return cycles


def test_the_package_has_no_import_cycles():
    """runtime, models, export and tools: no module reaches itself through imports, lazy
    (function-level) ones included."""
    import arborspec.export
    import arborspec.models

    graph = _module_graph([arborspec.runtime, arborspec.models, arborspec.export, arborspec.tools])
    assert len(graph) >= 80 and "arborspec.runtime.drafts.base" in graph  # sub-packages walked
    assert "arborspec.runtime.drafts.base" in graph["arborspec.runtime.drafts.model"]
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_catches_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import g\n")
    (tmp_path / "c.py").write_text("import p.a\n")
    graph = {n: {m for _, m in _imports(f"p.{n}", tmp_path / f"{n}.py")} for n in "abc"}
    graph = {f"p.{n}": {m.rpartition(".")[0] if m.count(".") > 1 else m for m in deps} for n, deps in graph.items()}
    assert _cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]


FRONT_DOOR = """
import sys, arborspec.runtime as r
assert not [m for m in ("torch", "onnxruntime") if m in sys.modules], "import arborspec.runtime loaded them"
want = {"Generator", "SpeculativeDecoder", "BatchDecoder", "DecoderConfig", "SamplingParams",
        "GenerationRequest", "open_export", "EngineBase", "ArborspecError", "InputError", "EngineError"}
assert want <= set(r.__all__), want - set(r.__all__)
for name in r.__all__:
    obj = getattr(r, name)
    assert obj.__name__ == name and obj.__module__.startswith("arborspec.runtime."), (name, obj)
try:
    r.no_such_name
except AttributeError:
    print(len(r.__all__))
"""


def test_the_front_door_lists_the_public_names_and_loads_them_lazily():
    """`arborspec.runtime.__all__` names the embedding API (Generator, the decoders, their
    config, open_export, the engine base, the errors); importing the package loads neither
    torch nor onnxruntime, each name is its defining module's object on first use."""
    r = subprocess.run([sys.executable, "-c", FRONT_DOOR], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) >= 11
