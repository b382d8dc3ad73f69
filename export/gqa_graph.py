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
(and it measured slower than either one-dtype graph). In fp16 throughout, every token's K/V is rounded once,
before anyone attends to it.

The contract's names, dtypes and mask are unchanged; only the cache inputs/outputs differ, and
the metadata records it (`arborspec.kv_layout` = "bhsd", contract version 2). TensorRT cannot
build this graph (GroupQueryAttention is an ONNX Runtime contrib op): export with
`--attention onnx` for `arborspec build`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from arborspec.runtime import contract as C
from arborspec.runtime.errors import InputError

from . import row_pad

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
GQA_DTYPES = ("fp32", "fp16")  # weights and activations (fp16: for ONNX Runtime CUDA)
# the attention bias of a masked column in an fp16 kernel: far below any score, and far enough from
# fp16's -65504 that score + bias cannot round to -inf (a fully masked row stays finite)
FP16_MASKED = -30000.0


def gqa_unsupported(cfg, dtype: str = "fp32") -> str | None:
    """Why this model cannot use the GroupQueryAttention graph, or None when it can."""
    if cfg.family not in ("llama", "gemma3"):
        return f"needs a Llama-family (or Gemma 3) model, not {cfg.family}"
    if dtype not in GQA_DTYPES:
        return f"exports {' or '.join(GQA_DTYPES)}, not {dtype}"
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


def qk_norm(node, init, qkv: str, layer: int, get, cfg, offset: float = 0.0, wdtype=np.float32) -> str:
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
        w = init(f"l{layer}.{name}_norm", (get(p + f"{name}_norm.weight") + np.float32(offset)).astype(wdtype))
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


@dataclass
class GraphOptions:
    """What a GroupQueryAttention graph is built for (besides its weights).

    dtype: "fp32" or "fp16", the weights' and activations' type (fp16: ONNX Runtime CUDA; the cache
    is fp16 too, logits and features are cast back to float32). kv_dtype: "fp32" or "fp16", the
    cache slabs' type of an fp32 graph (see the module docstring: GroupQueryAttention then runs in
    fp16 between two Casts). n_layers: build only the first n layers (then the final norm and the
    head): the bounded self-check of a large export. feature_layers: add the contract's
    `hidden_states` output, the hidden states entering those layers concatenated [B, T, len * H]
    (the features an EAGLE-3 draft reads). pad_row: the attention of a one-token call runs one dummy
    row more (export/row_pad.py: one-token calls row-invariant at one row's cost)."""

    max_context: int
    topk: int = 0
    accuracy_level: int = 0
    feature_layers: list[int] | None = None
    kv_dtype: str = "fp32"
    dtype: str = "fp32"
    n_layers: int | None = None
    pad_row: bool = False  # one dummy attention row in one-token calls (export/row_pad.py)


class MemorySink:
    """Initialisers kept in the ModelProto (a small model: one .onnx file)."""

    def __init__(self):
        self.tensors: list = []

    def add(self, name: str, arr: np.ndarray) -> None:
        from onnx import numpy_helper

        self.tensors.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))

    def add_proto(self, t) -> None:
        self.tensors.append(t)


def _external(t, location: str, offset: int, length: int):
    t.data_location = t.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        e = t.external_data.add()
        e.key, e.value = key, str(value)
    return t


class ExternalDataSink:
    """Initialisers written straight to `<model>.data` as they are made (a large model): the
    ModelProto holds only their names, shapes and offsets, and no array outlives its layer."""

    ALIGN = 4096

    def __init__(self, model_path: str | Path):
        self.path = Path(str(model_path) + ".data")
        self.location = self.path.name
        self.file = open(self.path, "wb")
        self.tensors: list = []

    def add(self, name: str, arr: np.ndarray) -> None:
        import onnx
        from onnx import helper, numpy_helper

        arr = np.ascontiguousarray(arr)
        if arr.nbytes < 1024:  # scalars and shapes stay inline
            self.tensors.append(numpy_helper.from_array(arr, name))
            return
        pad = -self.file.tell() % self.ALIGN
        self.file.write(b"\0" * pad)
        offset = self.file.tell()
        self.file.write(arr.tobytes())
        t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype), dims=arr.shape)
        self.tensors.append(_external(t, self.location, offset, arr.nbytes))

    def add_proto(self, t) -> None:
        """A TensorProto with raw_data (packed int4, which numpy has no type for)."""
        if len(t.raw_data) < 1024:
            self.tensors.append(t)
            return
        self.file.write(b"\0" * (-self.file.tell() % self.ALIGN))
        offset, length = self.file.tell(), len(t.raw_data)
        self.file.write(t.raw_data)
        t.ClearField("raw_data")
        self.tensors.append(_external(t, self.location, offset, length))

    def close(self) -> None:
        self.file.close()


def _rotaries(weights):
    """The rotary embeddings of a model: its module's own, or built from its config."""
    module = getattr(weights, "module", None)
    if module is not None:
        return module.rotary, getattr(module, "rotary_local", None)
    from arborspec.models.rope import Rotary

    cfg = weights.config
    return Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position), None


class GQAGraph:
    """Writes one Llama-family (or Gemma 3) model as ONNX Runtime's GroupQueryAttention graph,
    reading each tensor from `weights` (export/weights.py) when its initialiser is written.

    linears: None (float MatMuls) or a callable hf_name -> NBits | None giving a layer's
    MatMulNBits blocks (export/quantize.py; None keeps that layer float)."""

    KIND = "gqa"  # the graph's name suffix (export/portable_graph.py: "portable")

    def __init__(self, weights, opts: GraphOptions, linears=None, sink=None, progress: bool = False):
        from onnx import TensorProto as TP

        self.w, self.o, self.linears, self.progress = weights, opts, linears, progress
        self.cfg = cfg = weights.config
        self.sink = sink if sink is not None else MemorySink()
        self.nodes: list = []
        self.half = opts.dtype == "fp16"
        kv_half = opts.kv_dtype == "fp16" or self.half
        self.kv_elem = TP.FLOAT16 if kv_half else TP.FLOAT
        self.attn_np = np.float16 if kv_half else np.float32  # the attention kernel's dtype
        self.act_np = np.float16 if self.half else np.float32  # weights and activations
        self.act_elem = TP.FLOAT16 if self.half else TP.FLOAT
        self.n_layers = cfg.n_layers if opts.n_layers is None else min(int(opts.n_layers), cfg.n_layers)
        self.gemma = cfg.family == "gemma3"
        self.one = np.float32(1.0 if self.gemma else 0.0)
        self.eps = float(cfg.norm_eps)

    # -- the builder's two primitives
    def init(self, name: str, arr: np.ndarray) -> str:
        self.sink.add(name, arr)
        return name

    def node(self, op, ins, outs, domain="", **attrs):
        from onnx import helper as h

        self.nodes.append(h.make_node(op, ins, outs, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def weight(self, name: str, arr: np.ndarray) -> str:
        """A float weight in the graph's dtype."""
        return self.init(name, arr.astype(self.act_np, copy=False))

    def gamma(self, hf_name: str, out: str) -> str:
        return self.weight(out, self.w.get(hf_name) + self.one)

    def rms(self, x: str, hf_name: str, out: str) -> str:
        w = self.gamma(hf_name, out + ".w")
        return self.node("RMSNormalization", [x, w], [out], axis=-1, epsilon=self.eps, stash_type=1)

    # -- linear layers
    def blocks(self, names: list[str]):
        """The layers' MatMulNBits blocks as one product (concatenated along N), a list of
        products of different formats, or None (float)."""
        if self.linears is None:
            return None
        parts = [self.linears(n) for n in names]
        if any(q is None for q in parts):
            return None
        if parts[0].bits == 8 and self.o.accuracy_level < 4 and parts[0].source.startswith("gguf"):
            # ONNX Runtime 1.32 has no fast 8-bit kernel with float activations (benchmarks/RESULTS.md)
            return None
        if len({(q.bits, q.k, q.block, q.offsets is None) for q in parts}) != 1:
            return parts  # e.g. Q4_K_M's q/k (Q4_K) beside its v (Q6_K): one product each
        return concat_nbits(parts)

    def matmul(self, x: str, hf_names: list[str], name: str) -> str:
        """x @ W^T for the (concatenated) weights: MatMulNBits where blocks exist, else MatMul."""
        q = self.blocks(hf_names)
        if q is None:
            w = np.concatenate([self.w.get(n).T for n in hf_names], axis=1)
            return self.node("MatMul", [x, self.weight(name, w)], [name + "_out"])
        if isinstance(q, list):
            outs = [self.nbits_matmul(x, p, f"{name}.{j}") for j, p in enumerate(q)]
            return self.node("Concat", outs, [name + "_out"], axis=-1)
        return self.nbits_matmul(x, q, name)

    def nbits_matmul(self, x: str, q, name: str) -> str:
        ins = [x, self.init(name + ".blob", q.blob), self.init(name + ".scales", q.scales.astype(self.act_np))]
        if q.zero_points is not None:
            ins.append(self.init(name + ".zp", q.zero_points))
        y = self.node(
            "MatMulNBits", ins, [name + "_nbits"], domain="com.microsoft",
            K=q.k, N=q.n, bits=q.bits, block_size=q.block, accuracy_level=self.o.accuracy_level,
        )  # fmt: skip
        if q.offsets is None:
            return y
        # per-block offsets (GGUF Q4_1's m, the K-quants' mins): + (sums of x over each block) @ M^T
        nb = q.k // q.block
        shape = self.init(name + ".blk_shape", np.array([0, 0, nb, q.block], np.int64))
        xb = self.node("Reshape", [x, shape], [name + "_xb"])
        sums = self.node("ReduceSum", [xb, "c_axes_m1"], [name + "_xsum"], keepdims=0)
        offsets = self.init(name + ".offsets", np.ascontiguousarray(q.offsets.T).astype(self.act_np))
        corr = self.node("MatMul", [sums, offsets], [name + "_corr"])
        return self.node("Add", [y, corr], [name + "_out"])

    # -- the graph, top to bottom
    def build(self):
        """The onnx.ModelProto of the whole graph (initialisers in the sink)."""
        import onnx
        from onnx import helper as h

        inputs, outputs = self.io()
        self.init("c_i1", np.array([1], np.int64))
        self.init("c_axes_m1", np.array([-1], np.int64))
        seqlens, total, bias = self.attention_shared()
        x = self.embed()
        normed, residual = self.rms(x, "model.layers.0.input_layernorm.weight", "l0.normed"), x
        feats: dict[int, str] = {}
        for i in self.layers():
            feats[i] = residual  # the hidden state entering layer i
            normed, residual = self.layer(i, normed, residual, seqlens, total, bias)
            self.w.release()
        logits = self.head(normed)
        if self.o.pad_row:
            self.nodes = row_pad.pad_rows(self.nodes, self.init)
        outputs += self.logits_outputs(logits)
        outputs += self.features(feats)
        graph = h.make_graph(
            self.nodes, f"arborspec_{self.cfg.name or 'llama'}_{self.KIND}", inputs, outputs, self.sink.tensors
        )
        model = h.make_model(graph, opset_imports=self.opset_imports(), producer_name="arborspec")
        model.ir_version = IR_VERSION
        if not isinstance(self.sink, ExternalDataSink):
            onnx.checker.check_model(model)  # structure (external data: checked on the saved file)
        return model

    def opset_imports(self) -> list:
        from onnx import helper as h

        return [h.make_opsetid("", OPSET), h.make_opsetid("com.microsoft", 1)]

    def layers(self):
        from tqdm.auto import tqdm

        return tqdm(range(self.n_layers), desc="export: layers", unit="layer", disable=None if self.progress else True, leave=False)

    def io(self):
        from onnx import TensorProto as TP
        from onnx import helper as h

        cfg, nkv, d = self.cfg, self.cfg.n_kv_heads, self.cfg.head_dim
        inputs = [
            h.make_tensor_value_info(C.INPUT_IDS, TP.INT64, ["batch", "tokens"]),
            h.make_tensor_value_info(C.POSITION_IDS, TP.INT64, ["batch", "tokens"]),
            h.make_tensor_value_info(C.ATTENTION_MASK, TP.BOOL, ["batch", "tokens", "context"]),
        ]
        outputs = [h.make_tensor_value_info(C.LOGITS, TP.FLOAT, ["batch", "tokens", cfg.vocab_size])]
        for i in range(self.n_layers):
            for name in (C.past_key(i), C.past_value(i)):
                inputs.append(h.make_tensor_value_info(name, self.kv_elem, self.cache_dims(nkv, d, new=False)))
            for name in (C.new_key(i), C.new_value(i)):
                outputs.append(h.make_tensor_value_info(name, self.kv_elem, self.cache_dims(nkv, d, new=True)))
        return inputs, outputs

    def cache_dims(self, nkv: int, d: int, new: bool) -> list:
        """A layer's cache input (new=False) or output's dims: GroupQueryAttention shares one
        [B, Hkv, S_max, D] slab between them."""
        return ["batch", nkv, "max_seq", d]

    def attention_shared(self):
        """seqlens, total length and the tree mask's bias every layer shares; the rotary tables."""
        cfg, max_context = self.cfg, self.o.max_context
        # a padded graph's attention spans one column more (GroupQueryAttention wants a rotary
        # table row per column, though the dummy row takes the last row's position)
        max_context += int(self.o.pad_row)
        rotary, rotary_local = _rotaries(self.w)
        masked = FP16_MASKED if self.attn_np == np.float16 else np.finfo(np.float32).min
        seqlens, total, bias = attention_inputs(
            self.node, self.init, cfg.head_dim, cfg.rope_theta, max_context, self.attn_np, masked, rotary=rotary
        )
        self.local = window_bias(self.node, self.init, cfg.sliding_window) if cfg.sliding_window > 0 else None
        # Gemma 3 (models/gemma3.py): norms multiply by 1 + w, embeddings scaled by sqrt(H), a norm on
        # the attention output and on the MLP output, tanh GELU, its own attention scale, and the
        # sliding layers rotate with their own RoPE base (tables "cos_cache_local" / "sin_cache_local")
        if self.gemma:
            for kind, table in zip(("cos", "sin"), rope_tables(cfg.head_dim, 0.0, max(max_context, 1), rotary_local)):
                self.init(f"{kind}_cache_local", table.astype(self.attn_np))
        return seqlens, total, bias

    def embed(self) -> str:
        self.emb = self.weight("embed_tokens", self.w.get("model.embed_tokens.weight"))
        x = self.node("Gather", [self.emb, C.INPUT_IDS], ["x0"], axis=0)
        if self.gemma:  # the scale rounded to float32, as the module multiplies it
            scale = np.array(self.cfg.hidden_size**0.5, np.float32).astype(self.act_np)
            x = self.node("Mul", [x, self.init("embed_scale", scale)], ["x0_scaled"])
        return x

    def attention(self, i: int, normed: str, seqlens, total, bias) -> str:
        """Layer i's attention output (before o_proj)."""
        from onnx import TensorProto as TP

        cfg, p = self.cfg, f"model.layers.{i}."
        qkv = self.matmul(normed, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], f"l{i}.qkv")
        if cfg.attention_bias:
            bqkv = np.concatenate([self.w.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            qkv = self.node("Add", [qkv, self.weight(f"l{i}.qkv_b", bqkv)], [f"l{i}.qkv_biased"])
        if cfg.qk_norm:
            qkv = qk_norm(self.node, self.init, qkv, i, self.w.get, cfg, float(self.one), self.act_np)
        cast = self.attn_np != self.act_np  # an fp16 cache beside fp32 activations
        if cast:
            qkv = self.node("Cast", [qkv], [f"l{i}.qkv_h"], to=TP.FLOAT16)
        b_i = self.local if cfg.is_sliding(i) else bias
        rope = "_local" if self.gemma and cfg.is_sliding(i) else ""
        out = f"l{i}.attn_h" if cast else f"l{i}.attn"
        attn = gqa_node(
            self.node, qkv, i, out, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seqlens, total, b_i, rope, cfg.attn_scale
        )
        return self.node("Cast", [attn[0]], [f"l{i}.attn"], to=TP.FLOAT) if cast else attn[0]

    def mlp(self, i: int, x: str) -> str:
        cfg, p = self.cfg, f"model.layers.{i}."
        # gate and up in one product, as q/k/v: one MatMulNBits and one offset correction
        gate_up = self.matmul(x, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], f"l{i}.gate_up")
        split = self.init(f"l{i}.gate_up_split", np.array([cfg.intermediate_size] * 2, np.int64))
        gate, up = self.node("Split", [gate_up, split], [f"l{i}.gate", f"l{i}.up"], axis=-1)
        if cfg.mlp_bias:
            gate = self.node("Add", [gate, self.weight(f"l{i}.gate_b", self.w.get(p + "mlp.gate_proj.bias"))], [f"l{i}.gate_b_out"])
            up = self.node("Add", [up, self.weight(f"l{i}.up_b", self.w.get(p + "mlp.up_proj.bias"))], [f"l{i}.up_b_out"])
        if self.gemma:
            gated = self.node("Gelu", [gate], [f"l{i}.gelu"], approximate="tanh")
        else:
            gated = self.node("Mul", [gate, self.node("Sigmoid", [gate], [f"l{i}.sig"])], [f"l{i}.silu"])
        act = self.node("Mul", [gated, up], [f"l{i}.act"])
        down = self.matmul(act, [p + "mlp.down_proj.weight"], f"l{i}.down")
        if cfg.mlp_bias:
            down = self.node("Add", [down, self.weight(f"l{i}.down_b", self.w.get(p + "mlp.down_proj.bias"))], [f"l{i}.down_b_out"])
        if self.gemma:
            down = self.rms(down, p + "post_feedforward_layernorm.weight", f"l{i}.down_normed")
        return down

    def skip_norm(self, x: str, residual: str, hf_norm: str, out: str) -> tuple[str, str]:
        """(RMSNorm(x + residual), x + residual) in one SkipSimplifiedLayerNormalization."""
        res = self.node(
            "SkipSimplifiedLayerNormalization",
            [x, residual, self.gamma(hf_norm, out + "_w")],
            [out + "ed", "", "", out + "_res"],
            domain="com.microsoft",
            epsilon=self.eps,
        )
        return res[0], res[3]

    def layer(self, i: int, normed: str, residual: str, seqlens, total, bias) -> tuple[str, str]:
        """One decoder layer: (the next layer's normed input, the residual stream)."""
        p = f"model.layers.{i}."
        o = self.matmul(self.attention(i, normed, seqlens, total, bias), [p + "self_attn.o_proj.weight"], f"l{i}.o")
        mlp_norm = p + "post_attention_layernorm.weight"
        if self.gemma:
            o = self.rms(o, mlp_norm, f"l{i}.o_normed")
            mlp_norm = p + "pre_feedforward_layernorm.weight"
        normed2, residual = self.skip_norm(o, residual, mlp_norm, f"l{i}.post_norm")
        down = self.mlp(i, normed2)
        last = i == self.n_layers - 1
        nxt = "model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"
        return self.skip_norm(down, residual, nxt, f"l{i}.next_norm")

    def head(self, normed: str) -> str:
        """The logits [B, T, V] (the head's own blocks where it has them; a tied head is the embedding)."""
        cfg = self.cfg
        q = self.blocks(["lm_head.weight"])
        if q is not None and not isinstance(q, list):
            return self.nbits_matmul(normed, q, "lm_head")
        # Gemm with transB over the [B*T, H] rows
        head = self.emb if cfg.tie_embeddings else self.weight("lm_head", self.w.get("lm_head.weight"))
        self.init("c_rows", np.array([-1, cfg.hidden_size], np.int64))
        self.init("c_vocab", np.array([cfg.vocab_size], np.int64))
        rows = self.node("Reshape", [normed, "c_rows"], ["final_rows"])
        flat = self.node("Gemm", [rows, head], ["logits_rows"], transB=1)
        bt = self.node("Shape", [C.INPUT_IDS], ["bt_shape"])
        out_shape = self.node("Concat", [bt, "c_vocab"], ["logits_shape"], axis=0)
        return self.node("Reshape", [flat, out_shape], ["logits_raw"])

    def logits_outputs(self, logits: str) -> list:
        """Softcapping, float32 logits and (for a draft) the fused top-k outputs."""
        from onnx import TensorProto as TP
        from onnx import helper as h

        if self.half:
            logits = self.node("Cast", [logits], ["logits_f32"], to=TP.FLOAT)
        if self.cfg.final_softcap > 0:  # Gemma: tanh(logits / cap) * cap
            cap = self.init("c_softcap", np.array(self.cfg.final_softcap, np.float32))
            capped = self.node("Tanh", [self.node("Div", [logits, cap], ["logits_div"])], ["logits_tanh"])
            logits = self.node("Mul", [capped, cap], ["logits_capped"])
        self.node("Identity", [logits], [C.LOGITS])
        topk = self.o.topk
        if not topk:
            return []
        lse = self.node("ReduceLogSumExp", [logits, self.init("c_axes_last", np.array([-1], np.int64))], ["lse"], keepdims=1)
        lp = self.node("Sub", [logits, lse], ["logprobs"])
        self.init("c_k", np.array([topk], np.int64))
        self.node("TopK", [lp, "c_k"], [C.TOPK_LOGPROBS, C.TOPK_IDS], axis=-1, largest=1, sorted=1)
        return [
            h.make_tensor_value_info(C.TOPK_LOGPROBS, TP.FLOAT, ["batch", "tokens", topk]),
            h.make_tensor_value_info(C.TOPK_IDS, TP.INT64, ["batch", "tokens", topk]),
        ]

    def features(self, feats: dict[int, str]) -> list:
        """The `hidden_states` output (the inputs of the feature layers, concatenated, float32)."""
        from onnx import TensorProto as TP
        from onnx import helper as h

        layers = [int(i) for i in self.o.feature_layers or []]
        if not layers:
            return []
        if any(not 0 <= i < self.n_layers for i in layers):
            raise InputError(f"feature layers {layers} are outside the model's {self.n_layers} layers")
        parts = [feats[i] for i in layers]
        out = C.HIDDEN_STATES + "_h" if self.half else C.HIDDEN_STATES
        self.node("Concat", parts, [out], axis=-1) if len(parts) > 1 else self.node("Identity", parts, [out])
        if self.half:
            self.node("Cast", [out], [C.HIDDEN_STATES], to=TP.FLOAT)
        return [h.make_tensor_value_info(C.HIDDEN_STATES, TP.FLOAT, ["batch", "tokens", len(layers) * self.cfg.hidden_size])]


def concat_nbits(parts: list):
    """MatMulNBits blocks of several layers with one input as one product (concatenated along N)."""
    from .quantize import NBits

    q0 = parts[0]
    if len(parts) == 1:
        return q0
    zps = [q.zero_points for q in parts]
    offsets = None if q0.offsets is None else np.concatenate([q.offsets for q in parts])
    return NBits(
        np.concatenate([q.blob for q in parts]),
        np.concatenate([q.scales for q in parts]),
        None if all(z is None for z in zps) else np.concatenate([q.packed_zero_points() for q in parts]),
        q0.bits, sum(q.n for q in parts), q0.k, q0.source, offsets, q0.block,
    )  # fmt: skip


def build_gqa_model(
    module,
    max_context: int,
    topk: int = 0,
    linears=None,
    accuracy_level: int = 0,
    feature_layers: list[int] | None = None,
    kv_dtype: str = "fp32",
    *,
    dtype: str = "fp32",
    n_layers: int | None = None,
    sink=None,
):
    """An onnx.ModelProto of a module (models/llama.LlamaDecoder) or of a `Weights` source
    (export/weights.py) in the "bhsd" contract; see GraphOptions and GQAGraph."""
    from .weights import ModuleWeights

    weights = module if hasattr(module, "get") and hasattr(module, "release") else ModuleWeights(module)
    cfg = weights.config
    why_not = gqa_unsupported(cfg, dtype)
    if why_not:
        raise InputError(f"--attention gqa: {why_not} (use --attention onnx)")
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"unknown --kv-dtype {kv_dtype!r} (expected one of {', '.join(KV_DTYPES)})")
    opts = GraphOptions(max_context, topk, accuracy_level, feature_layers, kv_dtype, dtype, n_layers)
    return GQAGraph(weights, opts, linears, sink).build()


def save_model(model, path: str | Path) -> list[str]:
    """Write the model; weights go to `<name>.data` when the protobuf would pass 2 GiB.
    Returns the external-data file names."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    path = Path(path)
    written = sorted({e.value for t in model.graph.initializer if uses_external_data(t) for e in t.external_data if e.key == "location"})
    if written:  # an ExternalDataSink wrote the weights already
        onnx.save(model, str(path))
        return written
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
