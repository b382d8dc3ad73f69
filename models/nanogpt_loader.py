"""Load a nanoGPT checkpoint (`ckpt.pt` written by nanoGPT's train.py) into the GPT-2 decoder.

Role: the seed write-up's models (and any small draft trained with nanoGPT) enter arborspec
here. The checkpoint is a dict with `model_args` {n_layer, n_head, n_embd, block_size, bias,
vocab_size} and `model` (a state dict whose keys may carry torch.compile's `_orig_mod.`
prefix). nanoGPT already uses nn.Linear, so names and layouts map one to one. Loaded with
torch.load(weights_only=True): a checkpoint cannot run code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from arborspec.runtime.errors import InputError, MissingFileError

from .config import ModelConfig
from .hf_loader import build_from_state

PREFIX = "_orig_mod."


def config_from_model_args(args: dict, name: str = "") -> ModelConfig:
    missing = [k for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size") if k not in args]
    if missing:
        raise InputError(f"nanoGPT model_args lack {missing}")
    c = int(args["n_embd"])
    bias = bool(args.get("bias", True))
    return ModelConfig(
        family="gpt2",
        vocab_size=int(args["vocab_size"]),
        hidden_size=c,
        n_layers=int(args["n_layer"]),
        n_heads=int(args["n_head"]),
        n_kv_heads=int(args["n_head"]),
        head_dim=c // int(args["n_head"]),
        intermediate_size=4 * c,
        max_position=int(args["block_size"]),
        norm_eps=1e-5,
        bias=bias,
        tie_embeddings=True,
        name=name,
    )


def load_nanogpt(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, ModelConfig]:
    """A nanoGPT ckpt.pt -> (GPT2Decoder in eval mode, ModelConfig)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such nanoGPT checkpoint")
    ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
        raise InputError(f"{path}: not a nanoGPT checkpoint (expected a dict with 'model_args' and 'model')")
    cfg = config_from_model_args(ckpt["model_args"], name=path.stem)
    sd = {k.removeprefix(PREFIX): v for k, v in ckpt["model"].items()}
    sd = {k: v for k, v in sd.items() if not k.endswith(".attn.bias")}  # old causal-mask buffers
    # nanoGPT ties lm_head to wte; an untied checkpoint would carry a distinct lm_head
    if (
        "lm_head.weight" in sd
        and "transformer.wte.weight" in sd
        and not torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    ):
        cfg.tie_embeddings = False
    return build_from_state(cfg, sd, dtype, str(path)), cfg
