"""Portable blockwise QDQ weights: standard ONNX DequantizeLinear feeding a plain MatMul.

Role in one decode step: none at run time; it decides what the verify and draft calls multiply
with when an export is made with `--quantize int4|int8 --format qdq` (the alternative to ONNX
Runtime's com.microsoft MatMulNBits, which TensorRT cannot parse). Each linear layer of the
portable graph (`--attention onnx`, torch.onnx.export) becomes

    DequantizeLinear(q int4|int8 [K, N], scale [K/block, N], axis=0, block_size=block)  (opset 21+)
      -> MatMul(x, .)

with a zero point of 0 (omitted): TensorRT (tensorrt_rtx 1.7, measured) parses signed int4 and
int8 blocked DequantizeLinear, refuses any non-zero zero point ("Non-zero zero point is not
supported") and refuses uint4 / uint8 weights. So every form here is symmetric:

* GGUF blocks, exactly (the source's own weights, no second rounding):
    Q4_0  w = d * (q - 8)    -> int4 q - 8, scale d
    Q8_0  w = d * q          -> int8 q, scale d
    Q4_1  w = d * q + m      -> int4 q - 8, scale d, plus a per-block offset c = m + 8d added as
                                (sums of x over each block) @ C: one small extra MatMul, exact
                                whenever m + 8d is representable in the weights' float type
                                (checked per tensor; where it is not, that tensor keeps q as
                                int8 (0..15) with offset m: still exact, twice the bytes)
  `--quantize int8` widens Q4 blocks into int8 containers (the same values).
* float weights: blockwise symmetric round-to-nearest (the rule of ONNX Runtime's MLAS
  symmetric quantiser): per block, the value v of largest magnitude gives scale = v / -2^(b-1),
  q = clip(round(w / scale), -2^(b-1), 2^(b-1) - 1).

The embedding Gather stays float; every MatMul with a constant 2-D weight (the layers' linears
and the LM head) is rewritten; one whose input size is not a multiple of the block stays float,
and so does a tied head that reads the embedding's own initializer through a Transpose (see
apply_qdq).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from arborspec.runtime.errors import InputError

from .quantize import BLOCK, NBits

QDQ_MIN_OPSET = 21


@dataclass
class QDQ:
    """One linear layer in QDQ form, Hugging Face orientation: q [N, K] int8 holding int4
    (-8..7) or int8 values, scales [N, K/block], optional per-block offsets [N, K/block]."""

    q: np.ndarray
    scales: np.ndarray
    bits: int
    block: int
    source: str
    offsets: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    def dequantize(self) -> np.ndarray:
        """The float weight [N, K] this layer computes with (in the scales' dtype)."""
        nb = self.k // self.block
        q = self.q.reshape(self.n, nb, self.block).astype(self.scales.dtype)
        w = q * self.scales.reshape(self.n, nb, 1)
        if self.offsets is not None:
            w = w + self.offsets.reshape(self.n, nb, 1)
        return w.reshape(self.n, self.k)


def _exact_in(x64: np.ndarray, dtype) -> bool:
    return bool(np.array_equal(x64.astype(dtype).astype(np.float64), x64))


def qdq_from_nbits(nb: NBits, bits: int, dtype=np.float32) -> QDQ:
    """A GGUF layer's MatMulNBits blocks (quantize.nbits_from_gguf) -> the same weights as
    symmetric QDQ blocks of `bits` (4 or 8), exactly."""
    nblk = nb.k // BLOCK
    if nb.bits == 4:
        q = np.stack([nb.blob & 0x0F, nb.blob >> 4], -1).reshape(nb.n, nblk, BLOCK).astype(np.int16)
    else:
        q = nb.blob.reshape(nb.n, nblk, BLOCK).astype(np.int16)
    zp = nb.zero_point_values().astype(np.int16)
    scales = nb.scales.reshape(nb.n, nblk)
    offsets = nb.offsets
    if offsets is not None and nb.bits == 4:
        # Q4_1 (quantize.q4_1_offsets folds a zero point into the offset): q stays 0..15 with the
        # offset m (exact in float64); below it is centred again where `dtype` holds m + 8d
        offsets = offsets.astype(np.float64) - zp * scales.astype(np.float64)
    else:
        q = q - zp[..., None]  # w = scale * q (+ offset)
    if not _exact_in(scales.astype(np.float64), dtype):
        raise InputError(f"{nb.source}: the block scales do not fit {np.dtype(dtype).name} exactly")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if offsets is not None and bits == 4 and q.min() >= 0 and q.max() <= 15:
        # Q4_1: q in 0..15 -> q - 8 in int4, the offset becomes m + 8d (if exactly representable)
        shifted = offsets.astype(np.float64) + 8.0 * scales.astype(np.float64)
        if _exact_in(shifted, dtype):
            q, offsets = q - 8, shifted.astype(dtype)
        else:
            bits, lo, hi = 8, -128, 127
    if offsets is not None and not _exact_in(offsets.astype(np.float64), dtype):
        raise InputError(f"{nb.source}: the block offsets do not fit {np.dtype(dtype).name} exactly")
    if q.min() < lo or q.max() > hi:
        raise InputError(f"{nb.source}: block values {q.min()}..{q.max()} do not fit int{bits}")
    return QDQ(
        q.reshape(nb.n, nb.k).astype(np.int8),
        scales.astype(dtype),
        bits,
        BLOCK,
        nb.source,
        None if offsets is None else offsets.astype(dtype),
    )


def qdq_round_to_nearest(w: np.ndarray, bits: int, block: int, dtype=np.float32) -> QDQ | None:
    """Float weight [N, K] -> symmetric blockwise QDQ (None when K is not a multiple of block)."""
    n, k = w.shape
    if k % block:
        return None
    w = w.astype(np.float32).reshape(n, k // block, block)
    idx = np.abs(w).argmax(-1)[..., None]
    v = np.take_along_axis(w, idx, -1)[..., 0]  # the signed value of largest magnitude
    scale = (v / -float(2 ** (bits - 1))).astype(dtype).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, 1.0 / scale, 0.0).astype(np.float32)
    q = np.clip(np.rint(w * inv[..., None]), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return QDQ(q.reshape(n, k).astype(np.int8), scale.astype(dtype), bits, block, f"rtn-int{bits}")


def weight_key(w_in_out: np.ndarray) -> str:
    """Identity of a MatMul weight [K, N] (the transposed nn.Linear weight) by content."""
    a = np.ascontiguousarray(w_in_out)
    return f"{a.dtype}:{a.shape}:" + hashlib.sha256(a.tobytes()).hexdigest()


def _int4_tensor(name: str, q_kn: np.ndarray):
    from onnx import TensorProto, helper

    flat = (q_kn.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    packed = flat[0::2] | (flat[1::2] << 4)  # element 2i in the low nibble (ONNX's order)
    return helper.make_tensor(name, TensorProto.INT4, list(q_kn.shape), packed.tobytes(), raw=True)


def apply_qdq(model, layer_for, block: int, shared_heads: bool = False) -> dict:
    """Rewrite, in place, every MatMul of `model` whose second input is a constant 2-D float
    initializer W [K, N]: `layer_for(W) -> QDQ | None` gives its blocks (None: stays float).
    A MatMul that reads an initializer through Transpose(perm=[1, 0]) while other nodes read the
    initializer too (a tied LM head sharing the embedding the Gather needs in float) stays float
    unless shared_heads: a quantised copy would add memory, not save it, and ONNX Runtime runs an
    8-bit head slowly (measured: 134 ms of a 171 ms SmolLM2 step, vs about 3 ms in float).
    Returns counts {"layers_by_source": {...}, "layers_by_type": {...}, "kept_float": n,
    "kept_float_shared": n}."""
    from onnx import TensorProto, numpy_helper

    g = model.graph
    _check_qdq_opset(model)
    inits = {t.name: t for t in g.initializer}
    transposed = _transposed_initializers(g, inits)
    readers: dict[str, int] = {}
    for nd in g.node:
        for i in nd.input:
            readers[i] = readers.get(i, 0) + 1
    shared = 0
    by_source: dict[str, int] = {}
    by_type: dict[str, int] = {}
    kept = 0
    done: dict[str, str] = {}  # initializer name -> dequantised tensor name
    new_nodes = []
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16)
    for nd in g.node:
        w_name = nd.input[1] if nd.op_type == "MatMul" and len(nd.input) == 2 else None
        src_name = transposed.get(w_name, w_name) if w_name else None
        t = inits.get(src_name) if src_name else None
        if t is None or len(t.dims) != 2 or t.data_type not in floats:
            new_nodes.append(nd)
            continue
        if w_name in done:
            nd.input[1] = done[w_name]
            new_nodes.append(nd)
            continue
        if src_name != w_name and readers.get(src_name, 0) > 1 and not shared_heads:
            shared += 1
            new_nodes.append(nd)
            continue
        w = numpy_helper.to_array(t)
        if src_name != w_name:
            w = np.ascontiguousarray(w.T)
        q = layer_for(w)
        if q is None:
            kept += 1
            new_nodes.append(nd)
            continue
        if q.q.shape != (w.shape[1], w.shape[0]):
            raise InputError(f"{w_name}: blocks of shape {q.q.shape} for a weight {w.shape}")
        base = f"{w_name}_qdq"
        new_nodes.append(_dequantize_node(g, base, q, w.dtype))
        deq = base + ".w"
        done[w_name] = deq
        by_source[q.source] = by_source.get(q.source, 0) + 1
        by_type[f"int{q.bits}"] = by_type.get(f"int{q.bits}", 0) + 1
        nd.input[1] = deq
        if q.offsets is None:
            new_nodes.append(nd)
            continue
        new_nodes += _with_block_offsets(g, nd, base, q, w.dtype)
    _drop_unread(g, new_nodes, transposed)
    return {"layers_by_source": by_source, "layers_by_type": by_type, "kept_float": kept, "kept_float_shared": shared}


def _check_qdq_opset(model) -> None:
    """Blocked DequantizeLinear is opset 21: refuse an older graph in one line."""
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx") and op.version < QDQ_MIN_OPSET:
            raise InputError(
                f"--format qdq needs opset >= {QDQ_MIN_OPSET} (blocked DequantizeLinear); "
                f"this graph is opset {op.version}"
            )


def _transposed_initializers(g, inits: dict) -> dict[str, str]:
    """{Transpose output: initializer} for each Transpose(perm=[1, 0]) of a 2-D initializer."""
    # a weight also read elsewhere (a tied LM head: the embedding's Gather) reaches its MatMul
    # through Transpose(perm=[1, 0]) of the shared initializer
    return {
        nd.output[0]: nd.input[0]
        for nd in g.node
        if nd.op_type == "Transpose"
        and nd.input[0] in inits
        and len(inits[nd.input[0]].dims) == 2
        and [list(a.ints) for a in nd.attribute if a.name == "perm"] in ([[1, 0]], [])
    }


def _dequantize_node(g, base: str, q, dtype):
    """Add the blocks `q` as initializers `<base>.q` / `<base>.scale`; the DequantizeLinear
    node that rebuilds the [K, N] weight as `<base>.w`."""
    from onnx import helper, numpy_helper

    q_kn = np.ascontiguousarray(q.q.T)
    if q.bits == 4:
        g.initializer.append(_int4_tensor(base + ".q", q_kn))
    else:
        g.initializer.append(numpy_helper.from_array(q_kn.astype(np.int8), base + ".q"))
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(q.scales.T.astype(dtype)), base + ".scale"))
    return helper.make_node(
        "DequantizeLinear", [base + ".q", base + ".scale"], [base + ".w"], name=base + ".dq", axis=0, block_size=q.block
    )


def _with_block_offsets(g, nd, base: str, q, dtype) -> list:
    """The MatMul `nd` (already reading the dequantised weight) plus the nodes that add its
    per-block offsets; returns them in graph order."""
    from onnx import helper, numpy_helper

    # per-block offsets (GGUF Q4_1): y = x @ DQ(q) + (block sums of x) @ C, C [K/block, N]
    x, y = nd.input[0], nd.output[0]
    nblk = q.k // q.block
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(q.offsets.T.astype(dtype)), base + ".offset"))
    g.initializer.append(numpy_helper.from_array(np.array([nblk, q.block], np.int64), base + ".blk"))
    g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), base + ".axes"))
    nd.output[0] = base + ".main"
    return [
        nd,
        helper.make_node("Shape", [x], [base + ".xs"], name=base + ".shape", end=-1),
        helper.make_node("Concat", [base + ".xs", base + ".blk"], [base + ".bs"], name=base + ".concat", axis=0),
        helper.make_node("Reshape", [x, base + ".bs"], [base + ".xb"], name=base + ".reshape"),
        helper.make_node("ReduceSum", [base + ".xb", base + ".axes"], [base + ".xsum"], name=base + ".sum", keepdims=0),
        helper.make_node("MatMul", [base + ".xsum", base + ".offset"], [base + ".corr"], name=base + ".corr_mm"),
        helper.make_node("Add", [base + ".main", base + ".corr"], [y], name=base + ".add"),
    ]


def _drop_unread(g, new_nodes: list, transposed: dict) -> None:
    """Set the graph's nodes to `new_nodes`, less the Transposes and float weights nothing reads any more."""
    read = {i for nd in new_nodes for i in nd.input} | {o.name for o in g.output}
    new_nodes = [nd for nd in new_nodes if not (nd.output[0] in transposed and nd.output[0] not in read)]
    del g.node[:]
    g.node.extend(new_nodes)
    still = {i for nd in g.node for i in nd.input} | {o.name for o in g.output}
    keep = [t for t in g.initializer if t.name in still]
    del g.initializer[:]
    g.initializer.extend(keep)


def gguf_layer_lookup(module, gguf_path: str, bits: int, dtype=np.float32):
    """layer_for(W) for apply_qdq: the GGUF's blocks of the linear whose transposed weight is W
    (matched by content against the module's state dict; the module holds the GGUF's dequantised
    weights). Weights the GGUF holds as floats, or that match no linear, stay float."""
    from .quantize import GGUFBlocks

    cfg = module.config
    src = GGUFBlocks(gguf_path, cfg.n_heads, cfg.n_kv_heads)
    names: dict[str, str] = {}
    for name, t in module.state_dict().items():
        name = name.removeprefix("inner.")  # onnx_export.WithTopK wraps draft modules
        if t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "norm" not in name:
            names.setdefault(weight_key(t.detach().cpu().numpy().astype(dtype).T), name)

    def layer_for(w: np.ndarray) -> QDQ | None:
        name = names.get(weight_key(w))
        if name is None:
            return None
        try:
            nb = src.linear(name)
        except KeyError:
            return None
        return None if nb is None else qdq_from_nbits(nb, max(bits, nb.bits), dtype)

    return layer_for


def rtn_layer_lookup(bits: int, block: int, dtype=np.float32):
    """layer_for(W) for apply_qdq: blockwise symmetric round-to-nearest of float weights."""
    return lambda w: qdq_round_to_nearest(np.ascontiguousarray(w.T), bits, block, dtype)
