"""The portable decoder graph (`--attention onnx`, kv layout "sbhd", what `arborspec build` turns
into TensorRT engines), written a layer at a time from a weights source (export/weights.py).

Role in one decode step: none at run time; it writes the graph every TensorRT (or ONNX Runtime)
call of a step runs when the export is portable: the target's verify over root + tree, draft
levels, prefills. It is the graph torch.onnx.export makes of models/llama.LlamaDecoder, built
without loading the model: standard ONNX ops only (opset 23: RMSNormalization, MatMul, Softmax;
no contrib op), so TensorRT's parser takes it. Per layer:

* q/k/v MatMuls, reshaped to heads; Qwen3's RMSNorm over each head of q and k;
* RoPE from cos/sin tables [max_context, R] gathered by `position_ids` (the numbers
  models/rope.Rotary computes, scaling included; siblings of a tree share a position);
* the new K/V out in the cache layout [T, B, Hkv, D]; the past [P, B, Hkv, D] transposed and
  concatenated before them, repeated to the query heads (grouped-query attention);
* scores in the weights' dtype, then scaled, biased by the tree mask (0 / float32 min: a fully
  masked row stays finite) and soft-maxed in float32, as models/llama.attend does;
* the residual adds and RMSNorms, the MLP and the head are GQAGraph's (export/gqa_graph.py),
  with plain Add + RMSNormalization where that graph fuses them into a contrib op.

fp32, fp16 and bf16 weights and activations (logits and features float32). Llama-family models
without a sliding window; others (Gemma 3, GPT-2, a sliding window) export from a loaded module.
"""

from __future__ import annotations

import numpy as np

from arborspec.runtime import contract as C

from .gqa_graph import GQAGraph, GraphOptions, _rotaries

PORTABLE_DTYPES = ("fp32", "fp16", "bf16")


def portable_unsupported(cfg) -> str | None:
    """Why the portable graph cannot be written a layer at a time for this model, or None."""
    if cfg.family != "llama":
        return f"the streamed portable graph is written for Llama-family models, not {cfg.family}"
    if cfg.sliding_window > 0:
        return "the streamed portable graph has no sliding window"
    return None


def np_dtype(dtype: str):
    if dtype == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16 if dtype == "fp16" else np.float32)


class PortableGraph(GQAGraph):
    """GQAGraph's layers with standard-ONNX attention over the "sbhd" cache (see the module)."""

    KIND = "portable"

    def __init__(self, weights, opts: GraphOptions, sink=None, progress: bool = False, qdq=None):
        from onnx import TensorProto as TP

        super().__init__(weights, opts, None, sink, progress)
        self.qdq = qdq  # hf_name -> export/qdq.QDQ | None: blockwise DequantizeLinear weights (--format qdq)
        self.qdq_counts: dict[str, dict] = {"layers_by_source": {}, "layers_by_type": {}}
        elem = {"fp32": TP.FLOAT, "fp16": TP.FLOAT16, "bf16": TP.BFLOAT16}[opts.dtype]
        self.half = opts.dtype != "fp32"  # logits and features are cast to float32
        self.act_np = self.attn_np = np_dtype(opts.dtype)
        self.act_elem = self.kv_elem = elem
        self.consts: set[str] = set()

    def const(self, name: str, values) -> str:
        """A shared int64 constant, written once."""
        if name not in self.consts:
            self.consts.add(name)
            self.init(name, np.array(values, np.int64))
        return name

    def opset_imports(self) -> list:
        from onnx import helper as h

        from .gqa_graph import OPSET

        return [h.make_opsetid("", OPSET)]

    def cache_dims(self, nkv: int, d: int, new: bool) -> list:
        """The contract's sequence-major cache: the past prefix in, only the new tokens' K/V out."""
        return ["tokens" if new else "past", "batch", nkv, d]

    def attention_shared(self):
        """(cos, sin) [B, 1, T, R] in the weights' dtype and the tree mask's bias [B, 1, T, S] float32."""

        cfg = self.cfg
        rotary, _ = _rotaries(self.w)
        import torch

        cos, sin = rotary(torch.arange(max(self.o.max_context, 1))[None])  # [1, M, R] float32
        self.rot = int(cos.shape[-1])
        self.init("c_axes1", np.array([1], np.int64))
        self.init("c_zero_f", np.array(0.0, np.float32))
        self.init("c_min_f", np.array(np.finfo(np.float32).min, np.float32))
        self.init("c_scale", np.array(float(cfg.head_dim) ** -0.5, np.float32))
        self.init("c_i0", np.array([0], np.int64))
        self.init("c_half", np.array([self.rot // 2], np.int64))
        self.init("c_rot", np.array([self.rot], np.int64))
        self.init("c_rep", np.array([1, 1, cfg.n_heads // cfg.n_kv_heads, 1, 1], np.int64))
        self.init("c_axes2", np.array([2], np.int64))
        tables = []
        for name, t in (("cos", cos), ("sin", sin)):
            table = self.init(f"{name}_table", t[0].numpy().astype(np.float32))
            rows = self.node("Gather", [table, C.POSITION_IDS], [f"{name}_rows"], axis=0)  # [B, T, R]
            rows4 = self.node("Unsqueeze", [rows, "c_axes1"], [f"{name}_rows4"])
            tables.append(self.node("Cast", [rows4], [f"{name}_act"], to=self.act_elem) if self.half else rows4)
        mask4 = self.node("Unsqueeze", [C.ATTENTION_MASK, "c_axes1"], ["mask4"])
        bias = self.node("Where", [mask4, "c_zero_f", "c_min_f"], ["attn_bias"])
        return tables[0], tables[1], bias

    def skip_norm(self, x: str, residual: str, hf_norm: str, out: str) -> tuple[str, str]:
        """(RMSNorm(x + residual), x + residual) in standard ops."""
        res = self.node("Add", [residual, x], [out + "_res"])
        return self.rms(res, hf_norm, out + "ed"), res

    def matmul(self, x: str, hf_names: list[str], name: str) -> str:
        """x @ W^T: through DequantizeLinear of the layers' blocks (concatenated along N) where
        `qdq` gives them, else GQAGraph's float MatMul."""
        parts = [self.qdq(n) for n in hf_names] if self.qdq is not None else [None]
        if any(q is None for q in parts) or len({(q.bits, q.block, q.offsets is None) for q in parts}) != 1:
            return super().matmul(x, hf_names, name)
        for q in parts:
            for key, value in (("layers_by_source", q.source), ("layers_by_type", f"int{q.bits}")):
                self.qdq_counts[key][value] = self.qdq_counts[key].get(value, 0) + 1
        q0 = parts[0]
        q_kn = np.ascontiguousarray(np.concatenate([q.q for q in parts]).T)
        scales = np.concatenate([q.scales for q in parts]).T.astype(self.act_np)
        if q0.bits == 4:
            from .qdq import _int4_tensor

            self.sink.add_proto(_int4_tensor(name + ".q", q_kn))
        else:
            self.init(name + ".q", q_kn.astype(np.int8))
        deq = [name + ".q", self.init(name + ".scale", np.ascontiguousarray(scales))]
        w = self.node("DequantizeLinear", deq, [name + ".w"], axis=0, block_size=q0.block)
        y = self.node("MatMul", [x, w], [name + "_out" if q0.offsets is None else name + "_main"])
        if q0.offsets is None:
            return y
        # per-block offsets (GGUF Q4_1): + (block sums of x) @ C, C [K/block, N]
        offsets = np.concatenate([q.offsets for q in parts]).T.astype(self.act_np)
        shape = self.const(f"c_blocks{q0.k // q0.block}", [0, 0, q0.k // q0.block, q0.block])
        sums = self.node(
            "ReduceSum", [self.node("Reshape", [x, shape], [name + "_xb"]), "c_axes_m1"], [name + "_xsum"], keepdims=0
        )
        corr = self.node("MatMul", [sums, self.init(name + ".offset", np.ascontiguousarray(offsets))], [name + "_corr"])
        return self.node("Add", [y, corr], [name + "_out"])

    def head(self, normed: str) -> str:
        """An untied head with blocks goes through DequantizeLinear + MatMul; else GQAGraph's Gemm."""
        if self.qdq is not None and not self.cfg.tie_embeddings and self.qdq("lm_head.weight") is not None:
            return self.matmul(normed, ["lm_head.weight"], "lm_head")
        return super().head(normed)

    def projection(self, x: str, hf: str, name: str) -> str:
        y = self.matmul(x, [hf + ".weight"], name)
        if self.cfg.attention_bias:
            y = self.node("Add", [y, self.weight(name + "_b", self.w.get(hf + ".bias"))], [name + "_biased"])
        return y

    def heads(self, x: str, n: int, name: str, norm: str | None = None) -> str:
        """[B, T, n*D] -> [B, n, T, D] (after Qwen3's per-head RMSNorm `norm`, when given)."""
        shape = self.const(f"c_heads{n}", [0, 0, n, self.cfg.head_dim])
        x = self.node("Reshape", [x, shape], [f"{name}_4d"])
        if norm is not None:
            x = self.rms(x, norm, f"{name}_normed")
        return self.node("Transpose", [x], [f"{name}_heads"], perm=[0, 2, 1, 3])

    def rope(self, x: str, cos: str, sin: str, name: str) -> str:
        """x * cos + rotate_half(x) * sin over the first R channels (models/llama.apply_rope)."""
        rot, keep = x, None
        if self.rot != self.cfg.head_dim:
            rot = self.node("Slice", [x, "c_i0", "c_rot", "c_axes_m1"], [name + "_rot"])
            keep = self.node(
                "Slice", [x, "c_rot", self.const("c_dim", [self.cfg.head_dim]), "c_axes_m1"], [name + "_keep"]
            )
        lo = self.node("Slice", [rot, "c_i0", "c_half", "c_axes_m1"], [name + "_lo"])
        hi = self.node("Slice", [rot, "c_half", "c_rot", "c_axes_m1"], [name + "_hi"])
        half = self.node("Concat", [self.node("Neg", [hi], [name + "_neg"]), lo], [name + "_rh"], axis=-1)
        a = self.node("Mul", [rot, cos], [name + "_cos"])
        b = self.node("Mul", [half, sin], [name + "_sin"])
        out = self.node("Add", [a, b], [name + "_roped"])
        return out if keep is None else self.node("Concat", [out, keep], [name + "_roped_all"], axis=-1)

    def with_past(self, new: str, past: str, name: str) -> str:
        """The past [P, B, Hkv, D] and the new [B, Hkv, T, D] -> [B, H, P+T, D] (repeated to the query heads)."""
        cfg = self.cfg
        past_t = self.node("Transpose", [past], [name + "_past"], perm=[1, 2, 0, 3])
        both = self.node("Concat", [past_t, new], [name + "_all"], axis=2)
        if cfg.n_heads == cfg.n_kv_heads:
            return both
        x5 = self.node("Unsqueeze", [both, "c_axes2"], [name + "_5d"])
        rep = self.node("Expand", [x5, "c_rep"], [name + "_rep"])
        shape = self.const("c_heads_shape", [0, cfg.n_heads, -1, cfg.head_dim])
        return self.node("Reshape", [rep, shape], [name + "_all_heads"])

    def attention(self, i: int, normed: str, cos: str, sin: str, bias: str) -> str:
        """Layer i's attention output [B, T, H*D] (before o_proj); writes new_key.i / new_value.i."""
        from onnx import TensorProto as TP

        cfg, p, n = self.cfg, f"model.layers.{i}.self_attn.", f"l{i}."
        qn, kn = (p + "q_norm.weight", p + "k_norm.weight") if cfg.qk_norm else (None, None)
        q = self.heads(self.projection(normed, p + "q_proj", n + "q"), cfg.n_heads, n + "q", qn)
        k = self.heads(self.projection(normed, p + "k_proj", n + "k"), cfg.n_kv_heads, n + "k", kn)
        v = self.heads(self.projection(normed, p + "v_proj", n + "v"), cfg.n_kv_heads, n + "v")
        q, k = self.rope(q, cos, sin, n + "q"), self.rope(k, cos, sin, n + "k")
        self.node("Transpose", [k], [C.new_key(i)], perm=[2, 0, 1, 3])
        self.node("Transpose", [v], [C.new_value(i)], perm=[2, 0, 1, 3])
        k_all = self.with_past(k, C.past_key(i), n + "k")
        v_all = self.with_past(v, C.past_value(i), n + "v")
        kt = self.node("Transpose", [k_all], [n + "kt"], perm=[0, 1, 3, 2])
        scores = self.node("MatMul", [q, kt], [n + "scores"])
        if self.half:
            scores = self.node("Cast", [scores], [n + "scores_f32"], to=TP.FLOAT)
        scaled = self.node("Mul", [scores, "c_scale"], [n + "scaled"])
        probs = self.node("Softmax", [self.node("Add", [scaled, bias], [n + "biased"])], [n + "probs"], axis=-1)
        if self.half:
            probs = self.node("Cast", [probs], [n + "probs_act"], to=self.act_elem)
        y = self.node("Transpose", [self.node("MatMul", [probs, v_all], [n + "ctx"])], [n + "ctx_t"], perm=[0, 2, 1, 3])
        shape = self.const("c_ctx_shape", [0, 0, cfg.n_heads * cfg.head_dim])
        return self.node("Reshape", [y, shape], [n + "attn"])


def build_portable_model(weights, opts: GraphOptions, sink=None, progress: bool = False, qdq=None):
    """(the onnx.ModelProto of the portable graph of `weights`, initialisers in `sink`; the
    quantised layers' counts)."""
    graph = PortableGraph(weights, opts, sink, progress, qdq)
    return graph.build(), graph.qdq_counts
