"""Model configuration shared by every decoder family.

Role in one decoding step: none at run time; it describes the shapes (layers, heads, KV heads,
head dim, vocabulary) that the runtime uses to preallocate KV caches and that the export
writes into the ONNX metadata, so an export folder is self-describing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from arborspec.runtime.errors import InputError


def weight_counts(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int, tied: bool
) -> tuple[int, int]:
    """(one decoder layer's linear weights: q/k/v, o, gate/up/down; the embedding's and the
    head's, one matrix where tied) of a Llama-family shape, norms left out."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return hidden * (q + 2 * kv) + q * hidden + 3 * intermediate * hidden, vocab * hidden * (1 if tied else 2)


@dataclass
class ModelConfig:
    family: str  # "llama" (Llama, Qwen2/2.5/3, Mistral, Phi-3, SmolLM), "gemma3" or "gpt2" (GPT-2 / NanoGPT)
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    mlp_bias: bool = False
    bias: bool = True  # gpt2: biases in linear layers and layer norms
    rope_scaling: dict | None = None  # models/rope.py: rope_type + its parameters (None: default RoPE)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int = 0  # > 0: a query sees only keys less than this many positions before it
    layer_types: list[str] | None = None  # per layer "sliding_attention" / "full_attention" (None: all alike)
    rope_local_theta: float = 0.0  # Gemma 3: the sliding layers' RoPE base (0: rope_theta)
    attn_scale: float = 0.0  # Gemma 3: query_pre_attn_scalar ** -0.5 (0: head_dim ** -0.5)
    final_softcap: float = 0.0  # tanh softcapping of the logits (0: none)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in ("llama", "gemma3", "gpt2"):
            raise InputError(f"unknown model family {self.family!r} (expected llama, gemma3 or gpt2)")
        if self.n_heads % self.n_kv_heads:
            raise InputError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        if self.sliding_window <= 0:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def weight_counts(self) -> tuple[int, int]:
        """(one layer's linear weights, the embedding's and the head's): `weight_counts`."""
        return weight_counts(
            self.hidden_size,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
            self.tie_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def truncated(self, n_layers: int) -> "ModelConfig":
        """Config of a self-draft made of the first n_layers layers."""
        types = None if self.layer_types is None else self.layer_types[:n_layers]
        return dataclasses.replace(self, n_layers=n_layers, layer_types=types, name=f"{self.name}[layers:{n_layers}]")
