"""Load a local Hugging Face model folder (config.json + safetensors) into a contract decoder.

Role: turns a downloaded checkpoint folder into the PyTorch reference module that every
backend is compared against (target or draft). Supported: model_type llama / mistral /
qwen2 (and SmolLM, which is llama) -> family "llama"; gpt2 -> family "gpt2" (its Conv1D
weights [in, out] are transposed into our nn.Linear [out, in]). Everything else, and any RoPE
scaling other than the default, is rejected with a ValueError naming what is unsupported.
Never touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from arborspec.runtime.errors import InputError, MissingFileError

from .config import ModelConfig
from .gpt2 import GPT2Decoder
from .llama import LlamaDecoder

LLAMA_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2")
GPT2_TYPES = ("gpt2",)


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors file(s) of a folder: model.safetensors or the shards of an index."""
    folder = Path(folder)
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    raise MissingFileError(
        f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are supported)"
    )


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        sd.update(load_file(str(f)))
    return sd


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _rope_theta(hf: dict) -> float:
    """rope_theta from either transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise InputError(f"unsupported rope scaling type {rope_type!r} (only default RoPE is supported)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict, name: str = "") -> ModelConfig:
    """ModelConfig from a parsed config.json dict."""
    mt = hf.get("model_type", "")
    common = dict(
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_list(hf.get("eos_token_id")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        name=name or hf.get("_name_or_path", ""),
    )
    if mt in LLAMA_TYPES:
        if hf.get("hidden_act", "silu") != "silu":
            raise InputError(f"unsupported hidden_act {hf['hidden_act']!r} for {mt} (only silu)")
        n_heads = hf["num_attention_heads"]
        max_pos = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window")
        if window and (mt != "qwen2" or hf.get("use_sliding_window")):
            max_pos = min(max_pos, window)  # within the window, sliding attention == full attention
        return ModelConfig(
            family="llama",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"],
            max_position=max_pos,
            rope_theta=_rope_theta(hf),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            attention_bias=True if mt == "qwen2" else bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            **common,
        )
    if mt in GPT2_TYPES:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise InputError(f"unsupported GPT-2 activation_function {act!r} (only gelu_new / tanh GELU)")
        if (
            hf.get("scale_attn_by_inverse_layer_idx")
            or hf.get("reorder_and_upcast_attn")
            or not hf.get("scale_attn_weights", True)
        ):
            raise InputError(
                "unsupported GPT-2 attention variant (scale_attn_by_inverse_layer_idx / "
                "reorder_and_upcast_attn / scale_attn_weights=False)"
            )
        c = hf["n_embd"]
        return ModelConfig(
            family="gpt2",
            vocab_size=hf["vocab_size"],
            hidden_size=c,
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            n_kv_heads=hf["n_head"],
            head_dim=c // hf["n_head"],
            intermediate_size=hf.get("n_inner") or 4 * c,
            max_position=hf["n_positions"],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            bias=True,
            **common,
        )
    raise InputError(f"unsupported model_type {mt!r} (supported: {', '.join(LLAMA_TYPES + GPT2_TYPES)})")


def gpt2_hf_to_ours(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF GPT-2 names (with or without the 'transformer.' prefix) -> nanoGPT names, Conv1D transposed."""
    out = {}
    for k, v in sd.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of old checkpoints
        if not k.startswith(("transformer.", "lm_head.")):
            k = "transformer." + k
        if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            v = v.t().contiguous()
        out[k] = v
    return out


def load_state(module: torch.nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> None:
    """Strict load that tolerates a missing lm_head when it is tied; errors name the source."""
    cfg = module.config
    sd = {k: v.to(dtype) for k, v in sd.items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    own = module.state_dict()
    bad = [
        f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}"
        for k, v in sd.items()
        if k in own and tuple(v.shape) != tuple(own[k].shape)
    ]
    if bad:
        raise InputError(
            f"{where}: weights do not fit the {cfg.family} config: checkpoint vs model shape "
            f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        )
    missing, unexpected = module.load_state_dict(sd, strict=False, assign=True)  # no second copy
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise InputError(
            f"{where}: weights do not match the {cfg.family} config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def build_from_state(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> torch.nn.Module:
    with torch.device("meta"):
        module = LlamaDecoder(cfg) if cfg.family == "llama" else GPT2Decoder(cfg)
    module = module.to_empty(device="cpu")
    if cfg.family == "llama":  # non-persistent buffer, lost by to_empty
        theta, hd = cfg.rope_theta, cfg.head_dim
        module.rotary.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    load_state(module, sd, dtype, where)
    if cfg.tie_embeddings:  # assign=True replaced the embedding Parameter: tie again
        module.lm_head.weight = (module.model.embed_tokens if cfg.family == "llama" else module.transformer.wte).weight
    return module.to(dtype).eval()


def load_hf_folder(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, ModelConfig]:
    """A local HF folder -> (contract module in eval mode, ModelConfig)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise MissingFileError(f"{path}: no config.json (not a Hugging Face model folder)")
    hf = json.loads(cfg_file.read_text())
    cfg = config_from_hf(hf, name=hf.get("_name_or_path") or path.name)
    sd = read_state_dict(path)
    if cfg.family == "gpt2":
        sd = gpt2_hf_to_ours(sd)
    elif "lm_head.weight" not in sd and not cfg.tie_embeddings:
        raise InputError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight")
    return build_from_state(cfg, sd, dtype, str(path)), cfg
