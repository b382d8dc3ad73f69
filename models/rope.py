"""Rotary position embeddings with the scaling types long-context checkpoints use.

Role in one decoding step: every target/draft call turns its `position_ids` (past_len + depth in
the tree: siblings share a position) into cos/sin tables here. The scaling is computed once into
the inverse frequencies (and one attention factor that multiplies cos and sin), so a token's
rotation depends on its own position only: a tree rotates exactly as vanilla decoding would, and
the ONNX graphs bake the same tables (export/gqa_graph.py) or trace this code (portable graph).

Types (Hugging Face's `rope_parameters` / `rope_scaling`, matched to transformers'
modeling_rope_utils): default, linear, llama3 (Llama 3.1/3.2/3.3), yarn (Qwen2.5/3 long
context, Mistral), longrope (Phi-3/3.5/4-mini). longrope keeps two sets of frequencies and picks
per position: `short_factor` below `original_max_position_embeddings`, `long_factor` from there
on (vLLM's rule). transformers instead picks one set for a whole call from the call's largest
position, so its outputs past the original context depend on how a sequence is split into calls;
per position they do not, which is what lets a tree reproduce vanilla decoding.
A GGUF of a Llama 3.1 model carries the llama3 scaling as llama.cpp's `rope_freqs` tensor (one
divisor per frequency): rope_type "freq_factors" with those divisors.
dynamic NTK is refused: it re-derives the frequencies from the longest sequence seen so far, so
cached keys would have been rotated with other frequencies than new ones.
"""

from __future__ import annotations

import math

import torch

from arborspec.runtime.errors import InputError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_dim(head_dim: int, scaling: dict | None) -> int:
    """How many leading channels of a head rotate (partial_rotary_factor, Phi-4-mini: 0.75)."""
    return int(head_dim * float((scaling or {}).get("partial_rotary_factor", 1.0)))


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    orig = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_position / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = s.get("attention_factor")
    if att is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        att = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(att)


def _longrope_factor(s: dict, max_position: int) -> float:
    orig = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_position / orig
    att = s.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return float(att)


class Rotary(torch.nn.Module):
    """position_ids [B, T] -> (cos, sin) [B, T, rope_dim], rotate-half convention, scaled.

    Buffers: inv_freq [rope_dim/2] (longrope: the short set) and inv_freq_long (longrope's long
    set, used from position `switch` on; equal to inv_freq otherwise, switch None)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None, max_position: int = 2048):
        super().__init__()
        s = dict(scaling or {})
        kind = s.get("rope_type", "default")
        if kind not in ROPE_TYPES + ("freq_factors",):
            raise InputError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        dim = rope_dim(head_dim, s)
        inv = _base_inv_freq(dim, theta)
        long_inv, self.switch, self.attention_factor = inv, None, 1.0
        if kind == "linear":
            inv = long_inv = inv / float(s["factor"])
        elif kind == "llama3":
            inv = long_inv = _llama3(inv, s)
        elif kind == "freq_factors":  # llama.cpp: theta_i = pos * inv_freq_i / rope_freqs_i
            inv = long_inv = inv / torch.tensor(s["factors"], dtype=torch.float32)
        elif kind == "yarn":
            inv, self.attention_factor = _yarn(dim, theta, s, max_position)
            long_inv = inv
        elif kind == "longrope":
            shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            inv = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * theta**shape)
            long_inv = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * theta**shape)
            self.switch = int(s["original_max_position_embeddings"])
            self.attention_factor = _longrope_factor(s, max_position)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("inv_freq_long", long_inv, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = position_ids[..., None]
        inv = self.inv_freq
        if self.switch is not None:  # longrope: the long set from the original context on
            inv = torch.where(pos >= self.switch, self.inv_freq_long, self.inv_freq)  # [B, T, dim/2]
        freqs = pos.float() * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    @torch.no_grad()
    def tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_position, rope_dim/2] for every position (the GroupQueryAttention graph's
        cos_cache / sin_cache): the same numbers forward() gives."""
        cos, sin = self.forward(torch.arange(max_position)[None])
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


def rope_scaling_from_hf(hf: dict, params: dict | None = None) -> dict | None:
    """The scaling part of a config.json's rope_parameters (transformers 5) or rope_scaling
    (transformers 4), with rope_type and original_max_position_embeddings filled in as
    transformers' standardize_rope_params does; None for default RoPE. Refuses what we cannot
    compute per position."""
    params = dict(params if params is not None else (hf.get("rope_parameters") or {}))
    params.update(hf.get("rope_scaling") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "su" or (hf.get("model_type") == "phi3" and kind == "yarn"):
        kind = "longrope"  # what Phi3Config itself makes of them
    if kind in ("dynamic", "ntk"):
        raise InputError(
            f"model_type {hf.get('model_type')!r}: rope scaling {kind!r} (dynamic NTK) is not supported: its "
            "frequencies depend on the longest sequence seen so far, so a tree cannot reproduce vanilla decoding"
        )
    if kind not in ROPE_TYPES:
        raise InputError(
            f"model_type {hf.get('model_type')!r}: unsupported rope scaling type {kind!r} "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    prf = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    out = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = kind
    if prf is not None and float(prf) != 1.0:
        out["partial_rotary_factor"] = float(prf)
    else:
        out.pop("partial_rotary_factor", None)
    if kind in ("llama3", "yarn", "longrope"):
        if hf.get("original_max_position_embeddings"):  # Phi-3 keeps it outside rope_scaling
            out["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        out.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return None if out == {"rope_type": "default"} else out
