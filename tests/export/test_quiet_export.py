"""Exports are quiet: ONNX Runtime's MatMulNBits quantiser (the int8/int4 EAGLE-3 head of `make
demo`, `--quantize` of float weights) calls `logging.basicConfig(level=INFO)` when imported and logs
two INFO lines per MatMul; `export/quantize.py` must leave nothing of that on the console and the
root logger as it found it. Run in a fresh interpreter: the basicConfig happens at the first import."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("onnxruntime.quantization")

SCRIPT = """
import logging
import numpy as np
from onnx import TensorProto, helper, numpy_helper
w = numpy_helper.from_array(np.random.default_rng(0).random((64, 64), dtype=np.float32), "W")
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y], [w])
from arborspec.export.quantize import quantize_float_model
q = quantize_float_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), bits=8)
assert any(n.op_type == "MatMulNBits" for n in q.graph.node), [n.op_type for n in q.graph.node]
root = logging.getLogger()
print(len(root.handlers), logging.getLevelName(root.level))
"""


def test_float_quantisation_prints_nothing_and_leaves_the_root_logger_alone():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr  # before the fix: "... matmul_nbits_quantizer [INFO] - start to quantize mm ..."
    assert r.stdout.split() == ["0", "WARNING"]  # no handler added, root level untouched
