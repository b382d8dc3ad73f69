"""Training an EAGLE-3 head on a built corpus (tools/train/eagle3_corpus.py) with the training-time
test: several unrolled draft steps per position, each reading the previous step's own hidden
state, with the attention the runtime's tree mask gives at inference.

Role in one decode step: none; it makes the weights the `eagle3` draft source runs in step 1.

Alignment (the runtime's, runtime/drafts/eagle3.py): window tokens x[0..W-1], target features
f[j] (at position j, where the target predicted x[j+1]). Entry j of step 0 pairs token x[j+1]
with fc(f[j]) at position j; entry j of step k pairs x[j+1+k] with step k-1's output hidden of
entry j at position j+k, and attends to step 0's entries 0..j (the committed chain) and to
entry j of steps 1..k (its ancestors and itself): a chain of depth k in a tree. Its label is the
target's next-token distribution at row j+1+k (top-K over the draft vocabulary, normalised
over the full vocabulary), step weights 0.8^k.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from arborspec.models.eagle3 import Eagle3Config, Eagle3Head
from arborspec.models.llama import apply_rope, repeat_kv
from arborspec.runtime.fileio import atomic_write


def init_head(cfg_t, target_module, aux_layers: list[int], vocab: np.ndarray, seed: int) -> Eagle3Head:
    """A head for the target: layer shapes of one target layer, the draft vocabulary's rows of
    the target's LM head and its final norm as the starting point of lm_head/norm."""
    torch.manual_seed(seed)
    c = Eagle3Config(
        hidden_size=cfg_t.hidden_size,
        intermediate_size=cfg_t.intermediate_size,
        n_heads=cfg_t.n_heads,
        n_kv_heads=cfg_t.n_kv_heads,
        head_dim=cfg_t.head_dim,
        vocab_size=cfg_t.vocab_size,
        draft_vocab_size=len(vocab),
        target_hidden_size=cfg_t.hidden_size,
        aux_layers=list(aux_layers),
        rms_eps=float(cfg_t.norm_eps),
        rope_theta=float(cfg_t.rope_theta),
        max_position=int(cfg_t.max_position),
        rope_scaling=cfg_t.rope_scaling,
    )
    head = Eagle3Head(c)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        vt = torch.from_numpy(vocab)
        head.lm_head.weight.copy_(target_module.lm_head.weight[vt].float())
        head.norm.weight.copy_(target_module.model.norm.weight.float())
        head.d2t.copy_(vt - torch.arange(len(vocab)))
        head.t2d.zero_()
        head.t2d[vt] = True
    return head


def ttt_forward(head: Eagle3Head, embed: torch.Tensor, tokens: torch.Tensor, feats: torch.Tensor, steps: int):
    """Unrolled training-time test over windows: tokens [B, W], feats [B, W, F] ->
    list of draft logits per step [B, n, Vd] with n = W - steps - 1 entries."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    b, w = tokens.shape
    n = w - steps - 1
    nh, nkv, hd = attn.nh, attn.nkv, attn.hd
    rep = nh // nkv
    hidden = head.fc(feats[:, :n].float())
    causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    keys, values, outs = [], [], []
    for k in range(steps):
        emb = embed[tokens[:, 1 + k : 1 + k + n]]
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(b, n, nh, hd).transpose(1, 2)
        kk = attn.k_proj(x).view(b, n, nkv, hd).transpose(1, 2)
        vv = attn.v_proj(x).view(b, n, nkv, hd).transpose(1, 2)
        cos, sin = head.rotary(torch.arange(k, k + n, device=tokens.device)[None])
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        kr, vr = repeat_kv(kk, rep), repeat_kv(vv, rep)
        keys.append(kr)
        values.append(vr)
        scale = hd**-0.5
        s0 = (q @ keys[0].transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [((q * keys[i]).sum(-1, keepdim=True) * scale) for i in range(1, k + 1)]
        probs = torch.softmax(torch.cat([s0] + diag, -1), -1)
        y = probs[..., :n] @ values[0]
        for i in range(1, k + 1):
            y = y + probs[..., n + i - 1 : n + i] * values[i]
        a = attn.o_proj(y.transpose(1, 2).reshape(b, n, nh * hd))
        h = hidden + a
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(head.lm_head(head.norm(out)).float())
        hidden = out
    return outs


def step_losses(outs, top_ids, top_lp, top1, vocab_t, steps: int):
    """Soft cross-entropy against the target's top-K per step, and top-1 agreement with the
    target's greedy token (the draft's argmax mapped to target ids)."""
    losses, accs = [], []
    n = outs[0].shape[1]
    for k, logits in enumerate(outs):
        ids = top_ids[:, 1 + k : 1 + k + n].long()
        p = top_lp[:, 1 + k : 1 + k + n].float().exp() * (ids >= 0)
        logq = torch.log_softmax(logits, -1)
        lq = torch.gather(logq, -1, ids.clamp(min=0))
        losses.append(-(p * lq).sum(-1).mean())
        pred = vocab_t[logits.argmax(-1)]
        accs.append((pred == top1[:, 1 + k : 1 + k + n].long()).float().mean())
    return losses, accs


def corpus_batches(corpus: Path, holdout: float = 0.02):
    """A built corpus (memory-mapped) -> (batch_at(window indices) -> (tokens, features,
    top_ids, top_lp, top1) tensors, draft->target ids, train window indices, held-out window
    indices: the last `holdout` fraction)."""
    tokens = np.load(corpus / "tokens.npy", mmap_mode="r")
    feats = np.load(corpus / "features.npy", mmap_mode="r")
    top_ids = np.load(corpus / "top_ids.npy", mmap_mode="r")
    top_lp = np.load(corpus / "top_lp.npy", mmap_mode="r")
    top1 = np.load(corpus / "top1.npy", mmap_mode="r")
    vocab_t = torch.from_numpy(np.load(corpus / "vocab.npy"))
    n_win = tokens.shape[0]
    n_hold = max(1, int(round(n_win * holdout)))

    def batch_at(idx):
        idx = np.sort(idx)
        return (
            torch.from_numpy(tokens[idx].astype(np.int64)),
            torch.from_numpy(feats[idx].astype(np.float32)),
            torch.from_numpy(top_ids[idx]),
            torch.from_numpy(top_lp[idx].astype(np.float32)),
            torch.from_numpy(top1[idx]),
        )

    return batch_at, vocab_t, np.arange(n_win - n_hold), np.arange(n_win - n_hold, n_win)


def heldout_agreement(head: Eagle3Head, embed, corpus: Path, steps: int = 4, batch: int = 4, holdout: float = 0.02):
    """The held-out report `train` ends with, for any head over this corpus's vocabulary (a head
    before fine-tuning: the starting point of `train-draft --init`)."""
    batch_at, vocab_t, _, hold_idx = corpus_batches(corpus, holdout)
    was = head.training
    head.eval()
    out = evaluate(head, embed, batch_at, hold_idx, vocab_t, steps, batch)
    head.train(was)
    return out


def train(
    head: Eagle3Head,
    embed: torch.Tensor,
    corpus: Path,
    out: Path,
    *,
    steps: int = 4,
    batch: int = 4,
    lr: float = 5e-4,
    minutes: float = 60.0,
    epochs: float = 2.0,
    seed: int = 0,
    holdout: float = 0.02,
    resume: bool = True,
    progress: bool = True,
    log_every: int = 20,
    save_every_s: float = 120.0,
) -> dict:
    """Train in place; checkpoints `out/train_state.pt` (resumable); returns the report."""
    from tqdm import tqdm

    from arborspec.runtime.fileio import atomic_write_json

    batch_at, vocab_t, train_idx, hold_idx = corpus_batches(corpus, holdout)
    per_epoch = max(1, len(train_idx) // batch)
    total = max(1, int(per_epoch * epochs))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = min(50, total // 10 + 1)

    def lr_at(i):
        return lr * min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))

    state_file = out / "train_state.pt"
    start, curve, spent = 0, [], 0.0
    if resume and state_file.is_file():
        st = torch.load(state_file, map_location="cpu", weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        start, curve, spent = st["step"], st["curve"], st["spent_s"]
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(train_idx) for _ in range(int(math.ceil(epochs)) + 1)])
    weights = [0.8**k for k in range(steps)]

    def save_state(i):
        state = {"head": head.state_dict(), "opt": opt.state_dict(), "step": i, "curve": curve, "spent_s": spent}
        atomic_write(state_file, lambda f: torch.save(state, f))

    head.train()
    t_start = time.perf_counter() - spent
    last_save = time.perf_counter()
    bar = tqdm(total=total, initial=start, desc="train-draft", unit="batch", disable=None if progress else True)
    i = start
    run_loss, run_acc = [], []
    stop_reason = "done"
    while i < total:
        if (time.perf_counter() - t_start) / 60 >= minutes:
            stop_reason = f"time budget ({minutes:g} min)"
            break
        tk, fe, ti, tl, t1 = batch_at(order[i * batch : (i + 1) * batch])
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        outs = ttt_forward(head, embed, tk, fe, steps)
        losses, accs = step_losses(outs, ti, tl, t1, vocab_t, steps)
        loss = sum(w * lo for w, lo in zip(weights, losses)) / sum(weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        i += 1
        run_loss.append(float(loss.detach()))
        run_acc.append([float(a.detach()) for a in accs])
        if i % log_every == 0 or i == total:
            spent = time.perf_counter() - t_start
            curve.append(
                {
                    "batch": i,
                    "minutes": round(spent / 60, 2),
                    "loss": round(float(np.mean(run_loss)), 4),
                    "acc_per_step": [round(float(x), 4) for x in np.mean(run_acc, 0)],
                }
            )
            bar.set_postfix(loss=curve[-1]["loss"], acc0=curve[-1]["acc_per_step"][0])
            run_loss, run_acc = [], []
        bar.update(1)
        if time.perf_counter() - last_save > save_every_s:
            spent = time.perf_counter() - t_start
            save_state(i)
            last_save = time.perf_counter()
    bar.close()
    spent = time.perf_counter() - t_start
    save_state(i)
    head.eval()
    hold = evaluate(head, embed, batch_at, hold_idx, vocab_t, steps, batch)
    report = {
        "batches": i,
        "batches_planned": total,
        "stopped": stop_reason,
        "minutes": round(spent / 60, 2),
        "train_windows": int(len(train_idx)),
        "heldout_windows": int(len(hold_idx)),
        "ttt_steps": steps,
        "batch_windows": batch,
        "lr": lr,
        "seed": seed,
        "curve": curve,
        "heldout": hold,
    }
    atomic_write_json(out / "training.json", report)
    return report


@torch.no_grad()
def evaluate(head, embed, batch_at, idx, vocab_t, steps: int, batch: int) -> dict:
    """Held-out top-1 agreement per depth (teacher-forced tokens, the draft's own hidden states),
    and the chain acceptance it implies: sum over depths of the product of the agreements."""
    accs = []
    for s in range(0, len(idx), batch):
        tk, fe, ti, tl, t1 = batch_at(idx[s : s + batch])
        outs = ttt_forward(head, embed, tk, fe, steps)
        _, a = step_losses(outs, ti, tl, t1, vocab_t, steps)
        accs.append([float(x) for x in a])
    acc = np.mean(accs, 0) if accs else np.zeros(steps)
    expected = float(np.sum(np.cumprod(acc)))
    return {
        "top1_agreement_per_depth": [round(float(x), 4) for x in acc],
        "expected_accepted_chain": round(1.0 + expected, 3),
    }


def save_public(head: Eagle3Head, folder: Path, extra: dict | None = None) -> list[str]:
    """Write the head in the public EAGLE-3 layout: config.json + model.safetensors (fp16
    weights; d2t int64, t2d bool), so other tools load it too."""
    from safetensors.torch import save

    from arborspec.runtime.fileio import atomic_write_bytes, atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
    atomic_write_bytes(folder / "model.safetensors", save(sd, metadata={"format": "pt"}))
    cfg = head.config.to_json()
    if extra:
        cfg.update(extra)
    atomic_write_json(folder / "config.json", cfg)
    return ["config.json", "model.safetensors"]


def head_bytes(head: Eagle3Head) -> int:
    return sum(
        v.numel() * (2 if v.is_floating_point() else v.element_size())
        for k, v in head.state_dict().items()
        if not k.startswith("rotary")
    )


def describe(report: dict) -> str:
    h = report["heldout"]
    return (
        f"{report['batches']} batches in {report['minutes']} min ({report['stopped']}); held-out top-1 per depth "
        f"{h['top1_agreement_per_depth']}, expected chain acceptance {h['expected_accepted_chain']}"
    )
