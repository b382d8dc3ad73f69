"""One dummy attention row inside the GroupQueryAttention graph, so that a one-token call is
row-invariant without running the whole model on two rows.

Role in one decode step: none at run time; it shapes the target graph the ONNX Runtime engine
runs. Why: ONNX Runtime's CPU GroupQueryAttention multiplies the probabilities with V by a
one-row kernel when a call carries one token and by the general kernel otherwise, so a vanilla
step's logits differ in the last bits from the same token inside a verify call; with int8
activations (MatMulNBits at accuracy level 4) those bits become whole logits. The engine's
row-invariant layout (runtime/backends/row_layout.py) therefore runs every one-token call as two
rows, paying a second row in every MatMulNBits of the model. Here only the attention sees the
second row: before each GroupQueryAttention the call's last row of packed q/k/v is repeated
once, after it the extra output row is dropped. Every other node runs on the caller's rows.

The dummy row sits one column past the call (its K/V land at seqlens_k + 1, past what the
caller commits: the cache needs one spare column, `CacheSpec.spare`), sees what the last row
sees and itself, and no real row sees it (one masked column: its exp is exactly 0 and adds
nothing). Calls of two rows or more are left as they are (they take the general kernel already;
a dummy row there would cost an attention row for nothing). A one-token call's logits and K/V
equal those of the engine-padded call bit for bit (tests/export/test_row_pad.py). The graph says so in its metadata (`arborspec.pad_row` = "1");
the engine then skips its own one-row padding and runs a batch of rows one row per call.
"""

from __future__ import annotations

import numpy as np

from arborspec.runtime import contract as C

_BIG = 2**62


def pad_rows(nodes: list, init) -> list:
    """The GroupQueryAttention graph's nodes (GQAGraph.nodes) with one dummy attention row in every
    one-token call (r = 1 when T == 1, else 0: a call of more rows already takes the general
    kernel); `init(name, array)` adds an initialiser. Sliding-window graphs are not padded (their
    window bias is built from the unpadded positions): callers check `pads_rows_for`."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    for name, v in (("pad_c0", 0), ("pad_c1", 1), ("pad_c2", 2), ("pad_cm1", -1), ("pad_big", _BIG)):
        init(name, np.array([v], np.int64))
    sl = lambda x, a, b, axis, out: h.make_node("Slice", [x, a, b, axis], [out])  # noqa: E731
    pre = [
        # r = 1 for a one-token call, else 0; the call's T and T - r
        h.make_node("Shape", [C.INPUT_IDS], ["pad_ids_shape"]),
        h.make_node("Gather", ["pad_ids_shape", "pad_c1"], ["pad_t"], axis=0),  # [1]
        h.make_node("Equal", ["pad_t", "pad_c1"], ["pad_is_one"]),
        h.make_node("Cast", ["pad_is_one"], ["pad_r"], to=TP.INT64),
        h.make_node("Sub", ["pad_t", "pad_r"], ["pad_t_minus_r"]),
        h.make_node("Cast", ["pad_r"], ["pad_r32_1"], to=TP.INT32),
        h.make_node("Squeeze", ["pad_r32_1", "pad_c0"], ["pad_r32"]),  # scalar int32
        # the rows every attention reads: 0 .. T-1, then the last one again when r = 1
        h.make_node("Squeeze", ["pad_t", "pad_c0"], ["pad_t_s"]),
        h.make_node("Squeeze", ["pad_c0", "pad_c0"], ["pad_c0_s"]),
        h.make_node("Squeeze", ["pad_c1", "pad_c0"], ["pad_c1_s"]),
        h.make_node("Range", ["pad_c0_s", "pad_t_s", "pad_c1_s"], ["pad_rows_t"]),
        sl("pad_rows_t", "pad_t_minus_r", "pad_t", "pad_c0", "pad_rows_r"),
        h.make_node("Concat", ["pad_rows_t", "pad_rows_r"], ["pad_rows"], axis=0),  # [T + r]
        # the mask [B, T, S] -> [B, T + r, S + r]: real rows gain r masked columns; the dummy row
        # sees what the last row sees, and itself
        sl(C.ATTENTION_MASK, "pad_c0", "pad_c1", "pad_c2", "pad_col0"),  # [B, T, 1]
        h.make_node("Not", ["pad_col0"], ["pad_not_col0"]),
        h.make_node("And", ["pad_col0", "pad_not_col0"], ["pad_false"]),  # False [B, T, 1]
        sl("pad_false", "pad_c0", "pad_r", "pad_c2", "pad_false_r"),  # [B, T, r]
        h.make_node("Concat", [C.ATTENTION_MASK, "pad_false_r"], ["pad_mask_cols"], axis=2),
        sl(C.ATTENTION_MASK, "pad_cm1", "pad_big", "pad_c1", "pad_last_row"),  # [B, 1, S]
        sl("pad_false", "pad_cm1", "pad_big", "pad_c1", "pad_false_1"),  # [B, 1, 1]
        h.make_node("Not", ["pad_false_1"], ["pad_true_1"]),
        sl("pad_true_1", "pad_c0", "pad_r", "pad_c2", "pad_true_r"),  # [B, 1, r]
        h.make_node("Concat", ["pad_last_row", "pad_true_r"], ["pad_dummy_row"], axis=2),  # [B, 1, S + r]
        sl("pad_dummy_row", "pad_c0", "pad_r", "pad_c1", "pad_dummy_rows"),  # [B, r, S + r]
        h.make_node("Concat", ["pad_mask_cols", "pad_dummy_rows"], ["pad_mask"], axis=1),
        # the dummy row at the last row's position (inside the rotary tables)
        sl(C.POSITION_IDS, "pad_t_minus_r", "pad_t", "pad_c1", "pad_last_pos"),  # [B, r]
        h.make_node("Concat", [C.POSITION_IDS, "pad_last_pos"], ["pad_positions"], axis=1),
    ]
    out: list = []
    for n in nodes:
        if n.op_type == "Unsqueeze" and n.input[0] == C.ATTENTION_MASK:  # the tree mask's bias
            n.input[0] = "pad_mask"
        if n.op_type == "Cast" and n.output[0] == "seqlens_k":
            out += [n, h.make_node("Add", ["seqlens_k", "pad_r32"], ["pad_seqlens_k"])]
            continue
        if n.op_type == "Squeeze" and n.output[0] == "total_len":
            out += [n, h.make_node("Add", ["total_len", "pad_r32"], ["pad_total_len"])]
            continue
        if n.op_type != "GroupQueryAttention":
            out.append(n)
            continue
        qkv, attn = n.input[0], n.output[0]
        out.append(h.make_node("Gather", [qkv, "pad_rows"], [qkv + "_padded"], axis=1))  # [B, T + r, C]
        n.input[0], n.input[5], n.input[6], n.input[9] = qkv + "_padded", "pad_seqlens_k", "pad_total_len", "pad_positions"
        n.output[0] = attn + "_padded"
        out.append(n)
        out.append(sl(attn + "_padded", "pad_c0", "pad_t", "pad_c1", attn))  # the caller's T rows
    return pre + out


def pads_rows_for(cfg, accuracy_level: int, dtype: str) -> bool:
    """Whether an export gets the dummy attention row: where the engine lays calls out
    row-invariantly by default (int8 activations: MatMulNBits accuracy level 4, an fp32 graph for
    the CPU), for models without sliding-window layers."""
    return accuracy_level == 4 and dtype == "fp32" and not getattr(cfg, "sliding_window", 0)
