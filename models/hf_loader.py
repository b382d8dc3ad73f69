"""Load a local Hugging Face model folder (config.json + safetensors) into a contract decoder.

Role: turns a downloaded checkpoint folder into the PyTorch reference module that every
backend is compared against (target or draft). Supported: model_type llama (Llama 2/3.x, with
llama3 / linear / yarn RoPE scaling), mistral (sliding window), qwen2 (Qwen2/2.5: q/k/v biases),
qwen3 (q/k norms), phi3 (Phi-3/3.5/4-mini: fused qkv_proj and gate_up_proj are split here;
longrope) and SmolLM (llama) -> family "llama"; gemma3_text -> family "gemma3"
(models/gemma3.py); gpt2 -> family "gpt2" (its Conv1D weights
[in, out] are transposed into our nn.Linear [out, in]). Everything else is rejected with one
line naming the model_type and what is missing. Never touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from arborspec.runtime.errors import InputError, MissingFileError

from .config import ModelConfig
from .rope import rope_scaling_from_hf

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm", "smollm2")
GEMMA3_TYPES = ("gemma3_text",)
# what the families we do not run would need (the error line names it)
MISSING = {
    "gemma3": "vision tower (Gemma 3 multimodal; its text_config as a gemma3_text folder loads)",
    "gemma2": "Gemma 2 blocks (logit softcapping, (1 + w) norms)",
    "gemma": "Gemma blocks ((1 + w) norms, GeGLU, scaled embeddings)",
    "phi": "Phi-1/2 blocks (parallel attention/MLP, LayerNorm, partial rotary)",
    "mixtral": "mixture-of-experts feed-forward",
    "qwen2_moe": "mixture-of-experts feed-forward",
    "qwen3_moe": "mixture-of-experts feed-forward",
    "falcon": "Falcon blocks (parallel attention/MLP, ALiBi or multi-query layout)",
}
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


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_scaling_from_hf(hf, params)


def _sliding(hf: dict, mt: str, n_layers: int) -> tuple[int, list[str] | None]:
    """(sliding_window, layer_types): Mistral and Phi-3 slide on every layer when sliding_window
    is set; Qwen2/3 only with use_sliding_window, on the layers its layer_types name."""
    window = int(hf.get("sliding_window") or 0)
    if mt in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        return 0, None
    if not window:
        return 0, None
    types = hf.get("layer_types")
    if mt in ("qwen2", "qwen3") and not types:
        first_full = hf.get("max_window_layers", n_layers)
        types = ["sliding_attention" if i >= first_full else "full_attention" for i in range(n_layers)]
    if types is not None and len(types) != n_layers:
        raise InputError(f"model_type {mt!r}: layer_types has {len(types)} entries for {n_layers} layers")
    return window, (list(types) if types else None)


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
        theta, scaling = _rope(hf)
        window, types = _sliding(hf, mt, hf["num_hidden_layers"])
        return ModelConfig(
            family="llama",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"],
            max_position=hf.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=mt == "qwen3",
            sliding_window=window,
            layer_types=types,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            attention_bias=True if mt == "qwen2" else bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            **common,
        )
    if mt in GEMMA3_TYPES:
        return gemma3_config(hf, common)
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
    what = MISSING.get(mt, "a reference decoder for this architecture")
    raise InputError(
        f"unsupported model_type {mt!r}: arborspec has no {what} (supported: {', '.join(LLAMA_TYPES + GEMMA3_TYPES + GPT2_TYPES)})"
    )


def gemma3_config(hf: dict, common: dict) -> ModelConfig:
    """Gemma 3 text: rope_parameters per layer type (transformers 5) or rope_theta /
    rope_local_base_freq / rope_scaling (transformers 4, on the full-attention layers)."""
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise InputError(f"model_type 'gemma3_text': unsupported hidden_activation {hf['hidden_activation']!r}")
    if hf.get("use_bidirectional_attention"):
        raise InputError("model_type 'gemma3_text': bidirectional attention (an encoder) is not a decoder")
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    full.update(hf.get("rope_scaling") or {})  # transformers 4: the full-attention layers' scaling
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    if (local.get("rope_type") or "default") != "default":
        raise InputError(f"model_type 'gemma3_text': unsupported sliding-layer rope scaling {local['rope_type']!r}")
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) else "full_attention"
        for i in range(n_layers)
    ]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    return ModelConfig(
        family="gemma3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        max_position=hf.get("max_position_embeddings", 32768),
        rope_theta=float(full["rope_theta"]),
        rope_scaling=rope_scaling_from_hf({**hf, "rope_scaling": None}, full),
        rope_local_theta=float(local["rope_theta"]),
        qk_norm=True,
        sliding_window=int(hf.get("sliding_window") or 0),
        layer_types=list(types),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        attention_bias=bool(hf.get("attention_bias", False)),
        attn_scale=float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        **common,
    )


def phi3_hf_to_ours(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused projections split into Llama names: qkv_proj rows are [q | k | v],
    gate_up_proj rows are [gate | up] (Phi3MLP chunks the output in that order)."""
    nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {}
    for k, v in sd.items():
        if k.endswith("self_attn.qkv_proj.weight"):
            pre = k[: -len("qkv_proj.weight")]
            q, kk, vv = v.split([nq, nkv, nkv], dim=0)
            out.update({pre + "q_proj.weight": q, pre + "k_proj.weight": kk, pre + "v_proj.weight": vv})
        elif k.endswith("mlp.gate_up_proj.weight"):
            pre = k[: -len("gate_up_proj.weight")]
            gate, up = v.chunk(2, dim=0)
            out.update({pre + "gate_proj.weight": gate, pre + "up_proj.weight": up})
        else:
            out[k] = v
    return out


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
    from . import build_model

    with torch.device("meta"):
        module = build_model(cfg)
    module = module.to_empty(device="cpu")
    if hasattr(module, "init_buffers"):  # non-persistent buffers (RoPE), lost by to_empty
        module.init_buffers()
    load_state(module, sd, dtype, where)
    if cfg.tie_embeddings:  # assign=True replaced the embedding Parameter: tie again
        module.lm_head.weight = (module.transformer.wte if cfg.family == "gpt2" else module.model.embed_tokens).weight
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
    elif hf.get("model_type") == "phi3":
        sd = phi3_hf_to_ours(sd, cfg)
    if cfg.family != "gpt2" and "lm_head.weight" not in sd and not cfg.tie_embeddings:
        raise InputError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight")
    return build_from_state(cfg, sd, dtype, str(path)), cfg
