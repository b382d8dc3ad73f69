"""Distil a small Llama draft (1-2 layers) for a target, sharing the target's frozen embeddings
and LM head.

Role in one decoding step: none at run time; it produces the draft that step 1 (the tree
drafting) calls once per level. The draft is the target's embedding table + K fresh (or
target-initialised) decoder layers + a final norm + the target's head. Only the layers and
the final norm are trained, on text the target itself generated (greedy and sampled
continuations of the prompts file and of simple seeds, produced with our runtime's vanilla
decoding on the torch backend and cached), with KL(target || draft) on the target's top-k
log-probs plus a cross-entropy term on the target's own tokens.

    python -m arborspec.tools.commands.distill --model smollm2-135m --layers 1 \\
        --time-budget-min 30                    # -> ~/.cache/arborspec/drafts/smollm2-135m-distilled-L1
    python -m arborspec.tools.commands.distill --model smollm2-135m --eval \\
        --drafts bigram,layers:2,layers:4,~/.cache/arborspec/drafts/smollm2-135m-distilled-L1

The output folder is Hugging Face style (config.json with model_type llama, model.safetensors,
the target's tokenizer files), so `arborspec.models.registry.load_model(folder)` loads it and
`arborspec export --draft FOLDER` exports it like any other draft. Reproducible: fixed seeds,
CPU, deterministic data order.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import atomic_write_text
from arborspec.tools.prompts import load_prompt_entries, split_prompts
from arborspec.tools.train.distill_corpus import (
    cache_root,
    causal_forward,
    corpus_key,
    generate_corpus,
    teacher_topk,
    windows,
)


# ----------------------------------------------------------------------------- the draft
def make_draft(target_module, n_layers: int, init: str = "target", seed: int = 0):
    """Draft module: target's embeddings/head (frozen, shared tensors), K layers, final norm."""
    from arborspec.models import build_model

    cfg = target_module.config
    if cfg.family != "llama":
        raise InputError(f"distillation builds a Llama draft: target family {cfg.family!r} is not llama")
    if not 1 <= n_layers <= cfg.n_layers:
        raise InputError(f"--layers must be in 1..{cfg.n_layers}, got {n_layers}")
    if init not in ("target", "random"):
        raise InputError(f"--init must be target or random, got {init!r}")
    torch.manual_seed(seed)
    dcfg = cfg.truncated(n_layers)
    dcfg.name = f"{cfg.name or 'target'}-distilled-L{n_layers}"
    draft = build_model(dcfg).float()
    tsd = target_module.state_dict()
    with torch.no_grad():
        if init == "target":
            own = draft.state_dict()
            draft.load_state_dict({k: v for k, v in tsd.items() if k in own}, strict=False)
        else:
            draft.model.norm.weight.copy_(tsd["model.norm.weight"])
        draft.model.embed_tokens.weight.copy_(tsd["model.embed_tokens.weight"])
        if not cfg.tie_embeddings:
            draft.lm_head.weight.copy_(tsd["lm_head.weight"])
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    return draft


def trainable_parameters(draft):
    return [p for n, p in draft.named_parameters() if p.requires_grad]


def hf_config(cfg, extra: dict | None = None) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "attention_bias": bool(cfg.attention_bias),
        "mlp_bias": bool(cfg.mlp_bias),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)) or None,
        "torch_dtype": "float32",
        "_name_or_path": cfg.name,
    }
    if extra:
        d["arborspec"] = extra
    return d


def save_hf_folder(module, out: str | Path, tok=None, extra: dict | None = None) -> Path:
    """config.json (model_type llama) + model.safetensors (+ tokenizer), written atomically."""
    from safetensors.torch import save_file

    from arborspec.runtime.fileio import PartialFolder

    out = Path(out).expanduser()
    with PartialFolder(out) as tmp:
        sd = {k: v.detach().float().contiguous() for k, v in module.state_dict().items()}
        if module.config.tie_embeddings:
            sd.pop("lm_head.weight", None)  # tied: embed_tokens is the head
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(module.config, extra), indent=1))
        if tok is not None:
            tok.save(tmp)
    return out


def distill_loss(
    logits: torch.Tensor,
    t_idx: torch.Tensor,
    t_lp: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    ce_weight: float,
) -> tuple[torch.Tensor, dict]:
    """KL(target || draft) over the target's top-k (true probabilities, not renormalised)
    + ce_weight * CE on the next tokens; means over real positions."""
    logq = torch.log_softmax(logits.float(), -1)
    q_top = logq.gather(-1, t_idx.long())
    p_top = t_lp.exp()
    kl = (p_top * (t_lp - q_top)).sum(-1)
    ce = -logq.gather(-1, targets[..., None]).squeeze(-1)
    n = mask.sum().clamp(min=1)
    kl_m, ce_m = (kl * mask).sum() / n, (ce * mask).sum() / n
    with torch.no_grad():
        agree = ((logq.argmax(-1) == t_idx[..., 0].long()).float() * mask).sum() / n
    return kl_m + ce_weight * ce_m, {"kl": float(kl_m.detach()), "ce": float(ce_m.detach()), "top1": float(agree)}


@dataclass
class DistillOptions:
    """Settings of one distillation run (the flags of `python -m arborspec.tools.commands.distill`)."""

    model: str = "smollm2-135m"
    layers: int = 1
    init: str = "target"
    out: str | None = None
    prompts: str | None = None
    n_eval: int = 8
    corpus: str | None = None
    corpus_tokens: int = 12288
    gen_len: int = 128
    temperature: float = 0.8
    steps: int = 400
    seq_len: int = 128
    batch: int = 8
    lr: float = 5e-4
    topk: int = 64
    ce_weight: float = 0.2
    time_budget_min: float = 50.0
    seed: int = 0
    threads: int = 0
    quiet: bool = False

    @classmethod
    def from_namespace(cls, ns) -> "DistillOptions":
        return cls(**{f: getattr(ns, f) for f in cls.__dataclass_fields__ if hasattr(ns, f)})


def distill(opts: DistillOptions) -> dict:
    from arborspec.models.registry import load_model

    torch.manual_seed(opts.seed)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    t0 = time.perf_counter()
    loaded = load_model(opts.model)
    target = loaded.module.float().eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = loaded.tokenizer
    entries = load_prompt_entries(opts.prompts)
    train_entries, _ = split_prompts(entries, opts.n_eval)
    progress = not opts.quiet
    seqs = _teacher_corpus(opts, loaded, target, train_entries, t0, progress)
    ids, lmask = windows(seqs, opts.seq_len)
    t_idx, t_lp = teacher_topk(target, ids, opts.topk, batch=opts.batch, progress=progress)
    _log(
        opts,
        f"teacher top-{opts.topk} log-probs for {ids.shape[0]} windows x {opts.seq_len} "
        f"({time.perf_counter() - t0:.0f} s so far)",
    )
    draft = make_draft(target, opts.layers, opts.init, opts.seed)
    hist = _train_steps(opts, draft, (ids, lmask, t_idx, t_lp), t0, progress)
    last = hist[-min(20, len(hist)) :] if hist else [{}]
    summary = {
        "target": opts.model,
        "target_sha256": loaded.source.get("sha256"),
        "layers": opts.layers,
        "init": opts.init,
        "steps": len(hist),
        "seq_len": opts.seq_len,
        "batch": opts.batch,
        "lr": opts.lr,
        "topk": opts.topk,
        "ce_weight": opts.ce_weight,
        "seed": opts.seed,
        "corpus_tokens": sum(map(len, seqs)),
        "windows": int(ids.shape[0]),
        "final_kl": sum(h.get("kl", 0) for h in last) / len(last),
        "final_top1": sum(h.get("top1", 0) for h in last) / len(last),
        "first_kl": hist[0]["kl"] if hist else None,
        "first_top1": hist[0]["top1"] if hist else None,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(opts.out).expanduser() if opts.out else default_out(opts.model, opts.layers)
    save_hf_folder(draft, out, tok, extra={"distilled": summary})
    _log(opts, f"saved {out}: {json.dumps(summary)}")
    summary["out"] = str(out)
    return summary


def _teacher_corpus(opts: DistillOptions, loaded, target, train_entries, t0: float, progress: bool) -> list:
    """The target's own continuations of the training prompts: cached by target, prompts and
    generation settings (--corpus names the file)."""
    key = corpus_key(
        loaded.source,
        opts.model,
        train_entries,
        corpus_tokens=opts.corpus_tokens,
        gen_len=opts.gen_len,
        seed=opts.seed,
        temperature=opts.temperature,
    )
    corpus_file = Path(opts.corpus) if opts.corpus else cache_root() / "distill" / f"corpus-{key}.json"
    if corpus_file.is_file():
        seqs = json.loads(corpus_file.read_text())["sequences"]
        _log(opts, f"corpus: {sum(map(len, seqs))} tokens in {len(seqs)} sequences (cached {corpus_file})")
        return seqs
    seqs = generate_corpus(
        target, loaded.tokenizer, train_entries, opts.corpus_tokens, opts.gen_len, opts.seed, opts.temperature,
        progress=progress,
    )
    atomic_write_text(corpus_file, json.dumps({"model": opts.model, "sequences": seqs}))
    _log(
        opts,
        f"corpus: generated {sum(map(len, seqs))} tokens in {len(seqs)} sequences "
        f"({time.perf_counter() - t0:.0f} s) -> {corpus_file}",
    )
    return seqs


def _train_steps(opts: DistillOptions, draft, data, t0: float, progress: bool) -> list[dict]:
    """opts.steps AdamW steps (warm-up, then cosine to a tenth) on the distillation loss over
    shuffled windows, or fewer where the time budget ends first: each step's loss parts."""
    ids, lmask, t_idx, t_lp = data
    params = trainable_parameters(draft)
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, min(20, opts.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, opts.steps)))))
        ),
    )
    g = torch.Generator().manual_seed(opts.seed)
    n = ids.shape[0]
    order = torch.randperm(n, generator=g)
    pos = 0
    bar = range(opts.steps)
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"distil L{opts.layers}", unit="step", disable=None)
    hist = []
    draft.train()
    for step in bar:
        if pos + opts.batch > n:
            order, pos = torch.randperm(n, generator=g), 0
        b = order[pos : pos + opts.batch]
        pos += opts.batch
        logits = causal_forward(draft, ids[b, :-1])
        loss, parts = distill_loss(logits, t_idx[b], t_lp[b], ids[b, 1:], lmask[b], opts.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        hist.append(parts)
        if progress:
            bar.set_postfix(kl=f"{parts['kl']:.3f}", top1=f"{parts['top1']:.3f}")
        if time.perf_counter() - t0 > opts.time_budget_min * 60.0:
            _log(opts, f"time budget of {opts.time_budget_min} min reached after {step + 1} steps")
            break
    draft.eval()
    return hist


def default_out(model: str, layers: int) -> Path:
    name = Path(str(model)).stem if ("/" in str(model) or "." in str(model)) else str(model)
    return cache_root() / "drafts" / f"{name}-distilled-L{layers}"


def _log(opts, msg: str) -> None:
    if not getattr(opts, "quiet", False):
        print(f"[distill] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- CLI
