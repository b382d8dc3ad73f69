"""Random checkpoints with the exact shapes of the Llama models users deploy (1B, 3B, 8B).

Role in one decode step: none; they measure what a step costs at those sizes (memory, time per
call, the verify cost curve). Their weights are random, so their text is noise: acceptance comes
from the real SmolLM2-135M head (benchmarks/scale.py says so beside every figure). They use
SmolLM2's 49,152-token vocabulary and tokenizer, so llama.cpp's converter and our exporter read
them as they read any Hugging Face folder: bf16 safetensors in shards of at most 2 GB with
`model.safetensors.index.json`, as transformers' `save_pretrained` writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    rope_factor: float

    def hf_config(self, vocab: int, bos: int | None, eos: int | None) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": self.name,
            "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "intermediate_size": self.intermediate,
            "vocab_size": vocab, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rope_scaling": {**LLAMA3_ROPE, "factor": self.rope_factor}, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": self.tied, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16",
        }  # fmt: skip

    def tensors(self, vocab: int):
        """(name, shape) of every tensor, in the order a checkpoint holds them."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        yield "model.embed_tokens.weight", (vocab, h)
        for n in range(self.layers):
            p = f"model.layers.{n}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "self_attn.q_proj.weight", (q, h)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
            yield p + "self_attn.o_proj.weight", (h, q)
            yield p + "post_attention_layernorm.weight", (h,)
            yield p + "mlp.gate_proj.weight", (i, h)
            yield p + "mlp.up_proj.weight", (i, h)
            yield p + "mlp.down_proj.weight", (h, i)
        yield "model.norm.weight", (h,)
        if not self.tied:
            yield "lm_head.weight", (vocab, h)


SHAPES = {
    "llama-3.2-1b": Shape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, True, 32.0),
    "llama-3.2-3b": Shape("llama-3.2-3b", 3072, 28, 24, 8, 128, 8192, True, 32.0),
    "llama-3.1-8b": Shape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, False, 8.0),
}


def write_random_checkpoint(shape: Shape, out: str | Path, tokenizer_dir: str | Path, vocab: int,
                            shard_bytes: int = 2 * 1024**3, seed: int = 0) -> Path:  # fmt: skip
    """A bf16 checkpoint of `shape` with random weights (normal, std 0.02; norms 1) in shards,
    with its index, config.json and the tokenizer files of `tokenizer_dir`; written tensor by tensor
    (memory: one shard)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    tc = json.loads((out / "tokenizer_config.json").read_text()) if (out / "tokenizer_config.json").is_file() else {}
    bos, eos = tc.get("bos_token_id", 1), tc.get("eos_token_id", 2)
    (out / "config.json").write_text(json.dumps(shape.hf_config(vocab, bos, eos), indent=2))
    g = torch.Generator().manual_seed(seed)
    plan = _shard_plan(list(shape.tensors(vocab)), shard_bytes)
    index, total = {}, len(plan)
    bar = tqdm(total=sum(len(p) for p in plan), desc=f"{shape.name}: tensors", leave=False)
    for k, names in enumerate(plan, 1):  # one shard in memory at a time
        sd = {}
        for name, dims in names:
            if len(dims) == 1:
                sd[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                sd[name] = torch.empty(dims, dtype=torch.float32).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)
            bar.update(1)
        fname = f"model-{k:05d}-of-{total:05d}.safetensors"
        save_file(sd, str(out / fname), metadata={"format": "pt"})
        index.update({n: fname for n in sd})
        del sd
    bar.close()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))
    return out


def _shard_plan(tensors: list, shard_bytes: int) -> list[list]:
    """The tensors of each shard, in order, each shard at most `shard_bytes` of bf16 (or one tensor)."""
    plan, size = [[]], 0
    for name, dims in tensors:
        n = 2
        for d in dims:
            n *= d
        if plan[-1] and size + n > shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, dims))
        size += n
    return plan


def write_random_eagle3_head(shape: Shape, out: str | Path, vocab: int, draft_vocab: int = 32000, seed: int = 0) -> Path:
    """An EAGLE-3 head with the layout of the public heads for `shape` (yuhuili/EAGLE3-LLaMA3.1-
    Instruct-8B for the 8B: one decoder layer of the target's width over [embedding, hidden], fc
    3H -> H, a 32,000-token draft vocabulary mapped to the first target ids), random weights, in
    the public checkpoint format (config.json + model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    from arborspec.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers

    cfg = shape.hf_config(vocab, 1, 2)
    c = Eagle3Config(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, n_heads=shape.heads,
        n_kv_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab,
        target_hidden_size=shape.hidden, aux_layers=default_aux_layers(shape.layers), rope_theta=cfg["rope_theta"],
        max_position=cfg["max_position_embeddings"], rope_scaling=cfg["rope_scaling"],
    )  # fmt: skip
    torch.manual_seed(seed)
    head = Eagle3Head(c)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c.to_json(), indent=2))
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"))
    return out
