"""Every entry point reaches its decoder through the one resolver (runtime/decoder_config.
resolve_config): with no tree named, generate, chat, bench, serve's Generator.from_export and a
Generator all decode with the same tree: the export's default, then the tree `tune` wrote (the
file runtime/tuned_tree.py names); `--tree auto` without that file is one line naming `tune`."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from conftest import tiny_text_export

from arborspec.runtime.generator import Generator
from arborspec.tools.commands.cli import main

GEN = ["--prompt-ids", "5,6,7,8", "--max-new-tokens", "4", "--json"]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    e = tiny_text_export(tmp_path_factory.mktemp("resolve") / "e", seed=3)
    man = json.loads((e / "manifest.json").read_text())
    man["tree_defaults"] = {"mode": "tree", "tree": "full:2,1"}  # the export's own default, not DEFAULT_TREE
    (e / "manifest.json").write_text(json.dumps(man))
    return e


def _trees(e, capsys, monkeypatch) -> dict:
    """The tree each entry point decodes with when none is named."""
    from arborspec.tools.commands import bench
    from arborspec.tools.engines import open_models

    capsys.readouterr()
    assert main(["generate", "--export-dir", str(e), *GEN]) == 0
    got = {"generate": json.loads(capsys.readouterr().out)["stats"]["tree"]}
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--export-dir", str(e), "--max-new-tokens", "2"]) == 0
    banner = capsys.readouterr().err.splitlines()[0]
    got["chat"] = banner.split(": tree ")[1].split(", prefix cache")[0]
    with Generator.from_export(e) as g:  # what `serve` builds
        got["from_export"] = g.tree_spec()
    args = SimpleNamespace(
        model=None,
        draft=None,
        backend=None,
        device="cpu",
        export_dir=e,
        temperature=0.0,
        chain="chain:4",
        governed=False,
    )
    plan = SimpleNamespace(
        trees=[], mix_trees=[], lookup_trees=[], suffix_trees=([], []), modes=["tree"], baselines=[], candidates=[None]
    )
    with open_models(args) as models:
        got["bench"] = next(c.tree for c in bench._configs(args, plan, models) if c.mode == "tree")
    return got


def test_every_entry_point_resolves_the_same_tree(export_dir, capsys, monkeypatch):
    trees = _trees(export_dir, capsys, monkeypatch)
    assert set(trees.values()) == {"full:2,1"}, trees  # the export's default
    tuned = export_dir / "tree_auto.json"  # as `tune` writes it (runtime/tuned_tree.ModelsKey.path)
    tuned.write_text(json.dumps({"format": 1, "paths": [[0], [1]], "backend": "onnxruntime"}))
    try:
        trees = _trees(export_dir, capsys, monkeypatch)
        assert all(str(t).endswith("tree_auto.json") for t in trees.values()), trees
    finally:
        tuned.unlink()


def test_auto_without_a_tuned_tree_is_one_line(export_dir, capsys):
    from arborspec.runtime.errors import MissingFileError

    capsys.readouterr()
    assert main(["generate", "--export-dir", str(export_dir), "--tree", "auto", *GEN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"run `arborspec tune --export-dir {export_dir}` first" in err
    with pytest.raises(MissingFileError, match="arborspec tune --export-dir"):
        Generator.from_export(export_dir, tree="auto")
