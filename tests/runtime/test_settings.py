"""Settings live in one module: runtime/settings.py declares every ARBORSPEC_* environment variable
(kind, default, meaning) and is the only module of runtime/, models/, export/ and tools/ that reads
one; docs/settings.md holds the table the module prints; the typed accessors parse and reject
values as declared, read at call time."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from arborspec.runtime import settings
from arborspec.runtime.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "models", "export", "tools")
SETTINGS_FILE = ROOT / "runtime" / "settings.py"
_READERS = {"get", "getenv", "pop", "setdefault", "__getitem__"}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments (an env var's name kept in a constant)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def env_reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) of every ARBORSPEC_* read through os.environ / os.getenv in `source`."""
    tree = ast.parse(source)
    consts = _constants(tree)

    def name_of(arg: ast.AST) -> str | None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return consts.get(arg.id)
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            return str(arg.values[0].value)
        return None

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr in _READERS and _is_environ(f.value)) or (
                f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"
            ):
                key = name_of(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = name_of(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = name_of(node.left)
        if key and key.startswith("ARBORSPEC_"):
            found.append((node.lineno, key))
    # a line that names both the environment and a variable (e.g. through a helper) counts too
    for i, line in enumerate(source.splitlines(), 1):
        if re.search(r"environ|getenv", line) and (m := re.search(r"ARBORSPEC_\w+", line)):
            if not line.lstrip().startswith("#") and (i, m.group()) not in found:
                found.append((i, m.group()))
    return found


def _product_files():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path != SETTINGS_FILE:
                yield path


def test_scanner_finds_every_way_of_reading():
    """Negative control: the scan below would see a read written any of these ways."""
    src = (
        "import os\nfrom os import environ\nNAME = 'ARBORSPEC_A'\n"
        "a = os.environ.get('ARBORSPEC_B', '')\nb = os.getenv('ARBORSPEC_C')\n"
        "c = os.environ['ARBORSPEC_D']\nd = 'ARBORSPEC_E' in os.environ\ne = environ.get(NAME)\n"
        "f = os.environ.get('HOME')\n"
    )
    assert sorted(k for _, k in env_reads(src)) == [f"ARBORSPEC_{c}" for c in "ABCDE"]


def test_no_module_but_settings_reads_an_arborspec_variable():
    reads = [
        f"{path.relative_to(ROOT)}:{line}: {key}"
        for path in _product_files()
        for line, key in env_reads(path.read_text())
    ]
    assert not reads, "read these through arborspec.runtime.settings:\n" + "\n".join(reads)


def test_every_declared_setting_is_read_and_every_read_is_declared():
    """Each arborspec-scope setting is named in the code outside settings.py (so a declaration
    cannot outlive its use), each tests-scope one in tests/, and every ARBORSPEC_* string the code
    passes to the accessors is declared."""
    code = "\n".join(p.read_text() for p in _product_files())
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != "test_settings.py")
    for s in settings.SETTINGS.values():
        where = code if s.scope == "arborspec" else tests
        assert f'"{s.name}"' in where, f"{s.name} is declared but nothing reads it"
    used = set(re.findall(r"settings\.\w+\(\"(ARBORSPEC_\w+)\"", code))
    assert used and used <= set(settings.SETTINGS), used - set(settings.SETTINGS)
    for s in settings.SETTINGS.values():
        assert s.meaning and "\n" not in s.meaning and s.doc, s.name
        assert (ROOT / "docs" / s.doc).is_file(), f"{s.name}: docs/{s.doc} does not exist"


def test_accessors_parse_at_call_time(monkeypatch):
    monkeypatch.delenv("ARBORSPEC_ORT_ROW_LAYOUT", raising=False)
    assert settings.switch("ARBORSPEC_ORT_ROW_LAYOUT") is None
    monkeypatch.setenv("ARBORSPEC_ORT_ROW_LAYOUT", " 1 ")
    assert settings.switch("ARBORSPEC_ORT_ROW_LAYOUT") is True
    monkeypatch.setenv("ARBORSPEC_ORT_ROW_LAYOUT", "0")
    assert settings.switch("ARBORSPEC_ORT_ROW_LAYOUT") is False
    monkeypatch.setenv("ARBORSPEC_ORT_ROW_LAYOUT", "yes")
    with pytest.raises(InputError, match="ARBORSPEC_ORT_ROW_LAYOUT must be 0 or 1, got 'yes'"):
        settings.switch("ARBORSPEC_ORT_ROW_LAYOUT")

    monkeypatch.delenv("ARBORSPEC_ORT_QDQ_ACCURACY_LEVEL", raising=False)
    assert settings.text("ARBORSPEC_ORT_QDQ_ACCURACY_LEVEL") == "0"  # the declared default
    monkeypatch.setenv("ARBORSPEC_ORT_QDQ_ACCURACY_LEVEL", "4")
    assert settings.text("ARBORSPEC_ORT_QDQ_ACCURACY_LEVEL") == "4"

    monkeypatch.setenv("ARBORSPEC_HOST_THREADS", "3")
    assert settings.whole("ARBORSPEC_HOST_THREADS") == 3
    monkeypatch.setenv("ARBORSPEC_HOST_THREADS", "-1")
    with pytest.raises(InputError, match="ARBORSPEC_HOST_THREADS must be a whole number"):
        settings.whole("ARBORSPEC_HOST_THREADS")

    monkeypatch.delenv("ARBORSPEC_RAY_START_TIMEOUT_S", raising=False)
    assert settings.number("ARBORSPEC_RAY_START_TIMEOUT_S") == 300.0
    monkeypatch.setenv("ARBORSPEC_RAY_START_TIMEOUT_S", "2.5")
    assert settings.number("ARBORSPEC_RAY_START_TIMEOUT_S") == 2.5
    monkeypatch.setenv("ARBORSPEC_RAY_START_TIMEOUT_S", "soon")
    with pytest.raises(InputError, match="ARBORSPEC_RAY_START_TIMEOUT_S must be a number"):
        settings.number("ARBORSPEC_RAY_START_TIMEOUT_S")

    monkeypatch.delenv("ARBORSPEC_SEED", raising=False)
    assert settings.integer("ARBORSPEC_SEED") == 0
    monkeypatch.setenv("ARBORSPEC_SEED", "x")
    with pytest.raises(InputError, match="ARBORSPEC_SEED must be an integer"):
        settings.integer("ARBORSPEC_SEED")

    monkeypatch.setenv("ARBORSPEC_GRAPH", "draft")
    assert settings.text("ARBORSPEC_GRAPH") == "draft"
    monkeypatch.setenv("ARBORSPEC_GRAPH", "both")
    with pytest.raises(InputError, match="ARBORSPEC_GRAPH must be target or draft"):
        settings.text("ARBORSPEC_GRAPH")

    monkeypatch.delenv("ARBORSPEC_DEBUG", raising=False)
    assert settings.flag("ARBORSPEC_DEBUG") is False
    monkeypatch.setenv("ARBORSPEC_DEBUG", "1")
    assert settings.flag("ARBORSPEC_DEBUG") is True

    monkeypatch.delenv("ARBORSPEC_CACHE", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert settings.path("ARBORSPEC_CACHE") == Path("/home/someone/.cache/arborspec")
    monkeypatch.setenv("ARBORSPEC_CACHE", "/tmp/c")
    assert settings.path("ARBORSPEC_CACHE") == Path("/tmp/c")


def test_undeclared_names_and_wrong_kinds_are_refused():
    with pytest.raises(KeyError, match="ARBORSPEC_NOPE is not declared"):
        settings.raw("ARBORSPEC_NOPE")
    with pytest.raises(TypeError, match="ARBORSPEC_CACHE"):
        settings.switch("ARBORSPEC_CACHE")


def test_docs_hold_the_table_the_module_prints():
    r = subprocess.run(
        [sys.executable, "-m", "arborspec.runtime.settings", "--markdown"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == settings.markdown()
    page = (ROOT / "docs" / "settings.md").read_text()
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    assert begin in page and end in page
    held = page.split(begin, 1)[1].split(end, 1)[0]
    assert held == settings.markdown(), (
        "docs/settings.md is out of date: paste `python -m arborspec.runtime.settings --markdown` "
        "between its settings markers"
    )
    for s in settings.SETTINGS.values():
        assert f"`{s.name}`" in held
    bad = subprocess.run([sys.executable, "-m", "arborspec.runtime.settings", "--table"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage:" in bad.stderr and not bad.stdout
