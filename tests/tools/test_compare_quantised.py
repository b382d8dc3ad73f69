"""`arborspec compare` on a quantised export: logits against the fp32 PyTorch reference on the
original weights, judged by top-1 agreement and relative logit error with the stated quantised
tolerances (tools/compare/comparison.py QUANT_TOLERANCES); exit 1 outside them, 2 for a bad request."""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("polygraphy")

from conftest import random_model, tiny_config  # noqa: E402
from test_compare import save_hf_llama  # noqa: E402

from arborspec.export.export_folder import export_folder  # noqa: E402
from arborspec.tools.commands.cli import main  # noqa: E402
from arborspec.tools.compare.comparison import QUANT_TOLERANCES  # noqa: E402


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmpq")
    src = save_hf_llama(random_model(tiny_config("llama", max_position=256)), d / "src")
    export_folder(
        str(src),
        d / "q",
        draft="layers:1",
        progress=False,
        quantize="int8",
        qformat="qdq",
        max_tree_nodes=16,
        max_context=128,
    )
    return d / "q"


def test_compare_quantised_export_states_and_applies_its_tolerances(int8_export, capsys):
    rc = main(["compare", "--export-dir", str(int8_export), "--runners", "torch,onnxruntime", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    top1, rel = QUANT_TOLERANCES["int8"]
    assert f"top-1 agreement >= {top1:.0%}" in out and f"<= {rel:g}" in out
    assert "PASSED: 2/2 graphs" in out and "int8 weights (qdq, rtn-symmetric)" in out
    rows = [ln for ln in out.splitlines() if " all feeds " in ln and "vs torch" in ln]
    assert len(rows) == 2 and all(ln.rstrip().endswith("pass") for ln in rows)

    # a tolerance the rounding cannot meet: exit 1, the failing graphs named
    rc = main(
        [
            "compare",
            "--export-dir",
            str(int8_export),
            "--runners",
            "torch,onnxruntime",
            "--no-progress",
            "--max-logit-rel",
            "1e-6",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED: 0/2 graphs" in out and "target (onnxruntime vs torch)" in out

    for argv, msg in [
        (["--runners", "onnxruntime,tensorrt"], "include torch"),
        (["--runners", "torch,onnxruntime", "--min-top1", "1.5"], "--min-top1"),
    ]:
        assert main(["compare", "--export-dir", str(int8_export), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
