"""EAGLE-3 draft head (one decoder layer over the target's hidden states), contract-style.

Role in one decode step: the draft. For each tree level it reads the frontier tokens' ids,
their hidden inputs (H-dim), position ids, a boolean mask [B, T, P+T] over its own cache and
its single layer's past K/V [P, B, Hkv, D] (sequence-major, as runtime/contract.py), and
returns logits over the *draft* vocabulary (float32 [B, T, Vd]), its hidden state
[B, T, H] (the hidden input of the next level) and the new K/V [T, B, Hkv, D].

Design of the hidden input: the graph always takes an H-dim hidden state. The target
features (3 H' wide, the hidden states entering the aux layers) are first projected by
`fc` in a separate tiny step (`project`), so the first level and the deeper levels (whose
hidden input is the draft's own previous hidden state) run the same graph with no control
flow on tensor values and no per-row selector (a selector would make every call pay the
3H'xH matmul; `fc` is applied once per committed token instead).

Alignment (as published EAGLE-3): row i pairs the embedding of token t_{i+1} with the
hidden feature of position i; its K/V sit at position i.

Checkpoint layout (public EAGLE-3 for Llama targets): config.json + model.safetensors or
pytorch_model.bin with fc.weight [H, 3H'], midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v read 2H:
normed token embedding then normed hidden state), midlayer.mlp.{gate,up,down}_proj.weight,
norm.weight, lm_head.weight [Vd, H], d2t (target id = draft id + d2t[draft id]), t2d.
Token embeddings come from the target.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from arborspec.runtime.errors import ExportDirError, InputError, MissingFileError

from .llama import RMSNorm, Rotary, additive_mask, apply_rope, attend, merge_past, repeat_kv


@dataclass
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    vocab_size: int            # target vocabulary
    draft_vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    aux_layer_ids: list[int] | None = field(default=None)

    @classmethod
    def from_json(cls, d: dict) -> "Eagle3Config":
        try:
            h = int(d["hidden_size"])
            nh = int(d["num_attention_heads"])
            aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            aux = aux if aux is not None else d.get("aux_layer_ids")
            return cls(
                hidden_size=h,
                target_hidden_size=int(d.get("target_hidden_size") or h),
                vocab_size=int(d["vocab_size"]),
                draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                n_heads=nh,
                n_kv_heads=int(d.get("num_key_value_heads") or nh),
                head_dim=int(d.get("head_dim") or h // nh),
                intermediate_size=int(d["intermediate_size"]),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                aux_layer_ids=[int(x) for x in aux] if aux is not None else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ExportDirError(f"EAGLE-3 config.json is missing or has a bad field: {e}") from None

    def to_json(self) -> dict:
        d = {
            "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps, "num_hidden_layers": 1,
        }
        if self.aux_layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return d


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h2 = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(h2, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(h2, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(h2, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k_all = repeat_kv(merge_past(past_k, k), rep)
        v_all = repeat_kv(merge_past(past_v, v), rep)
        y = attend(q, k_all, v_all, bias).transpose(1, 2).reshape(b, t, self.n_heads * self.hd)
        return self.o_proj(y), k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        c, h = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(c, h, bias=False)
        self.up_proj = nn.Linear(c, h, bias=False)
        self.down_proj = nn.Linear(h, c, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = Eagle3MLP(cfg)


class Eagle3Head(nn.Module):
    """The head; `embed` is the target's token embedding (shared, not a parameter here)."""

    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        emb = embed if embed is not None else torch.zeros(cfg.vocab_size, h)
        self.register_buffer("embed", emb, persistent=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3H'] -> hidden input [..., H] (the `fc` step)."""
        return self.fc(features.to(self.fc.weight.dtype))

    def token_map(self) -> torch.Tensor:
        """[Vd] draft id -> target id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, input_ids, hidden_in, position_ids, attention_mask, past_key, past_value):
        """input_ids [B,T], hidden_in [B,T,H], position_ids [B,T], attention_mask bool
        [B,T,P+T], past_key/past_value [P,B,Hkv,D] -> (logits f32 [B,T,Vd], hidden_out
        [B,T,H], new_key [T,B,Hkv,D], new_value [T,B,Hkv,D])."""
        m = self.midlayer
        emb = F.embedding(input_ids, self.embed).to(hidden_in.dtype)
        residual = hidden_in
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden_in)], dim=-1)
        cos, sin = self.rotary(position_ids)
        a, k, v = m.self_attn(x, cos, sin, additive_mask(attention_mask), past_key, past_value)
        h = residual + a
        h = h + m.mlp(m.post_attention_layernorm(h))
        logits = self.lm_head(self.norm(h)).float()
        return logits, h, k, v


def _read_state(folder: Path) -> dict:
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file
            return load_file(str(st))
        if pt.exists():
            return torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt file: one line
        raise ExportDirError(f"EAGLE-3 checkpoint {folder} could not be read ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    raise MissingFileError(f"EAGLE-3 checkpoint {folder} has neither model.safetensors nor pytorch_model.bin")


def load_eagle3(path, embed: torch.Tensor, target_hidden_size: int, target_vocab_size: int,
                target_layers: int | None = None) -> Eagle3Head:
    """Load a public-layout EAGLE-3 folder for a target whose embedding is `embed` [V, H']."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise MissingFileError(f"EAGLE-3 checkpoint {folder} has no config.json")
    try:
        cfg = Eagle3Config.from_json(json.loads(cfg_path.read_text()))
    except json.JSONDecodeError as e:
        raise ExportDirError(f"EAGLE-3 config.json in {folder} is not valid JSON: {e}") from None
    if cfg.target_hidden_size != target_hidden_size:
        raise InputError(f"EAGLE-3 head expects target hidden size {cfg.target_hidden_size}, "
                         f"the target has {target_hidden_size}")
    if cfg.vocab_size != target_vocab_size:
        raise InputError(f"EAGLE-3 head expects a vocabulary of {cfg.vocab_size}, the target has {target_vocab_size}")
    if cfg.hidden_size != embed.shape[1]:
        raise InputError(f"EAGLE-3 head hidden size {cfg.hidden_size} != target embedding width {embed.shape[1]}")
    if target_layers is not None and cfg.aux_layer_ids is not None:
        bad = [i for i in cfg.aux_layer_ids if not 0 <= i < target_layers]
        if bad or len(cfg.aux_layer_ids) != 3:
            raise InputError(f"EAGLE-3 aux layer ids {cfg.aux_layer_ids} do not fit a {target_layers}-layer target")
    state = _read_state(folder)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    head = Eagle3Head(cfg, embed=embed.detach().float())
    want = head.state_dict()
    missing = [k for k in want if k not in state]
    if missing:
        raise ExportDirError(f"EAGLE-3 checkpoint {folder} lacks {', '.join(missing[:4])}")
    for k, v in want.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise InputError(f"EAGLE-3 checkpoint tensor {k} has shape {tuple(state[k].shape)}, "
                             f"expected {tuple(v.shape)} for this target")
    head.load_state_dict({k: state[k].to(v.dtype) for k, v in want.items()}, strict=True)
    ids = head.token_map()
    if int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size:
        raise InputError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary ({target_vocab_size})")
    return head.eval()


def save_eagle3(head: Eagle3Head, path) -> None:
    """Write the public layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=2))
    sd = {k: v.contiguous() for k, v in head.state_dict().items()}
    save_file(sd, str(folder / "model.safetensors"))
