"""One MatMulNBits node (block 32, accuracy level 4, weights hot in cache) timed at M = 1..16 rows:
the per-row compute of ONNX Runtime's int8 path at SmolLM2-135M's (default) or the 1B shape's (arg 1b) layers."""

import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper


def model(K, N, bits=4, blk=32, acc=4, zp=False):
    nb = K // blk
    B = np.random.randint(0, 255, (N, nb, blk * bits // 8), dtype=np.uint8)
    S = np.random.rand(N * nb).astype(np.float32) * 0.01
    inits = [
        helper.make_tensor("B", TP.UINT8, B.shape, B.tobytes(), raw=True),
        helper.make_tensor("S", TP.FLOAT, S.shape, S.tobytes(), raw=True),
    ]
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "S"],
        ["Y"],
        domain="com.microsoft",
        K=K,
        N=N,
        bits=bits,
        block_size=blk,
        accuracy_level=acc,
    )
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TP.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("Y", TP.FLOAT, ["M", N])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()


so = ort.SessionOptions()
so.intra_op_num_threads = 2
shapes = [(576, 960, 4), (576, 576, 4), (576, 3072, 4), (1536, 576, 4), (576, 49152, 8)]
if len(sys.argv) > 1 and sys.argv[1] == "1b":
    shapes = [(2048, 3072, 4), (2048, 2048, 4), (2048, 16384, 4), (8192, 2048, 4), (2048, 49152, 8)]
for K, N, bits in shapes:
    s = ort.InferenceSession(model(K, N, bits), so, providers=["CPUExecutionProvider"])
    res = {}
    for M in (1, 2, 3, 4, 8, 16):
        A = np.random.randn(M, K).astype(np.float32)
        for _ in range(20):
            s.run(None, {"A": A})
        ts = []
        for _ in range(200):
            t0 = time.perf_counter()
            s.run(None, {"A": A})
            ts.append(time.perf_counter() - t0)
        res[M] = statistics.median(ts) * 1e6
    print(
        f"K{K} N{N} b{bits}: " + " ".join(f"M{m}={v:.0f}us" for m, v in res.items()),
        " ratio M2/M1 %.2f M4/M1 %.2f M8/M1 %.2f" % (res[2] / res[1], res[4] / res[1], res[8] / res[1]),
    )
