"""Weight-only quantised linear layers for ONNX Runtime (com.microsoft MatMulNBits).

Role in one decode step: none at run time; it decides what the verify and draft calls of every
step multiply with. Two sources:

* a GGUF whose tensors are already block-quantised (Q4_0, Q4_1, Q8_0: the shipped SmolLM2 is
  Q4_1 with a Q8_0 embedding): its blocks are carried over as they are, so the export computes
  with exactly the GGUF's weights (no second rounding). MatMulNBits computes
  w = scale * (q - zero_point) per block of 32 along the input dimension:
    Q4_0  w = d * (q - 8)      -> scale d, zero point 8 (4 bits)
    Q4_1  w = d * q + m        -> scale d, zero point 8, and the block offsets m + 8 d added as
                                  x_block_sums @ M (M [N, K/32]: one small MatMul). Exact, and
                                  MatMulNBits' fast kernels need integer zero points (float
                                  ones take a path many times slower: docs/int4.md);
                                  zero point 8 rather than 0: see q4_1_offsets
    Q8_0  w = d * q, q int8    -> q + 128 as uint8, scale d, zero point 128 (8 bits)
  The nibble order differs: a GGUF Q4 block stores element j in the low nibble and element
  j + 16 in the high nibble of byte j; MatMulNBits stores elements 2i / 2i+1 in byte i.
  llama.cpp's converter permutes the rows of attn_q / attn_k (RoPE layout): rows are output
  channels and blocks run along the input, so undoing it is a row permutation of whole blocks.
* float weights (Hugging Face folders, nanoGPT): ONNX Runtime's own MatMulNBitsQuantizer
  (blockwise round-to-nearest) over the exported graph's MatMuls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from arborspec.runtime.errors import InputError

BLOCK = 32


@dataclass
class NBits:
    """One linear layer in MatMulNBits form: blob [N, K/block, block*bits/8] uint8, scales
    [N * K/block] float32, zero points [N * K/block] (float32 for 4 bits, uint8 for 8 bits; None:
    symmetric), and where it came from."""

    blob: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None  # uint8; 4 bits: two per byte (low nibble first), per row
    bits: int
    n: int
    k: int
    source: str
    offsets: np.ndarray | None = None  # [N, K/block] float32 added per block (Q4_1's m), or None
    block: int = BLOCK  # elements per block along K (GGUF: 32; Q6_K's sub-blocks: 16)

    def packed_zero_points(self) -> np.ndarray:
        """The zero points as MatMulNBits stores them, the default (2^(bits-1)) written out where
        the layer has none."""
        nb = self.k // self.block
        if self.zero_points is not None:
            return self.zero_points
        if self.bits == 8:
            return np.full(self.n * nb, 128, np.uint8)
        return np.full(self.n * ((nb + 1) // 2), 0x88, np.uint8)

    def zero_point_values(self) -> np.ndarray:
        """Zero points [N, K/block] as numbers."""
        nb = self.k // self.block
        if self.zero_points is None:
            return np.full((self.n, nb), 2 ** (self.bits - 1), np.float32)
        if self.bits == 8:
            return self.zero_points.reshape(self.n, nb).astype(np.float32)
        zp = self.zero_points.reshape(self.n, -1)
        return np.stack([zp & 0x0F, zp >> 4], -1).reshape(self.n, -1)[:, :nb].astype(np.float32)

    def dequantize(self) -> np.ndarray:
        """The float weight [N, K] these blocks compute with."""
        nb, bs = self.k // self.block, self.block
        if self.bits == 4:
            lo, hi = self.blob & 0x0F, self.blob >> 4
            q = np.stack([lo, hi], -1).reshape(self.n, nb, bs).astype(np.float32)
        else:
            q = self.blob.reshape(self.n, nb, bs).astype(np.float32)
        zp = self.zero_point_values()[..., None]
        w = self.scales.reshape(self.n, nb, 1) * (q - zp)
        if self.offsets is not None:
            w = w + self.offsets.reshape(self.n, nb, 1)
        return w.reshape(self.n, self.k)


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    return raw[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _pack4(q: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 -> [..., 16] bytes, elements 2i / 2i+1 in the low / high nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def q4_1_offsets(d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, int]:
    """Q4_1's w = d * q + m as MatMulNBits' d * (q - 8) plus the block offset m + 8 d: the same
    weights (m + 8 d is kept only where float32 holds it exactly; else zero point 0 and offset m).
    Centring matters with int8 activations (accuracy level 4): MatMulNBits rounds x to int8 for the
    q-part while the offsets use x's exact block sums, so the rounding error of x meets the q-part's
    per-block mean (7.5 d with zero point 0) uncancelled. Measured on SmolLM2-135M layer 10 (real
    activations): 2.2-2.4x lower relative output error with zero point 8 (q_proj 2.28e-2 -> 1.02e-2),
    and held-out perplexity 39.56 -> 38.59 (fp32 38.43, llama.cpp on the same GGUF 38.58)."""
    shifted = m.astype(np.float64) + 8.0 * d.astype(np.float64)
    if np.array_equal(shifted.astype(np.float32).astype(np.float64), shifted):
        return shifted.astype(np.float32), 8
    return m.astype(np.float32), 0


def nbits_from_gguf(raw: np.ndarray, qtype: str, n: int, k: int) -> NBits:
    """GGUF rows [N, bytes] of a Q4_0 / Q4_1 / Q8_0 tensor -> MatMulNBits blocks (exact)."""
    if k % BLOCK:
        raise InputError(f"input size {k} is not a multiple of the GGUF block size {BLOCK}")
    nb = k // BLOCK
    if qtype in ("Q4_0", "Q4_1"):
        bsz = 18 if qtype == "Q4_0" else 20
        blocks = raw.reshape(n, nb, bsz)
        d = _f16(blocks, 0)
        qs = blocks[..., bsz - 16 :]
        q = np.concatenate([qs & 0x0F, qs >> 4], -1)  # GGUF: low nibbles are 0..15, high 16..31
        zp, offsets = None, None  # no zero points: MatMulNBits' default 8 (2.5 MB less to read per token)
        if qtype == "Q4_1":
            offsets, zp_nibble = q4_1_offsets(d, _f16(blocks, 2))
            if zp_nibble != 8:
                zp = np.full(n * ((nb + 1) // 2), zp_nibble | (zp_nibble << 4), np.uint8)
        return NBits(_pack4(q), d.reshape(-1), zp, 4, n, k, f"gguf-{qtype.lower()}", offsets)
    if qtype == "Q8_0":
        blocks = raw.reshape(n, nb, 34)
        d = _f16(blocks, 0)
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        # 8-bit MatMulNBits: q + 128 as uint8 with its default zero point 128 (none stored)
        return NBits(q.astype(np.uint8), d.reshape(-1), None, 8, n, k, "gguf-q8_0")
    if qtype in KQUANTS:
        return nbits_from_kquant(raw, qtype, n, k)
    raise InputError(f"GGUF tensor type {qtype} cannot be carried over as blocks ({', '.join(CARRIED)} can)")


QK_K = 256  # a K-quant super-block
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
CARRIED = ("Q4_0", "Q4_1", "Q8_0") + KQUANTS


def _kquant_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 bytes of 6-bit scales and mins of a super-block's 8 sub-blocks ->
    (sc, m) [..., 8] (the `gguf` package's unpacking)."""
    from gguf.quants import Q4_K

    lead = scales.shape[:-1]
    sc, m = Q4_K.get_scale_min(scales.reshape(-1, 12))
    return sc.reshape(*lead, 8), m.reshape(*lead, 8)


def _centred(scale: np.ndarray, minus: np.ndarray, zp: int) -> tuple[np.ndarray, int]:
    """w = scale * q - minus as scale * (q - zp) + offset, offset = zp * scale - minus, where float32
    holds the offset exactly (else zero point 0, offset -minus): see q4_1_offsets."""
    shifted = zp * scale.astype(np.float64) - minus.astype(np.float64)
    if np.array_equal(shifted.astype(np.float32).astype(np.float64), shifted):
        return shifted.astype(np.float32), zp
    return (-minus).astype(np.float32), 0


def nbits_from_kquant(raw: np.ndarray, qtype: str, n: int, k: int) -> NBits:
    """GGUF rows [N, bytes] of a Q4_K / Q5_K / Q6_K tensor -> MatMulNBits blocks with exactly its
    weights. Q4_K (w = d sc q - dmin m per 32-element sub-block, q 4 bits) is Q4_1's form: 4-bit
    blocks of 32 with offsets. Q5_K (q 5 bits) goes into 8-bit blocks of 32 with offsets. Q6_K
    (w = d sc (q - 32), q 6 bits, int8 scales per 16 elements) is 8-bit blocks of 16 with zero
    point 32: no offsets. (8 bits for 5- and 6-bit weights: MatMulNBits has no 5- or 6-bit form.)"""
    if k % QK_K:
        raise InputError(f"input size {k} is not a multiple of the K-quant super-block size {QK_K}")
    ns = k // QK_K
    if qtype == "Q6_K":
        blocks = raw.reshape(n, ns, 210)
        ql, qh = blocks[..., :128].reshape(n, ns, 2, 64), blocks[..., 128:192].reshape(n, ns, 2, 32)
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [n, ns, 16]
        d = _f16(blocks, 208)[..., None]
        lo = np.stack([ql & 0x0F, ql >> 4], 3).reshape(n, ns, 2, 4, 32)  # [.., half, quarter, 32]
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 3)  # [n, ns, half, 4, 32]
        q = (lo | (hi << 4)).reshape(n, k // 16, 16).astype(np.uint8)
        zp = np.full(n * (k // 16), 32, np.uint8)
        return NBits(q, (d * sc).reshape(-1).astype(np.float32), zp, 8, n, k, "gguf-q6_k", None, 16)
    size = 144 if qtype == "Q4_K" else 176
    blocks = raw.reshape(n, ns, size)
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc, m = _kquant_scales(blocks[..., 4:16])
    scale = (d * sc.astype(np.float32)).astype(np.float32)  # [n, ns, 8]: as ggml computes it
    minus = (dmin * m.astype(np.float32)).astype(np.float32)
    qs = blocks[..., size - 128 :].reshape(n, ns, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], 3).reshape(n, ns, 8, 32)  # sub-block 2c: low nibbles, 2c+1: high
    if qtype == "Q5_K":
        qh = blocks[..., 16:48]  # bit j of byte l: the fifth bit of sub-block j's element l
        q = q | (np.stack([(qh >> j) & 1 for j in range(8)], 2) << 4)
        offsets, zp = _centred(scale, minus, 16)
        zps = np.full(n * (k // BLOCK), zp, np.uint8)
        return NBits(q.reshape(n, k // BLOCK, BLOCK).astype(np.uint8), scale.reshape(-1), zps, 8, n, k, "gguf-q5_k",
                     offsets.reshape(n, -1))
    offsets, zp = _centred(scale, minus, 8)
    zps = None if zp == 8 else np.full(n * ((k // BLOCK + 1) // 2), zp | (zp << 4), np.uint8)
    return NBits(_pack4(q.reshape(n, k // BLOCK, BLOCK)), scale.reshape(-1), zps, 4, n, k, "gguf-q4_k",
                 offsets.reshape(n, -1))


def _row_permutation(n_rows: int, n_head: int) -> np.ndarray:
    """Index order that undoes llama.cpp's attn_q/attn_k row permutation."""
    from arborspec.models.gguf_loader import reverse_permute

    return reverse_permute(np.arange(n_rows)[:, None], n_head)[:, 0]


class GGUFBlocks:
    """The block-quantised linear weights of a Llama-family GGUF, by Hugging Face name."""

    def __init__(self, source, n_heads: int, n_kv_heads: int):
        from gguf import GGUFReader

        self.reader = source if isinstance(source, GGUFReader) else GGUFReader(str(source))
        self.path = str(getattr(self.reader.data, "filename", None) or source)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.fused = "blk.0.attn_qkv.weight" in self.tensors  # Phi-3's fused q/k/v
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        from arborspec.models.gguf_loader import PERMUTED_ARCHS

        arch = self.reader.fields.get("general.architecture")
        self.permuted = arch is None or arch.contents() in PERMUTED_ARCHS

    def _gguf_name(self, hf_name: str) -> str:
        """models/gguf_loader.gguf_name, but a tied head (no output.weight) reads the embedding."""
        from arborspec.models.gguf_loader import gguf_name

        if hf_name == "lm_head.weight" and "output.weight" not in self.tensors:
            return "token_embd.weight"
        return gguf_name(hf_name)

    def tensor(self, hf_name: str):
        """The GGUF tensor of a Hugging Face name, or None; KeyError for a name with no GGUF twin."""
        return self.tensors.get(self._gguf_name(hf_name))

    def linear(self, hf_name: str) -> NBits | None:
        """MatMulNBits blocks of one weight ([out, in] in Hugging Face orientation), or None when
        the GGUF holds it as floats (F32/F16/BF16)."""
        t = self.tensors.get(self._gguf_name(hf_name))
        if t is None:
            raise InputError(f"{self.path}: no tensor for {hf_name}")
        qtype = t.tensor_type.name
        if qtype in ("F32", "F16", "BF16"):
            return None
        k, n = (int(x) for x in t.shape[:2])  # GGUF shapes are [in, out]
        raw = np.asarray(t.data).reshape(n, -1)
        if self.permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = self.n_heads if ".attn_q." in t.name else self.n_kv_heads
            raw = raw[_row_permutation(n, heads)]
        return nbits_from_gguf(raw, qtype, n, k)


def quantize_float_model(model, bits: int = 4, block_size: int = 32, accuracy_level: int | None = None):
    """ONNX Runtime's blockwise round-to-nearest MatMulNBits quantisation of every MatMul with a
    constant weight (the float-weights path)."""
    MatMulNBitsQuantizer = _quiet_quantizer()
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=False, accuracy_level=accuracy_level)
    q.process()
    return q.model.model


def _quiet_quantizer():
    """ONNX Runtime's MatMulNBitsQuantizer class, without its console chatter: importing its module
    calls `logging.basicConfig(level=INFO)` (a stderr handler on the root logger) and it logs two
    INFO lines per quantised MatMul, which would land in the middle of `arborspec export`'s
    progress bar. The root logger gets back its handlers and level; ONNX Runtime's quantisation loggers
    keep warnings and errors."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer
