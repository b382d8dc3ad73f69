"""What one MatMulNBits node costs by zero-point kind and accuracy level (ONNX Runtime CPU).

Role in one decode step: none; it prices the int4 linear layers of step 3 (the verify call).
GGUF Q4_1 blocks are w = d*q + m: exact as MatMulNBits needs either float zero points (m / d)
or integer zero points plus a separate offset term (export/gqa_graph.py); this measures why the
export takes the second: float zero points leave the fast kernels.

    python -m arborspec.tools.bench.nbits_kernels --k 576 --n 1536 --reps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def matmul_nbits_session(
    blob, scales, zero_points, k: int, n: int, accuracy_level: int, threads: int = 1, bits: int = 4
):
    """An ONNX Runtime session of one MatMulNBits node (x [..., K] -> y [..., N]) over the given
    blocks: blob [N, K/32, 32*bits/8] uint8, scales [N*K/32] float32, zero points (None, packed
    uint8, or float32)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh

    inits = [nh.from_array(np.asarray(blob, np.uint8), "blob"), nh.from_array(np.asarray(scales, np.float32), "scales")]
    ins = ["x", "blob", "scales"]
    if zero_points is not None:
        inits.append(nh.from_array(zero_points, "zp"))
        ins.append("zp")
    node = h.make_node(
        "MatMulNBits",
        ins,
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=32,
        accuracy_level=accuracy_level,
    )
    graph = h.make_graph(
        [node],
        "nbits",
        [h.make_tensor_value_info("x", TP.FLOAT, None)],
        [h.make_tensor_value_info("y", TP.FLOAT, None)],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def session(k: int, n: int, zero_points: str, accuracy_level: int, threads: int):
    """Random blocks of a K x N layer with `zero_points` none | uint8 | float."""
    import numpy as np

    rng = np.random.default_rng(0)
    nb = k // 32
    blob = rng.integers(0, 255, (n, nb, 16), dtype=np.uint8)
    scales = rng.random(n * nb).astype(np.float32) * 0.01
    zp = None
    if zero_points == "uint8":
        zp = np.full(n * ((nb + 1) // 2), 0x88, np.uint8)
    elif zero_points == "float":
        zp = rng.random(n * nb).astype(np.float32) * 15
    return matmul_nbits_session(blob, scales, zp, k, n, accuracy_level, threads)


def measure(k: int, n: int, reps: int, threads: int, rows=(1, 2)) -> list[dict]:
    import numpy as np

    out = []
    for level in (0, 4):
        for zp in ("none", "uint8", "float"):
            s = session(k, n, zp, level, threads)
            for t in rows:
                x = np.random.default_rng(t).random((1, t, k)).astype(np.float32)
                for _ in range(10):
                    s.run(None, {"x": x})
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    s.run(None, {"x": x})
                    times.append(time.perf_counter() - t0)
                out.append(
                    {"accuracy_level": level, "zero_points": zp, "rows": t, "us": statistics.median(times) * 1e6}
                )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="nbits_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=576, help="input size (a multiple of 32)")
    ap.add_argument("--n", type=int, default=1536, help="output size")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if a.k < 32 or a.k % 32 or a.n < 1 or a.reps < 1 or a.threads < 1:
        print(
            "nbits_kernels: error: --k must be a positive multiple of 32; --n, --reps, --threads >= 1", file=sys.stderr
        )
        return 2
    rows = measure(a.k, a.n, a.reps, a.threads)
    for r in rows:
        print(f"accuracy {r['accuracy_level']}  zero points {r['zero_points']:5s}  T={r['rows']}: {r['us']:8.1f} us")
    print(json.dumps({"k": a.k, "n": a.n, "threads": a.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
