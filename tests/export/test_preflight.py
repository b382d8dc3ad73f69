"""The memory pre-flights (export/preflight.py): the portable export from a loaded model and
`arborspec build` refuse, in one `arborspec: error:` line naming what they need and what is
available, before any work, and write nothing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from arborspec.export import preflight  # noqa: E402

ENV = {"ARBORSPEC_EXPORT_MEMORY_GB": "0.01", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}


def cli(*args, env=ENV):
    return subprocess.run(
        [sys.executable, "-m", "arborspec.tools.commands.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def one_error_line(p) -> str:
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("arborspec: error:"), p.stderr
    assert "needs about" in lines[0] and "GB is available" in lines[0] and "ARBORSPEC_EXPORT_MEMORY_GB" in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from test_stream_export import hf_folder

    return hf_folder(tmp_path_factory.mktemp("hf") / "llama")


@pytest.mark.parametrize("stream", ["off", "auto"])
def test_portable_export_refuses_in_one_line(folder, tmp_path, stream):
    p = cli("export", "--model", str(folder), "--draft", "none", "--attention", "onnx", "--dtype", "fp16",
            "--stream", stream, "--out", str(tmp_path / "x"))  # fmt: skip
    line = one_error_line(p)
    assert "exporting" in line
    assert not (tmp_path / "x").exists()


def sbhd_graph(folder, mb: int = 8):
    """A valid ONNX with an 8 MB initialiser and the portable graph's metadata (what build reads first)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper

    w = numpy_helper.from_array(np.zeros((mb * 1024 * 256,), np.float32), "w")
    g = h.make_graph([h.make_node("Add", ["x", "w"], ["y"])], "g", [h.make_tensor_value_info("x", TP.FLOAT, [mb * 1024 * 256])],
                     [h.make_tensor_value_info("y", TP.FLOAT, [mb * 1024 * 256])], [w])  # fmt: skip
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    onnx.helper.set_model_props(m, {"arborspec.kv_layout": "sbhd"})
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(folder / "target.onnx"))
    return folder


def test_build_refuses_in_one_line_before_tensorrt(tmp_path):
    d = sbhd_graph(tmp_path / "e")
    p = cli("build", "--export-dir", str(d), "--compute-capability", "8.9", "--max-context", "64", "--out", str(tmp_path / "eng"))
    line = one_error_line(p)
    assert "building the engine" in line and "target.onnx" in line
    assert not (tmp_path / "eng").exists()


def test_build_estimate_follows_the_onnx_weights(tmp_path, monkeypatch):
    small = preflight.build_bytes(sbhd_graph(tmp_path / "s", 1) / "target.onnx")
    big = preflight.build_bytes(sbhd_graph(tmp_path / "b", 9) / "target.onnx")
    assert big - small == pytest.approx(preflight.BUILD_FACTOR * 8 * 2**20, rel=0.01)
    monkeypatch.setenv("ARBORSPEC_EXPORT_MEMORY_GB", str((small + big) / 2 / 2**30))
    preflight.check_build([tmp_path / "s" / "target.onnx"], "s")  # fits: no error
    with pytest.raises(Exception, match="needs about"):
        preflight.check_build([tmp_path / "s" / "target.onnx", tmp_path / "b" / "target.onnx"], "b")
