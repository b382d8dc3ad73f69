"""ONNX Runtime's fast decoder graph: Llama-family weights written straight into an ONNX graph
around com.microsoft GroupQueryAttention, with the KV cache read and written in place.

Role in one decode step: this is the graph ONNX Runtime runs for every model call of a step
(the target's verify over root + tree, each draft level, prefills), when the export was made
with `--attention gqa` (the default for Llama-family models). Compared with the portable graph
(torch.onnx.export of models/llama.py, kv layout "sbhd"), each layer here:

* reads its cache in place: `past_key.{i}` is the layer's whole preallocated slab
  [B, Hkv, S_max, D] (kv layout "bhsd") and `new_key.{i}` is bound to the SAME buffer
  (GroupQueryAttention's shared past/present buffer): the new T tokens' K/V are written at
  [P, P+T) and nothing of the past is copied (the portable graph transposes and concatenates
  the whole past of every layer, every call: O(P) per layer and step);
* applies RoPE inside the attention kernel from cos/sin tables built once, indexed by
  `position_ids` (siblings of a tree share a position);
* turns the tree mask into GroupQueryAttention's `attention_bias` (0 / float32 min: a fully
  masked row gives a uniform attention, never NaN), with `causal=0`;
* packs q/k/v into one MatMul and fuses each residual Add into the following RMSNorm
  (SkipSimplifiedLayerNormalization).

With `kv_dtype="fp16"` (`arborspec export --kv-dtype fp16`) the weights and every other
activation stay fp32 but the cache slabs are float16 (half the memory and bytes read per step
at long context): each layer casts its packed q/k/v to fp16 before GroupQueryAttention and the
attention output back to fp32 after it, and the rotary tables and attention bias are fp16, so
the kernel runs in one dtype. ONNX Runtime 1.32's CPU kernel would also take fp32 q/k/v with an
fp16 cache (its T_CACHE type), but then a call's own new tokens are attended with their fp32
K/V while earlier calls' tokens are read back rounded: the logits would depend on how tokens
are split into calls, and a tree would no longer reproduce vanilla decoding by construction
(and it measured slower: 7.6 vs 4.6 ms for a one-token call at P = 4000 on a 2-layer model with
SmolLM2's heads, fp32 cache 5.2 ms). In fp16 throughout, every token's K/V is rounded once,
before anyone attends to it.

The contract's names, dtypes and mask are unchanged; only the cache inputs/outputs differ, and
the metadata records it (`arborspec.kv_layout` = "bhsd", contract version 2). TensorRT cannot
build this graph (GroupQueryAttention is an ONNX Runtime contrib op): export with
`--attention onnx` for `arborspec build`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from arborspec.runtime import contract as C
from arborspec.runtime.errors import InputError

IR_VERSION = 10
OPSET = 23


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().contiguous().numpy()


def rope_tables(head_dim: int, theta: float, max_position: int, rotary=None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_position, R/2] computed by models/rope.Rotary (float32): `rotary` (a model's
    own, with its scaling and partial rotary) or default RoPE of `theta`."""
    from arborspec.models.rope import Rotary

    rotary = rotary if rotary is not None else Rotary(head_dim, theta)
    cos, sin = rotary.tables(max_position)
    return cos.numpy(), sin.numpy()


KV_DTYPES = ("fp32", "fp16")
# the attention bias of a masked column in an fp16 kernel: far below any score, and far enough from
# fp16's -65504 that score + bias cannot round to -inf (a fully masked row stays finite)
FP16_MASKED = -30000.0


def gqa_unsupported(cfg, dtype: str = "fp32") -> str | None:
    """Why this model cannot use the GroupQueryAttention graph, or None when it can."""
    if cfg.family not in ("llama", "gemma3"):
        return f"needs a Llama-family (or Gemma 3) model, not {cfg.family}"
    if dtype != "fp32":
        return f"exports fp32 only, not {dtype}"
    if cfg.head_dim % 16:
        return f"ONNX Runtime's GroupQueryAttention needs a head size that is a multiple of 16 (this model: {cfg.head_dim})"
    from arborspec.models.rope import rope_dim

    rot = rope_dim(cfg.head_dim, cfg.rope_scaling)
    if rot % 16:
        return f"ONNX Runtime's GroupQueryAttention needs a rotary size that is a multiple of 16 (this model: {rot})"
    return None


def attention_inputs(
    node, init, d: int, rope_theta: float, max_context: int, attn_np=np.float32, masked=None, rotary=None
):
    """The GroupQueryAttention inputs every layer of a graph shares, derived from the contract
    inputs: (seqlens_k [B] int32: per row, the last column its last token may see, which is
    P+T-1 for every mask of the contract; total_sequence_length scalar int32 = P+T; the tree
    mask as an additive bias [B, 1, T, P+T]); also the rotary tables "cos_cache" and "sin_cache"
    for `max_context` positions (from `rotary`, a models/rope.Rotary, when given: scaled RoPE, every
    position's row its own rotation). `node`/`init` are the graph builder's.

    seqlens_k from the mask lets a batch of one-token rows be *ragged* (contract metadata
    `arborspec.ragged_rows`): a row whose mask sees columns [0, len_b] only writes its new K/V at
    len_b and attends over len_b + 1 columns, instead of every row over the longest row's P."""
    from onnx import TensorProto as TP

    masked = np.finfo(np.float32).min if masked is None else masked
    init("c_i2", np.array([2], np.int64))
    init("c_i0", np.array([0], np.int64))
    init("c_zero_f", np.array(0.0, attn_np))
    init("c_min_f", np.array(masked, attn_np))
    init("c_axes1", np.array([1], np.int64))
    mshape = node("Shape", [C.ATTENTION_MASK], ["mask_shape"])
    total64 = node("Gather", [mshape, "c_i2"], ["total64"], axis=0)  # [1]
    total32 = node("Cast", [total64], ["total32_1"], to=TP.INT32)
    total = node("Squeeze", [total32, "c_i0"], ["total_len"])  # scalar int32
    # the last column the last row may see: max over columns of (mask ? column : -1)
    init("c_i0_s", np.array(0, np.int64))
    init("c_i1_s", np.array(1, np.int64))
    init("c_im1", np.array(-1, np.int64))
    init("c_im1_1", np.array([-1], np.int64))
    total_s = node("Squeeze", [total64, "c_i0"], ["total64_s"])
    cols = node("Range", ["c_i0_s", total_s, "c_i1_s"], ["mask_cols"])  # [S]
    last_row = node("Gather", [C.ATTENTION_MASK, "c_im1"], ["mask_last_row"], axis=1)  # [B, S]
    seen = node("Where", [last_row, cols, "c_im1"], ["mask_last_seen"])
    seen_max = node("ReduceMax", [seen, "c_im1_1"], ["mask_last_max"], keepdims=0)  # [B]
    # a fully masked last row (allowed: it must not give NaN) keeps the whole P+T
    none = node("Less", [seen_max, "c_i0_s"], ["mask_last_none"])
    full = node("Sub", [total_s, "c_i1_s"], ["total_m1"])
    last = node("Where", [none, full, seen_max], ["seqlens64"])
    seqlens = node("Cast", [last], ["seqlens_k"], to=TP.INT32)  # [B] int32
    mask4 = node("Unsqueeze", [C.ATTENTION_MASK, "c_axes1"], ["mask4"])
    bias = node("Where", [mask4, "c_zero_f", "c_min_f"], ["attn_bias"])  # [B,1,T,S]
    cos, sin = rope_tables(d, rope_theta, max(max_context, 1), rotary)
    init("cos_cache", cos.astype(attn_np))
    init("sin_cache", sin.astype(attn_np))
    return seqlens, total, bias


def window_bias(node, init, window: int) -> str:
    """The attention bias of a sliding-window layer [B, 1, T, P+T]: the tree mask AND "the key's
    position > the query's position - window", with cache column j at position j and the new
    tokens at their position_ids (models/llama.window_mask). Positions, not columns: a tree node
    at depth d sits at column P + i >= P + d, so GroupQueryAttention's own local_window_size
    (which counts columns) would cut a tree's keys short; the bias is exact and costs one
    [B, T, P+T] compare per call."""
    init("c_window", np.array(window, np.int64))
    t = node("Shape", [C.POSITION_IDS], ["win_pos_shape"])
    b_t = node("Gather", [t, "c_i0"], ["win_b"], axis=0)  # [1]
    t1 = node("Gather", [t, "c_i1"], ["win_t"], axis=0)  # [1]
    p1 = node("Sub", ["total64", t1], ["win_p"])  # [1] = P
    p_s = node("Squeeze", [p1, "c_i0"], ["win_p_s"])
    past = node("Range", ["c_i0_s", p_s, "c_i1_s"], ["win_past_pos"])  # [P]
    shape = node("Concat", [b_t, p1], ["win_past_shape"], axis=0)
    past_b = node("Expand", [past, shape], ["win_past_b"])  # [B, P]
    keys = node("Concat", [past_b, C.POSITION_IDS], ["win_key_pos"], axis=1)  # [B, S]
    q = node("Unsqueeze", [C.POSITION_IDS, "c_i2"], ["win_q"])  # [B, T, 1]
    k = node("Unsqueeze", [keys, "c_i1"], ["win_k"])  # [B, 1, S]
    diff = node("Sub", [q, k], ["win_diff"])
    inside = node("Less", [diff, "c_window"], ["win_inside"])
    both = node("And", [C.ATTENTION_MASK, inside], ["win_mask"])
    both4 = node("Unsqueeze", [both, "c_axes1"], ["win_mask4"])
    return node("Where", [both4, "c_zero_f", "c_min_f"], ["win_bias"])


def qk_norm(node, init, qkv: str, layer: int, sd: dict, cfg, offset: float = 0.0) -> str:
    """Qwen3's (Gemma 3's: offset 1, weights 1 + w) RMSNorm over each head of q and k (before the
    kernel's RoPE), on the packed qkv."""
    nq, nkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p = f"model.layers.{layer}.self_attn."
    init(f"l{layer}.qkv_split", np.array([nq * d, nkv * d, nkv * d], np.int64))
    q, k, v = node("Split", [qkv, f"l{layer}.qkv_split"], [f"l{layer}.q", f"l{layer}.k", f"l{layer}.v"], axis=-1)
    out = []
    for name, x, heads in (("q", q, nq), ("k", k, nkv)):
        heads_shape = init(f"l{layer}.{name}_heads", np.array([0, 0, heads, d], np.int64))
        flat_shape = init(f"l{layer}.{name}_flat", np.array([0, 0, heads * d], np.int64))
        xh = node("Reshape", [x, heads_shape], [f"l{layer}.{name}_h"])
        w = init(f"l{layer}.{name}_norm", _np(sd[p + f"{name}_norm.weight"]) + np.float32(offset))
        xn = node(
            "RMSNormalization", [xh, w], [f"l{layer}.{name}_hn"], axis=-1, epsilon=float(cfg.norm_eps), stash_type=1
        )
        out.append(node("Reshape", [xn, flat_shape], [f"l{layer}.{name}_n"]))
    return node("Concat", [*out, v], [f"l{layer}.qkv_n"], axis=-1)


def gqa_node(
    node, qkv: str, layer: int, out: str, nq: int, nkv: int, d: int, seqlens, total, bias, rope="", scale=None
):
    """One GroupQueryAttention over layer `layer`'s cache slab (read and written in place, rotary
    inside from position_ids with the tables "cos_cache{rope}" / "sin_cache{rope}", the tree mask
    as bias, scores scaled by `scale`, default d ** -0.5): -> [attention out, new K, new V]."""
    return node(
        "GroupQueryAttention",
        [
            qkv,
            "",
            "",
            C.past_key(layer),
            C.past_value(layer),
            seqlens,
            total,
            "cos_cache" + rope,
            "sin_cache" + rope,
            C.POSITION_IDS,
            bias,
        ],
        [out, C.new_key(layer), C.new_value(layer)],
        domain="com.microsoft",
        num_heads=nq,
        kv_num_heads=nkv,
        do_rotary=1,
        rotary_interleaved=0,
        causal=0,
        scale=float(scale or float(d) ** -0.5),
    )


def build_gqa_model(
    module: torch.nn.Module,
    max_context: int,
    topk: int = 0,
    linears=None,
    accuracy_level: int = 0,
    feature_layers: list[int] | None = None,
    kv_dtype: str = "fp32",
):
    """An onnx.ModelProto of the module (models/llama.LlamaDecoder) in the "bhsd" contract.

    kv_dtype: "fp32" or "fp16", the element type of the past/new K/V slabs (see the module
    docstring: with fp16, GroupQueryAttention runs in fp16 between two Casts).

    feature_layers: add the contract's `hidden_states` output, the hidden states entering those
    layers concatenated [B, T, len * H] (the features an EAGLE-3 draft reads).

    linears: None (float MatMuls from the module's weights) or a callable hf_name -> NBits | None
    giving a layer's MatMulNBits blocks (export/quantize.py; None keeps that layer float)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper

    cfg = module.config
    why_not = gqa_unsupported(cfg)
    if why_not:
        raise InputError(f"--attention gqa: {why_not} (use --attention onnx)")
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"unknown --kv-dtype {kv_dtype!r} (expected one of {', '.join(KV_DTYPES)})")
    half = kv_dtype == "fp16"
    kv_elem = TP.FLOAT16 if half else TP.FLOAT
    attn_np = np.float16 if half else np.float32  # the attention kernel's dtype
    sd = {k: v for k, v in module.state_dict().items()}
    nq, nkv, d, hs = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_size
    inits: list = []
    nodes: list = []

    def init(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def node(op, ins, outs, domain="", **attrs):
        nodes.append(h.make_node(op, ins, outs, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def linear_t(w: torch.Tensor) -> np.ndarray:  # nn.Linear [out, in] -> MatMul [in, out]
        return _np(w).T

    memo: dict = {}

    def blocks(names: list[str]):
        """The layers' MatMulNBits blocks concatenated along N, or None (float)."""
        if linears is None:
            return None
        if tuple(names) not in memo:
            memo[tuple(names)] = _blocks(names)
        return memo[tuple(names)]

    def _blocks(names: list[str]):
        parts = [linears(n) for n in names]
        if any(q is None for q in parts):
            return None
        if len({(q.bits, q.k) for q in parts}) != 1:
            return None
        if parts[0].bits == 8 and accuracy_level < 4:
            # ONNX Runtime 1.32 has no fast 8-bit kernel with float activations (measured on the
            # 49152 x 576 head: 96 ms vs 3.4 ms for the float MatMul of the same, exact, weights)
            return None
        from .quantize import NBits

        zps = [q.zero_points for q in parts]  # None: the default (8, or 128 for 8 bits)
        offs = [q.offsets for q in parts]
        if any(o is not None for o in offs):
            offs = [o if o is not None else np.zeros((q.n, q.k // 32), np.float32) for o, q in zip(offs, parts)]
            offsets = np.concatenate(offs)
        else:
            offsets = None
        return NBits(
            np.concatenate([q.blob for q in parts]),
            np.concatenate([q.scales for q in parts]),
            None if all(z is None for z in zps) else np.concatenate([q.packed_zero_points() for q in parts]),
            parts[0].bits,
            sum(q.n for q in parts),
            parts[0].k,
            parts[0].source,
            offsets,
        )

    def matmul(x: str, hf_names: list[str], name: str) -> str:
        """x @ W^T for the (concatenated) weights: MatMulNBits when blocks exist, else MatMul."""
        q = blocks(hf_names)
        if q is None:
            w = np.concatenate([linear_t(sd[n]) for n in hf_names], axis=1)
            return node("MatMul", [x, init(name, w)], [name + "_out"])
        ins = [x, init(name + ".blob", q.blob), init(name + ".scales", q.scales.astype(np.float32))]
        if q.zero_points is not None:
            ins.append(init(name + ".zp", q.zero_points))
        y = node(
            "MatMulNBits",
            ins,
            [name + "_nbits"],
            domain="com.microsoft",
            K=q.k,
            N=q.n,
            bits=q.bits,
            block_size=32,
            accuracy_level=accuracy_level,
        )
        if q.offsets is None:
            return y
        # per-block offsets (GGUF Q4_1's m): + (sums of x over each block of 32) @ M^T
        nb = q.k // 32
        shape = init(name + ".blk_shape", np.array([0, 0, nb, 32], np.int64))
        xb = node("Reshape", [x, shape], [name + "_xb"])
        sums = node("ReduceSum", [xb, "c_axes_m1"], [name + "_xsum"], keepdims=0)
        corr = node("MatMul", [sums, init(name + ".offsets", np.ascontiguousarray(q.offsets.T))], [name + "_corr"])
        return node("Add", [y, corr], [name + "_out"])

    # ---- inputs, scalars derived from shapes
    inputs = [
        h.make_tensor_value_info(C.INPUT_IDS, TP.INT64, ["batch", "tokens"]),
        h.make_tensor_value_info(C.POSITION_IDS, TP.INT64, ["batch", "tokens"]),
        h.make_tensor_value_info(C.ATTENTION_MASK, TP.BOOL, ["batch", "tokens", "context"]),
    ]
    outputs = [h.make_tensor_value_info(C.LOGITS, TP.FLOAT, ["batch", "tokens", cfg.vocab_size])]
    for i in range(cfg.n_layers):
        for name in (C.past_key(i), C.past_value(i)):
            inputs.append(h.make_tensor_value_info(name, kv_elem, ["batch", nkv, "max_seq", d]))
        for name in (C.new_key(i), C.new_value(i)):
            outputs.append(h.make_tensor_value_info(name, kv_elem, ["batch", nkv, "max_seq", d]))

    init("c_i1", np.array([1], np.int64))
    init("c_axes_m1", np.array([-1], np.int64))
    masked = FP16_MASKED if half else np.finfo(np.float32).min
    seqlens, total, bias = attention_inputs(
        node, init, d, cfg.rope_theta, max_context, attn_np, masked, rotary=module.rotary
    )
    local = window_bias(node, init, cfg.sliding_window) if cfg.sliding_window > 0 else None
    # Gemma 3 (models/gemma3.py): norms multiply by 1 + w, embeddings scaled by sqrt(H), a norm on
    # the attention output and on the MLP output, tanh GELU, its own attention scale, and the
    # sliding layers rotate with their own RoPE base (tables "cos_cache_local" / "sin_cache_local")
    gemma = cfg.family == "gemma3"
    one = np.float32(1.0 if gemma else 0.0)

    def gamma(name: str) -> np.ndarray:
        return _np(sd[name]) + one

    if gemma:
        for kind, table in zip(("cos", "sin"), rope_tables(d, 0.0, max(max_context, 1), module.rotary_local)):
            init(f"{kind}_cache_local", table.astype(attn_np))

    def rms(x: str, name: str, out: str) -> str:
        return node("RMSNormalization", [x, init(out + ".w", gamma(name))], [out], axis=-1, epsilon=eps, stash_type=1)

    emb = init("embed_tokens", _np(sd["model.embed_tokens.weight"]))
    x = node("Gather", [emb, C.INPUT_IDS], ["x0"], axis=0)
    if gemma:  # the scale rounded to float32, as the module multiplies it
        x = node("Mul", [x, init("embed_scale", np.array(cfg.hidden_size**0.5, np.float32))], ["x0_scaled"])
    eps = float(cfg.norm_eps)
    normed = rms(x, "model.layers.0.input_layernorm.weight", "l0.normed")
    residual = x
    feature_layers = [int(i) for i in feature_layers or []]
    if any(not 0 <= i < cfg.n_layers for i in feature_layers):
        raise InputError(f"feature layers {feature_layers} are outside the model's {cfg.n_layers} layers")
    feats: dict[int, str] = {}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        feats[i] = residual  # the hidden state entering layer i
        qkv = matmul(normed, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], f"l{i}.qkv")
        if cfg.attention_bias:
            bqkv = np.concatenate([_np(sd[p + f"self_attn.{n}_proj.bias"]) for n in "qkv"])
            qkv = node("Add", [qkv, init(f"l{i}.qkv_b", bqkv)], [f"l{i}.qkv_biased"])
        if cfg.qk_norm:
            qkv = qk_norm(node, init, qkv, i, sd, cfg, float(one))
        if half:
            qkv = node("Cast", [qkv], [f"l{i}.qkv_h"], to=TP.FLOAT16)
        b_i = local if cfg.is_sliding(i) else bias
        rope = "_local" if gemma and cfg.is_sliding(i) else ""
        attn = gqa_node(
            node,
            qkv,
            i,
            f"l{i}.attn_h" if half else f"l{i}.attn",
            nq,
            nkv,
            d,
            seqlens,
            total,
            b_i,
            rope,
            cfg.attn_scale,
        )
        attn_out = node("Cast", [attn[0]], [f"l{i}.attn"], to=TP.FLOAT) if half else attn[0]
        o = matmul(attn_out, [p + "self_attn.o_proj.weight"], f"l{i}.o")
        mlp_norm = p + "post_attention_layernorm.weight"
        if gemma:
            o = rms(o, mlp_norm, f"l{i}.o_normed")
            mlp_norm = p + "pre_feedforward_layernorm.weight"
        post = node(
            "SkipSimplifiedLayerNormalization",
            [o, residual, init(f"l{i}.post_norm", gamma(mlp_norm))],
            [f"l{i}.post_normed", "", "", f"l{i}.res1"],
            domain="com.microsoft",
            epsilon=eps,
        )
        normed2, residual = post[0], post[3]
        # gate and up in one product, as q/k/v: one MatMulNBits and, for Q4_1 blocks, one offset
        # correction instead of two (measured on SmolLM2 int4: -9 to -14 % per verify call)
        gate_up = matmul(normed2, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], f"l{i}.gate_up")
        split = init(f"l{i}.gate_up_split", np.array([cfg.intermediate_size] * 2, np.int64))
        gate, up = node("Split", [gate_up, split], [f"l{i}.gate", f"l{i}.up"], axis=-1)
        if cfg.mlp_bias:
            gate = node("Add", [gate, init(f"l{i}.gate_b", _np(sd[p + "mlp.gate_proj.bias"]))], [f"l{i}.gate_b_out"])
            up = node("Add", [up, init(f"l{i}.up_b", _np(sd[p + "mlp.up_proj.bias"]))], [f"l{i}.up_b_out"])
        if gemma:
            gated = node("Gelu", [gate], [f"l{i}.gelu"], approximate="tanh")
        else:
            gated = node("Mul", [gate, node("Sigmoid", [gate], [f"l{i}.sig"])], [f"l{i}.silu"])
        act = node("Mul", [gated, up], [f"l{i}.act"])
        down = matmul(act, [p + "mlp.down_proj.weight"], f"l{i}.down")
        if cfg.mlp_bias:
            down = node("Add", [down, init(f"l{i}.down_b", _np(sd[p + "mlp.down_proj.bias"]))], [f"l{i}.down_b_out"])
        if gemma:
            down = rms(down, p + "post_feedforward_layernorm.weight", f"l{i}.down_normed")
        last_layer = i == cfg.n_layers - 1
        nxt_norm = "model.norm.weight" if last_layer else f"model.layers.{i + 1}.input_layernorm.weight"
        nxt = node(
            "SkipSimplifiedLayerNormalization",
            [down, residual, init(f"l{i}.next_norm", gamma(nxt_norm))],
            [f"l{i}.next_normed", "", "", f"l{i}.res2"],
            domain="com.microsoft",
            epsilon=eps,
        )
        normed, residual = nxt[0], nxt[3]

    if blocks(["lm_head.weight"]) is not None:  # the head's own blocks (a tied head: the embedding's)
        logits = matmul(normed, ["lm_head.weight"], "lm_head")
    else:  # Gemm with transB over the [B*T, H] rows (a tied head reuses the embedding)
        head = emb if cfg.tie_embeddings else init("lm_head", _np(sd["lm_head.weight"]))
        init("c_rows", np.array([-1, hs], np.int64))
        init("c_vocab", np.array([cfg.vocab_size], np.int64))
        rows = node("Reshape", [normed, "c_rows"], ["final_rows"])
        flat = node("Gemm", [rows, head], ["logits_rows"], transB=1)
        bt = node("Shape", [C.INPUT_IDS], ["bt_shape"])
        out_shape = node("Concat", [bt, "c_vocab"], ["logits_shape"], axis=0)
        logits = node("Reshape", [flat, out_shape], ["logits_raw"])
    if cfg.final_softcap > 0:  # Gemma: tanh(logits / cap) * cap
        cap = init("c_softcap", np.array(cfg.final_softcap, np.float32))
        capped = node("Tanh", [node("Div", [logits, cap], ["logits_div"])], ["logits_tanh"])
        logits = node("Mul", [capped, cap], ["logits_capped"])
    if topk:
        node("Identity", [logits], [C.LOGITS])
        lse = node("ReduceLogSumExp", [logits, init("c_axes_last", np.array([-1], np.int64))], ["lse"], keepdims=1)
        lp = node("Sub", [logits, lse], ["logprobs"])
        init("c_k", np.array([topk], np.int64))
        node("TopK", [lp, "c_k"], [C.TOPK_LOGPROBS, C.TOPK_IDS], axis=-1, largest=1, sorted=1)
        outputs += [
            h.make_tensor_value_info(C.TOPK_LOGPROBS, TP.FLOAT, ["batch", "tokens", topk]),
            h.make_tensor_value_info(C.TOPK_IDS, TP.INT64, ["batch", "tokens", topk]),
        ]
    else:
        node("Identity", [logits], [C.LOGITS])
    if feature_layers:
        parts = [feats[i] for i in feature_layers]
        node("Concat", parts, [C.HIDDEN_STATES], axis=-1) if len(parts) > 1 else node(
            "Identity", parts, [C.HIDDEN_STATES]
        )
        outputs.append(
            h.make_tensor_value_info(C.HIDDEN_STATES, TP.FLOAT, ["batch", "tokens", len(feature_layers) * hs])
        )
    graph = h.make_graph(nodes, f"arborspec_{cfg.name or 'llama'}_gqa", inputs, outputs, inits)
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid("com.microsoft", 1)], producer_name="arborspec"
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)  # structure (the contrib ops are checked by ONNX Runtime)
    return model


def save_model(model, path: str | Path) -> list[str]:
    """Write the model; weights go to `<name>.data` when the protobuf would pass 2 GiB.
    Returns the external-data file names."""
    import onnx

    path = Path(path)
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size > 2 * 1024**3 - 64 * 1024**2:
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
        return [path.name + ".data"]
    onnx.save(model, str(path))
    return []


def verify_gqa_against_torch(module: torch.nn.Module, path: str | Path, seed: int = 0, relative: bool = False) -> float:
    """Run the graph through the runtime's OrtEngine and the module through TorchEngine on the
    same steps (a prefill at P = 0, a one-token step, a random tree step over P > 0 with a fully
    masked row); return the max abs difference of the logits and of the cached K/V (relative:
    each one divided by the largest absolute reference value, for an fp16 cache). Raises on NaN."""
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.kvcache import KVCache

    cfg = module.config
    ort_e, ref_e = OrtEngine(path), TorchEngine(module)
    g = torch.Generator().manual_seed(seed)
    c_o, c_r = KVCache(ort_e.info.cache, 48, 1), KVCache(ref_e.info.cache, 48, 1)
    worst = 0.0
    steps = [(9, "prefill"), (1, "decode"), (6, "tree")]
    for t, kind in steps:
        p = c_o.length
        ids = torch.randint(0, cfg.vocab_size, (1, t), generator=g)
        if kind == "tree":
            tri = torch.rand(t, t, generator=g) < 0.5
            block = torch.tril(tri) | torch.eye(t, dtype=torch.bool)
            block[:, 0] = True
            pos = (p + torch.arange(t) // 2)[None]
        else:
            block = torch.ones(t, t, dtype=torch.bool).tril()
            pos = (p + torch.arange(t))[None]
        mask = torch.cat([torch.ones(t, p, dtype=torch.bool), block], 1)[None]
        if kind == "tree":
            mask[0, -1] = False  # a fully masked row must stay finite
        lo, lr = ort_e.forward(ids, pos, mask, c_o), ref_e.forward(ids, pos, mask, c_r)
        if torch.isnan(lo).any():
            raise RuntimeError(f"{path}: NaN in ONNX Runtime logits ({kind} step)")
        rows = slice(0, t - 1) if kind == "tree" else slice(0, t)  # the masked row is arbitrary
        d = float((lo[0, rows] - lr[0, rows]).abs().max())
        worst = max(worst, d / max(float(lr[0, rows].abs().max()), 1e-12) if relative else d)
        c_o.commit(None, t)
        c_r.commit(None, t)
    for i in range(cfg.n_layers):  # the caches hold the same K/V
        ko, kr = c_o.past(i)[0], c_r.past(i)[0]
        d = float((ko[:-1].float() - kr[:-1]).abs().max())
        worst = max(worst, d / max(float(kr[:-1].abs().max()), 1e-12) if relative else d)
    ort_e.close()
    return worst
