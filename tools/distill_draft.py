"""Distil a small Llama draft (1-2 layers) for a target, sharing the target's frozen embeddings
and LM head.

Role in one decoding step: none at run time; it produces the draft that step 1 (the tree
drafting) calls once per level. The draft is the target's embedding table + K fresh (or
target-initialised) decoder layers + a final norm + the target's head. Only the layers and
the final norm are trained, on text the target itself generated (greedy and sampled
continuations of the prompts file and of simple seeds, produced with our runtime's vanilla
decoding on the torch backend and cached), with KL(target || draft) on the target's top-k
log-probs plus a cross-entropy term on the target's own tokens.

    python -m arborspec.tools.distill_draft --model smollm2-135m --layers 1 \\
        --time-budget-min 30                    # -> ~/.cache/arborspec/drafts/smollm2-135m-distilled-L1
    python -m arborspec.tools.distill_draft --model smollm2-135m --eval \\
        --drafts bigram,layers:2,layers:4,~/.cache/arborspec/drafts/smollm2-135m-distilled-L1

The output folder is Hugging Face style (config.json with model_type llama, model.safetensors,
the target's tokenizer files), so `arborspec.models.registry.load_model(folder)` loads it and
`arborspec export --draft FOLDER` exports it like any other draft. Reproducible: fixed seeds,
CPU, deterministic data order.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from arborspec.runtime.errors import InputError, MissingFileError

# Simple seeds: plain-text openings in a few registers (stories, facts, code, dialogue, lists).
SEEDS = [
    "Once upon a time", "The history of", "In this tutorial, we will", "def main():",
    "Here is a list of", "The weather today is", "Dear friend,", "Scientists have discovered",
    "The best way to learn", "Q: What is the capital of France?\nA:", "Chapter 1\n\n",
    "import numpy as np\n", "My favourite recipe is", "The meeting was", "In conclusion,",
    "How to write a good essay:", "The city of", "Water is", "Photosynthesis is the process",
    "The main idea of the story is", "She opened the door and", "Step 1:", "The president said",
    "An apple a day", "The quick brown fox", "There are three reasons why", "Machine learning is",
    "Yesterday I went to", "Summary:", "The following code", "It was a dark and stormy night",
    "A good friend is someone who",
]

# Held-out prompts used when no prompts file is given (never used to build the corpus).
EVAL_PROMPTS = [
    "Write a short poem about the sea.", "Explain how a rainbow forms.",
    "The three most important inventions of the twentieth century are",
    "Give me a recipe for pancakes.", "Tell me a story about a robot who learns to paint.",
    "What are the benefits of regular exercise?", "Describe the water cycle in simple terms.",
    "List five tips for studying effectively.",
]


# ----------------------------------------------------------------------------- prompts
def default_prompts_file() -> Path:
    return Path(__file__).resolve().parent / "data" / "prompts.json"


def load_prompt_entries(path: str | Path | None) -> list[dict]:
    """Entries of a prompts file: a JSON list of strings or of dicts with "prompt"/"text"
    (optionally "chat": bool) or "ids"; or {"prompts": [...]}. Missing file -> []."""
    p = Path(path) if path else default_prompts_file()
    if not p.is_file():
        if path:
            raise MissingFileError(f"prompts file not found: {p}")
        return []
    data = json.loads(p.read_text())
    if isinstance(data, dict):
        data = data.get("prompts", data.get("items", []))
    out = []
    for e in data:
        if isinstance(e, str):
            out.append({"text": e})
        elif isinstance(e, dict):
            if "ids" in e:
                out.append({"ids": [int(i) for i in e["ids"]]})
            elif e.get("prompt") or e.get("text"):
                out.append({"text": e.get("prompt") or e.get("text"), "chat": bool(e.get("chat", False))})
    return out


def encode_entry(entry: dict, tok, chat: bool | None = None) -> list[int] | None:
    if "ids" in entry:
        return list(entry["ids"])
    if tok is None:
        return None
    use_chat = entry.get("chat", False) if chat is None else chat
    if use_chat and tok.meta.get("chat_template"):
        return tok.encode(tok.apply_chat([{"role": "user", "content": entry["text"]}]), add_bos=False)
    return tok.encode(entry["text"])


def split_prompts(entries: list[dict], n_eval: int = 8) -> tuple[list[dict], list[dict]]:
    """(train, held-out): even-indexed entries are held out (up to n_eval), the rest train."""
    if not entries:
        return [], [{"text": t} for t in EVAL_PROMPTS[:n_eval]]
    held = entries[0::2][:n_eval]
    held_ids = {id(e) for e in held}
    return [e for e in entries if id(e) not in held_ids], held


def _random_seed_ids(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ----------------------------------------------------------------------------- corpus
def cache_root() -> Path:
    return Path(os.environ.get("ARBORSPEC_CACHE") or Path.home() / ".cache" / "arborspec")


def generate_corpus(target_module, tok, train_entries: list[dict], corpus_tokens: int, gen_len: int,
                    seed: int = 0, temperature: float = 0.8, top_p: float = 0.95,
                    progress: bool = True) -> list[list[int]]:
    """Sequences prompt + continuation, generated by the target with the runtime's vanilla
    decoding (torch backend): for each seed/prompt one greedy continuation, then sampled ones
    (seeds seed, seed+1, ...) until `corpus_tokens` generated tokens."""
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.sampling import SamplingParams

    eng = TorchEngine(target_module)
    vocab = eng.info.vocab_size
    prompts: list[list[int]] = []
    for e in train_entries:
        ids = encode_entry(e, tok)
        if ids:
            prompts.append(ids)
        if tok is not None and "text" in e and tok.meta.get("chat_template"):
            prompts.append(encode_entry(e, tok, chat=not e.get("chat", False)))
    if tok is not None:
        prompts += [tok.encode(s) for s in SEEDS]
    else:
        prompts += _random_seed_ids(vocab, len(SEEDS), seed)
    prompts = [p[-(eng.info.max_position - gen_len - 1):] for p in prompts if p]
    eos = list(tok.meta.get("eos_token_ids") or []) if tok is not None else []
    greedy = SpeculativeDecoder(eng, mode="vanilla")
    sampled = SpeculativeDecoder(eng, mode="vanilla", sampling=SamplingParams(temperature, 0, top_p))
    seqs: list[list[int]] = []
    made = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=corpus_tokens, desc="corpus (target generations)", unit="tok", leave=False)
    rnd = 0
    while made < corpus_tokens:
        for i, p in enumerate(prompts):
            dec = greedy if rnd == 0 else sampled
            res = dec.generate(p, min(gen_len, corpus_tokens - made), eos, seed=seed + 1000 * rnd + i)
            seqs.append(p + res.tokens)
            made += len(res.tokens)
            if bar is not None:
                bar.update(len(res.tokens))
            if made >= corpus_tokens:
                break
        rnd += 1
    if bar is not None:
        bar.close()
    return seqs


def _windows(seqs: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of seq_len+1 tokens (inputs + next-token targets), right-padded;
    returns ids [N, S+1] and a loss mask [N, S] (1 where the target token is real)."""
    rows, masks = [], []
    for s in seqs:
        for a in range(0, max(1, len(s) - 1), seq_len):
            w = s[a : a + seq_len + 1]
            if len(w) < 2:
                continue
            m = [1] * (len(w) - 1) + [0] * (seq_len + 1 - len(w))
            rows.append(w + [0] * (seq_len + 1 - len(w)))
            masks.append(m)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.float32)


def _causal_forward(module, ids: torch.Tensor) -> torch.Tensor:
    """Contract module over [B, T] ids from position 0 with a causal mask -> logits [B, T, V]."""
    cfg = module.config
    b, t = ids.shape
    pos = torch.arange(t)[None].expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
    empty = torch.zeros(0, b, cfg.n_kv_heads, cfg.head_dim, dtype=next(module.parameters()).dtype)
    past = [empty] * (2 * cfg.n_layers)
    return module(ids, pos, mask, *past)[0]


@torch.inference_mode()
def teacher_topk(target_module, ids: torch.Tensor, k: int, batch: int = 8, progress: bool = True):
    """The target's top-k log-probs (full-vocabulary normalised) for every window position."""
    n, t1 = ids.shape
    idx = torch.empty(n, t1 - 1, k, dtype=torch.int32)
    lp = torch.empty(n, t1 - 1, k, dtype=torch.float32)
    starts = range(0, n, batch)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="teacher logits", unit="batch", leave=False)
    for s in starts:
        logits = _causal_forward(target_module, ids[s : s + batch, :-1]).float()
        top = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
        idx[s : s + batch], lp[s : s + batch] = top.indices.int(), top.values
    return idx, lp


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
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": bool(cfg.attention_bias),
        "mlp_bias": bool(cfg.mlp_bias), "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)) or None,
        "torch_dtype": "float32", "_name_or_path": cfg.name,
    }
    if extra:
        d["arborspec"] = extra
    return d


def save_hf_folder(module, out: str | Path, tok=None, extra: dict | None = None) -> Path:
    """config.json (model_type llama) + model.safetensors (+ tokenizer), written atomically."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        sd = {k: v.detach().float().contiguous() for k, v in module.state_dict().items()}
        if module.config.tie_embeddings:
            sd.pop("lm_head.weight", None)  # tied: embed_tokens is the head
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(module.config, extra), indent=1))
        if tok is not None:
            tok.save(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def distill_loss(logits: torch.Tensor, t_idx: torch.Tensor, t_lp: torch.Tensor, targets: torch.Tensor,
                 mask: torch.Tensor, ce_weight: float) -> tuple[torch.Tensor, dict]:
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


# ----------------------------------------------------------------------------- main flow
def _corpus_key(source: dict, target_name: str, entries: list[dict], args) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"target": source.get("sha256") or target_name, "entries": entries,
                         "seeds": SEEDS, "tokens": args.corpus_tokens, "gen_len": args.gen_len,
                         "seed": args.seed, "temperature": args.temperature}, sort_keys=True).encode())
    return h.hexdigest()[:24]


def distill(args) -> dict:
    from arborspec.models.registry import load_model

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    budget_s = args.time_budget_min * 60.0
    loaded = load_model(args.model)
    target = loaded.module.float().eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = loaded.tokenizer
    entries = load_prompt_entries(args.prompts)
    train_entries, _ = split_prompts(entries, args.n_eval)
    progress = not args.quiet

    # corpus: cached by target, prompts, and generation settings
    corpus_file = Path(args.corpus) if args.corpus else (
        cache_root() / "distill" / f"corpus-{_corpus_key(loaded.source, args.model, train_entries, args)}.json")
    if corpus_file.is_file():
        seqs = json.loads(corpus_file.read_text())["sequences"]
        _log(args, f"corpus: {sum(map(len, seqs))} tokens in {len(seqs)} sequences (cached {corpus_file})")
    else:
        seqs = generate_corpus(target, tok, train_entries, args.corpus_tokens, args.gen_len, args.seed,
                               args.temperature, progress=progress)
        corpus_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = corpus_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": args.model, "sequences": seqs}))
        os.replace(tmp, corpus_file)
        _log(args, f"corpus: generated {sum(map(len, seqs))} tokens in {len(seqs)} sequences "
                   f"({time.perf_counter() - t0:.0f} s) -> {corpus_file}")
    ids, lmask = _windows(seqs, args.seq_len)
    t_idx, t_lp = teacher_topk(target, ids, args.topk, batch=args.batch, progress=progress)
    _log(args, f"teacher top-{args.topk} log-probs for {ids.shape[0]} windows x {args.seq_len} "
               f"({time.perf_counter() - t0:.0f} s so far)")

    draft = make_draft(target, args.layers, args.init, args.seed)
    params = trainable_parameters(draft)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, min(20, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))))
    g = torch.Generator().manual_seed(args.seed)
    n = ids.shape[0]
    order = torch.randperm(n, generator=g)
    pos = 0
    bar = range(args.steps)
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"distil L{args.layers}", unit="step")
    hist = []
    steps_done = 0
    draft.train()
    for step in bar:
        if pos + args.batch > n:
            order, pos = torch.randperm(n, generator=g), 0
        b = order[pos : pos + args.batch]
        pos += args.batch
        logits = _causal_forward(draft, ids[b, :-1])
        loss, parts = distill_loss(logits, t_idx[b], t_lp[b], ids[b, 1:], lmask[b], args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        steps_done = step + 1
        hist.append(parts)
        if progress:
            bar.set_postfix(kl=f"{parts['kl']:.3f}", top1=f"{parts['top1']:.3f}")
        if time.perf_counter() - t0 > budget_s:
            _log(args, f"time budget of {args.time_budget_min} min reached after {steps_done} steps")
            break
    draft.eval()
    last = hist[-min(20, len(hist)):] if hist else [{}]
    summary = {
        "target": args.model, "target_sha256": loaded.source.get("sha256"), "layers": args.layers,
        "init": args.init, "steps": steps_done, "seq_len": args.seq_len, "batch": args.batch,
        "lr": args.lr, "topk": args.topk, "ce_weight": args.ce_weight, "seed": args.seed,
        "corpus_tokens": sum(map(len, seqs)), "windows": int(n),
        "final_kl": sum(h.get("kl", 0) for h in last) / len(last),
        "final_top1": sum(h.get("top1", 0) for h in last) / len(last),
        "first_kl": hist[0]["kl"] if hist else None, "first_top1": hist[0]["top1"] if hist else None,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out).expanduser() if args.out else default_out(args.model, args.layers)
    save_hf_folder(draft, out, tok, extra={"distilled": summary})
    _log(args, f"saved {out}: {json.dumps(summary)}")
    summary["out"] = str(out)
    return summary


def default_out(model: str, layers: int) -> Path:
    name = Path(str(model)).stem if ("/" in str(model) or "." in str(model)) else str(model)
    return cache_root() / "drafts" / f"{name}-distilled-L{layers}"


def _log(args, msg: str) -> None:
    if not getattr(args, "quiet", False):
        print(f"[distill] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- evaluation
def evaluate_drafts(model: str, drafts: list[str], prompts: list[list[int]], trees=("full:3,2", "chain:4"),
                    max_new_tokens: int = 64, progress: bool = True) -> list[dict]:
    """Greedy speculative decoding (torch backend) of each prompt with each draft and tree:
    mean accepted tokens per target call (the target's bonus token included) and tok/s."""
    from argparse import Namespace

    from arborspec.runtime.decode import SpeculativeDecoder

    from .engines import open_models

    rows = []
    base = None
    for spec in drafts:
        ns = Namespace(model=model, draft=spec, export_dir=None, engine_dir=None, backend="torch", device="cpu")
        om = open_models(ns)
        if base is None:
            base = om
        eos = list(om.tokenizer.meta.get("eos_token_ids") or []) if om.tokenizer is not None else []
        for tree in trees:
            mode = "vanilla" if tree == "vanilla" else "chain" if tree.startswith("chain:") else "tree"
            dec = SpeculativeDecoder(om.target, om.draft if mode != "vanilla" else None, mode=mode,
                                     tree=tree if mode != "vanilla" else "chain:1")
            toks = steps = 0
            dec_s = draft_s = 0.0
            for p in prompts:
                r = dec.generate(p, max_new_tokens, eos)
                toks += r.stats.new_tokens
                steps += r.stats.steps
                dec_s += r.stats.decode_s
                draft_s += r.stats.draft_s
            row = {"draft": spec, "tree": tree, "mean_accepted": toks / max(1, steps),
                   "tokens_per_s": toks / dec_s if dec_s else 0.0, "draft_share": draft_s / dec_s if dec_s else 0.0,
                   "tokens": toks, "steps": steps}
            rows.append(row)
            if progress:
                print(f"[eval] {spec:>40s} {tree:10s} mean accepted {row['mean_accepted']:.2f} "
                      f"{row['tokens_per_s']:.1f} tok/s (draft {100 * row['draft_share']:.0f}% of time)",
                      file=sys.stderr, flush=True)
    return rows


def simulate_drafts(model: str, drafts: list[str], prompts: list[list[int]], trees=("full:3,2", "chain:4"),
                    max_new_tokens: int = 64, progress: bool = True) -> list[dict]:
    """Mean accepted tokens per verify step of greedy decoding, without running the tree
    loop: the target's greedy text once per prompt (vanilla runtime decoding), then each
    draft teacher-forced over it once; `tune.simulate_greedy_steps` counts the steps each
    static-shaped tree (chain, full, static) would take. Equal to real decoding's steps
    (tests/test_tune.py checks it)."""
    from argparse import Namespace

    from arborspec.runtime.decode import SpeculativeDecoder

    from .engines import open_models
    from .tune import _draft_topk_ranks, simulate_greedy_steps, spec_paths

    tree_paths = {t: spec_paths(t) for t in trees}
    k = max(max(p[-1] for p in ps) for ps in tree_paths.values()) + 1
    seqs = None
    rows = []
    for spec in drafts:
        ns = Namespace(model=model, draft=spec, export_dir=None, engine_dir=None, backend="torch", device="cpu")
        om = open_models(ns)
        if seqs is None:
            eos = list(om.tokenizer.meta.get("eos_token_ids") or []) if om.tokenizer is not None else []
            dec = SpeculativeDecoder(om.target, mode="vanilla")
            seqs = []
            for p in prompts:
                r = dec.generate(p, max_new_tokens, eos)
                seqs.append((len(p), list(p) + r.tokens))
        ranks = [_draft_topk_ranks(om.draft, s, k).tolist() for _, s in seqs]
        for t, paths in tree_paths.items():
            steps = sum(simulate_greedy_steps(rk, a, len(s), paths) for rk, (a, s) in zip(ranks, seqs))
            toks = sum(len(s) - a for a, s in seqs)
            row = {"draft": spec, "tree": t, "mean_accepted": toks / max(1, steps), "tokens": toks,
                   "steps": steps, "tokens_per_s": float("nan"), "simulated": True}
            rows.append(row)
            if progress:
                print(f"[eval/sim] {spec:>40s} {t:10s} mean accepted {row['mean_accepted']:.2f}",
                      file=sys.stderr, flush=True)
    return rows


def eval_prompt_ids(model_tok, prompts_file, n_eval: int) -> list[list[int]]:
    _, held = split_prompts(load_prompt_entries(prompts_file), n_eval)
    out = [encode_entry(e, model_tok) for e in held]
    return [p for p in out if p]


def markdown_table(rows: list[dict]) -> str:
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    drafts = list(dict.fromkeys(r["draft"] for r in rows))
    head = "| draft | " + " | ".join(f"{t} accepted | {t} tok/s" for t in trees) + " |"
    sep = "|---|" + "---|---|" * len(trees)
    lines = [head, sep]
    for d in drafts:
        cells = []
        for t in trees:
            r = next((r for r in rows if r["draft"] == d and r["tree"] == t), None)
            tps = "" if not r or r["tokens_per_s"] != r["tokens_per_s"] else f"{r['tokens_per_s']:.1f}"
            cells += [f"{r['mean_accepted']:.2f}", tps] if r else ["", ""]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arborspec.tools.distill_draft",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--model", default="smollm2-135m", help="target (registry name or path; llama family)")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers (default 1)")
    p.add_argument("--init", choices=["target", "random"], default="target",
                   help="initialise the draft's layers from target layers 0..K-1 (default) or randomly")
    p.add_argument("--out", help="output folder (default ~/.cache/arborspec/drafts/NAME-distilled-LK)")
    p.add_argument("--prompts", help="prompts file (default tools/data/prompts.json when present)")
    p.add_argument("--n-eval", type=int, default=8, help="held-out prompts (never in the corpus)")
    p.add_argument("--corpus", help="corpus JSON file to use/write (default: cached by settings)")
    p.add_argument("--corpus-tokens", type=int, default=12288, help="generated tokens in the corpus")
    p.add_argument("--gen-len", type=int, default=128, help="tokens per generated continuation")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature after the greedy round")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--topk", type=int, default=64, help="target log-probs kept per position for the KL")
    p.add_argument("--ce-weight", type=float, default=0.2, help="weight of the CE on the target's tokens")
    p.add_argument("--time-budget-min", type=float, default=50.0, help="stop training after this much wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--quiet", action="store_true")
    e = p.add_argument_group("evaluation (--eval: no training)")
    e.add_argument("--eval", action="store_true", help="compare drafts' mean accepted length on held-out prompts")
    e.add_argument("--drafts", default="bigram,layers:2,layers:4",
                   help="comma-separated drafts for --eval (layers:K, bigram, or model folders)")
    e.add_argument("--trees", default="full:3,2;chain:4",
                   help="semicolon-separated tree specs for --eval (default 'full:3,2;chain:4'; "
                        "'vanilla' = no draft, static:FILE.json for a tuned tree)")
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--simulate", action="store_true",
                   help="count greedy steps from teacher-forced draft ranks (fast, exact for chain/full/static "
                        "trees) instead of running the decode loop; no tok/s")
    e.add_argument("--json-out", help="write the --eval rows as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.eval:
            from arborspec.models.registry import load_model

            tok = load_model(args.model).tokenizer
            prompts = eval_prompt_ids(tok, args.prompts, args.n_eval)
            if not prompts:
                raise InputError("no held-out prompts to evaluate on (the model has no tokenizer and the "
                                 "prompts file has no 'ids' entries)")
            drafts = [os.path.expanduser(d.strip()) for d in args.drafts.split(",") if d.strip()]
            trees = [t.strip() for t in args.trees.split(";") if t.strip()]
            run = simulate_drafts if args.simulate else evaluate_drafts
            rows = run(args.model, drafts, prompts, trees, args.max_new_tokens, not args.quiet)
            print(markdown_table(rows))
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(rows, indent=1))
            return 0
        if args.steps < 1 or args.seq_len < 2 or args.batch < 1 or args.corpus_tokens < 1:
            raise InputError("--steps, --batch and --corpus-tokens must be >= 1 and --seq-len >= 2")
        distill(args)
        return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"distill_draft: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
