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
                                  MatMulNBits' fast kernels need integer zero points (measured,
                                  576x1536 at T = 1: 42 us with uint8 zero points, 811 us float);
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
GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


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

    def packed_zero_points(self) -> np.ndarray:
        """The zero points as MatMulNBits stores them, the default (2^(bits-1)) written out where
        the layer has none."""
        nb = self.k // BLOCK
        if self.zero_points is not None:
            return self.zero_points
        if self.bits == 8:
            return np.full(self.n * nb, 128, np.uint8)
        return np.full(self.n * ((nb + 1) // 2), 0x88, np.uint8)

    def zero_point_values(self) -> np.ndarray:
        """Zero points [N, K/block] as numbers."""
        nb = self.k // BLOCK
        if self.zero_points is None:
            return np.full((self.n, nb), 2 ** (self.bits - 1), np.float32)
        if self.bits == 8:
            return self.zero_points.reshape(self.n, nb).astype(np.float32)
        zp = self.zero_points.reshape(self.n, -1)
        return np.stack([zp & 0x0F, zp >> 4], -1).reshape(self.n, -1)[:, :nb].astype(np.float32)

    def dequantize(self) -> np.ndarray:
        """The float weight [N, K] these blocks compute with."""
        nb = self.k // BLOCK
        if self.bits == 4:
            lo, hi = self.blob & 0x0F, self.blob >> 4
            q = np.stack([lo, hi], -1).reshape(self.n, nb, BLOCK).astype(np.float32)
        else:
            q = self.blob.reshape(self.n, nb, BLOCK).astype(np.float32)
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
    raise InputError(f"GGUF tensor type {qtype} cannot be carried over as blocks (Q4_0, Q4_1, Q8_0 can)")


def _row_permutation(n_rows: int, n_head: int) -> np.ndarray:
    """Index order that undoes llama.cpp's attn_q/attn_k row permutation."""
    from arborspec.models.gguf_loader import reverse_permute

    return reverse_permute(np.arange(n_rows)[:, None], n_head)[:, 0]


class GGUFBlocks:
    """The block-quantised linear weights of a Llama-family GGUF, by Hugging Face name."""

    def __init__(self, path: str, n_heads: int, n_kv_heads: int):
        from gguf import GGUFReader

        self.path = str(path)
        self.reader = GGUFReader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        from arborspec.models.gguf_loader import PERMUTED_ARCHS

        arch = self.reader.fields.get("general.architecture")
        self.permuted = arch is None or arch.contents() in PERMUTED_ARCHS

    def _gguf_name(self, hf_name: str) -> str:
        if hf_name == "lm_head.weight":
            return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        if hf_name == "model.embed_tokens.weight":
            return "token_embd.weight"
        parts = hf_name.split(".")  # model.layers.{i}.<rest>
        rest = ".".join(parts[3:])
        if parts[:2] != ["model", "layers"] or rest not in GGUF_LAYER_NAMES:
            raise KeyError(hf_name)
        return f"blk.{parts[2]}.{GGUF_LAYER_NAMES[rest]}"

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
