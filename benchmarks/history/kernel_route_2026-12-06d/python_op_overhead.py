"""Per-node cost of an onnxruntime-extensions Python custom op (the only way to run a kernel of our
own inside ONNX Runtime without its C API headers) against a stock Relu node, 100-node chains."""

import sys

sys.path.insert(0, "/tmp/ortx/site")  # the onnxruntime-extensions 0.15.2 wheel, unpacked
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op


@onnx_op(op_type="MyIdent", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
def my_ident(x):
    return x


def chain(n, op, dom):
    nodes = [helper.make_node(op, [f"x{i}"], [f"x{i + 1}"], domain=dom) for i in range(n)]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x0", TP.FLOAT, ["M", 576])],
        [helper.make_tensor_value_info(f"x{n}", TP.FLOAT, ["M", 576])],
    )
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)]
    ).SerializeToString()


so = ort.SessionOptions()
so.intra_op_num_threads = 2
so.register_custom_ops_library(get_library_path())
for name, m in (("py", chain(100, "MyIdent", "ai.onnx.contrib")), ("Identity", chain(100, "Relu", ""))):
    s = ort.InferenceSession(m, so, providers=["CPUExecutionProvider"])
    A = np.random.randn(2, 576).astype(np.float32)
    for _ in range(20):
        s.run(None, {"x0": A})
    ts = []
    for _ in range(100):
        t0 = time.perf_counter()
        s.run(None, {"x0": A})
        ts.append(time.perf_counter() - t0)
    print(name, "per node us", statistics.median(ts) * 1e6 / 100)
