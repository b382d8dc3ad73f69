"""EAGLE-3 draft head (Li et al. 2025): one decoder layer that reads the target's own hidden
states and predicts over a reduced vocabulary.

Role in one decode step: the draft of step 1. Each entry of its context pairs a token with a
hidden state: committed entries pair token x[j+1] with the TARGET's features f[j] (the hidden
states entering layers `aux_layers` of the target at position j, concatenated: 3H wide, projected
to H by `fc`); tree nodes pair their token with the DRAFT's own output hidden state of their
parent. One forward covers both (the hidden input is always H wide: `project` applies `fc` to
target features beforehand), so the graph has no control flow on tensor values.

Layer (names as in the public EAGLE-3 checkpoints, so their weights load as they are):
    e = input_layernorm(embed(token)); h = hidden_norm(hidden)
    a = self_attn(cat([e, h]))          # q/k/v read 2H: embedding first, then hidden
    x = hidden + a
    out = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(out))         # over the draft vocabulary; target id = id + d2t[id]
`out` is the hidden state that the node's children read. Token embeddings come from the target.

Checkpoint folder: config.json (hidden_size, intermediate_size, num_attention_heads,
num_key_value_heads, head_dim?, rms_norm_eps, rope_theta, rope_scaling? / rope_parameters?,
vocab_size, draft_vocab_size, target_hidden_size?, eagle_config.eagle_aux_hidden_state_layer_ids?)
and model.safetensors or pytorch_model.bin (loaded with weights_only) holding fc.weight,
midlayer.*, norm.weight, lm_head.weight, d2t, t2d (and embed_tokens.weight in some, ignored: the
target's embeddings are used). The public heads made for Llama 3.1/3.3 targets carry the
target's llama3 rope_scaling: the head rotates with it (models/rope.py), as it was trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from arborspec.runtime.errors import ExportDirError, InputError, MissingFileError, one_line

from .llama import GatedMLP, RMSNorm, additive_mask, apply_rope, attend, merge_past, repeat_kv
from .rope import Rotary, rope_scaling_from_hf


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048
    rope_scaling: dict | None = None  # models/rope.py (None: default RoPE)

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size * max(1, len(self.aux_layers) or 3)

    @classmethod
    def from_json(cls, d: dict, target_layers: int | None = None) -> "Eagle3Config":
        try:
            h = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            aux = (
                (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                or d.get("eagle_aux_hidden_state_layer_ids")  # vLLM's and llama.cpp's place for it
                or d.get("aux_layers")
            )
            if not aux and target_layers:
                aux = default_aux_layers(target_layers)
            return cls(
                hidden_size=h,
                intermediate_size=int(d["intermediate_size"]),
                n_heads=heads,
                n_kv_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or h // heads),
                vocab_size=int(d["vocab_size"]),
                draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                target_hidden_size=int(d.get("target_hidden_size") or h),
                aux_layers=[int(x) for x in aux or []],
                rms_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float((d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 10000.0))),
                max_position=int(d.get("max_position_embeddings", 2048)),
                rope_scaling=rope_scaling_from_hf(d),
            )
        except InputError:
            raise  # an unsupported rope scaling: its own line
        except (KeyError, TypeError, ValueError) as e:
            raise ExportDirError(f"EAGLE-3 config is missing or has a bad field: {e}") from None

    def to_json(self) -> dict:
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            **({"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling else {}),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)},
            "architectures": ["LlamaForCausalLMEagle3"],
            # what other engines read as they are: llama.cpp's converter (num_hidden_layers == 1 with
            # draft_vocab_size: an EAGLE-3 head; eagle_aux_hidden_state_layer_ids at the top level),
            # vLLM / SGLang (a transformers "llama" config; eagle_aux_hidden_state_layer_ids and
            # norm_before_residual on it). Layer ids name the layers whose INPUT is read, as here.
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
        }


def default_aux_layers(n_layers: int) -> list[int]:
    """EAGLE-3's default: the hidden states entering layers 2, L//2 and L-3 (clamped)."""
    return [min(max(i, 0), n_layers - 1) for i in (2, n_layers // 2, n_layers - 3)]


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.nh // self.nkv
        y = attend(q, repeat_kv(merge_past(past_k, k), rep), repeat_kv(merge_past(past_v, v), rep), bias)
        return (
            self.o_proj(y.transpose(1, 2).reshape(b, t, self.nh * self.hd)),
            k.permute(2, 0, 1, 3),
            v.permute(2, 0, 1, 3),
        )


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=False)


class Eagle3Head(nn.Module):
    """Contract-style forward: (input_embeds [B,T,H], hidden [B,T,H], position_ids, attention_mask
    [B,T,P+T], past_key [P,B,Hkv,D], past_value) -> (logits [B,T,Vd] float32, hidden_out [B,T,H],
    new_key [T,B,Hkv,D], new_value)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., 3H'] -> the layer's hidden input [.., H]."""
        return self.fc(features)

    def token_map(self) -> torch.Tensor:
        """Draft id -> target id (d2t holds offsets)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, input_embeds, hidden, position_ids, attention_mask, past_k, past_v):
        layer = self.midlayer
        cos, sin = self.rotary(position_ids)
        x = torch.cat([layer.input_layernorm(input_embeds), layer.hidden_norm(hidden)], dim=-1)
        a, k, v = layer.self_attn(x, cos, sin, additive_mask(attention_mask), past_k, past_v)
        h = hidden + a
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.lm_head(self.norm(out)).float()
        return logits, out, k, v


# EAGLE-3 heads shipped inside the package (trained by `arborspec train-draft`, see README):
# registry model name -> folder under arborspec/models/data/
SHIPPED_HEADS = {"smollm2-135m": "smollm2-135m-eagle3"}


def eagle3_folder(spec: str, model: str | None = None) -> Path:
    """The checkpoint folder a draft spec names: `eagle3` (the head shipped for the registry
    model `model`) or `eagle3:PATH`. One-line InputError otherwise."""
    path = spec.split(":", 1)[1].strip() if ":" in spec else ""
    if path:
        return Path(path).expanduser()
    name = str(model or "").strip().lower()
    if name not in SHIPPED_HEADS:
        raise InputError(
            f"--draft eagle3: no EAGLE-3 head is shipped for {model!r} (shipped: {', '.join(SHIPPED_HEADS)}); "
            "give one with eagle3:PATH (train it with `arborspec train-draft`)"
        )
    return Path(__file__).parent / "data" / SHIPPED_HEADS[name]


def eagle3_config(folder: str | Path, target_config=None) -> Eagle3Config:
    """The config of an EAGLE-3 checkpoint folder, checked against the target (hidden size,
    vocabulary, layer ids) with one-line errors; reads no weights."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise MissingFileError(f"{folder}: no config.json (not an EAGLE-3 checkpoint folder)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportDirError(f"{cfg_file}: not valid JSON ({e})") from None
    c = Eagle3Config.from_json(raw, target_config.n_layers if target_config is not None else None)
    if target_config is not None:
        if c.target_hidden_size != target_config.hidden_size:
            raise InputError(
                f"{folder}: EAGLE-3 head reads hidden size {c.target_hidden_size}, the target has "
                f"{target_config.hidden_size}"
            )
        if c.vocab_size != target_config.vocab_size:
            raise InputError(
                f"{folder}: EAGLE-3 head is for a vocabulary of {c.vocab_size}, the target has "
                f"{target_config.vocab_size}"
            )
        bad = [i for i in c.aux_layers if not 0 <= i < target_config.n_layers]
        if bad:
            raise InputError(
                f"{folder}: EAGLE-3 aux layer ids {bad} are outside the target's {target_config.n_layers} layers"
            )
    return c


def load_eagle3(folder: str | Path, target_config=None) -> Eagle3Head:
    """An EAGLE-3 head from a public-layout checkpoint folder; checks that it fits the target
    (hidden size, vocabulary, layer ids) with one-line errors."""
    folder = Path(folder)
    c = eagle3_config(folder, target_config)
    st = folder / "model.safetensors"
    bn = folder / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            sd = load_file(str(st))
        elif bn.is_file():
            sd = torch.load(str(bn), map_location="cpu", weights_only=True)
        else:
            raise MissingFileError(f"{folder}: no model.safetensors or pytorch_model.bin")
    except (MissingFileError, InputError):
        raise
    except Exception as e:  # noqa: BLE001 - corrupt files raise many types
        raise ExportDirError(f"{folder}: cannot read the EAGLE-3 weights ({one_line(e)})") from None
    head = Eagle3Head(c)
    sd = {k.removeprefix("model."): v for k, v in sd.items() if not k.endswith("embed_tokens.weight")}
    if "d2t" in sd:
        sd["d2t"] = sd["d2t"].long()
    if "t2d" in sd:
        sd["t2d"] = sd["t2d"].bool()
    missing, unexpected = head.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m not in ("t2d", "d2t")]
    if missing or unexpected:
        raise ExportDirError(
            f"{folder}: EAGLE-3 weights do not fit the config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    tmap = head.token_map()
    if int(tmap.min()) < 0 or int(tmap.max()) >= c.vocab_size:
        raise ExportDirError(f"{folder}: d2t maps draft ids outside the target vocabulary")
    return head.eval()
