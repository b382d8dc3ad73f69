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
over the full vocabulary), step weights STEP_DECAY^k (train-draft --step-decay).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
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
        rope_scaling=cfg_t.rope_scaling,
        max_position=int(cfg_t.max_position),
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


def revocab_head(head: Eagle3Head, vocab: np.ndarray, target_module) -> Eagle3Head:
    """The head over another draft vocabulary (`vocab`, target ids; `train-draft --revocab`): every
    weight carried over, lm_head rows of the tokens both vocabularies hold too (their logits are
    unchanged), the new tokens' rows from the target's LM head (init_head's starting point) through
    the map training took the kept ones' along."""
    c = dataclasses.replace(head.config, draft_vocab_size=len(vocab))
    new = Eagle3Head(c)
    sd = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    new.load_state_dict(sd, strict=False)
    old_ids = head.token_map().cpu().long()
    vt = torch.from_numpy(np.asarray(vocab, dtype=np.int64))
    pos = torch.full((c.vocab_size,), -1, dtype=torch.long)
    pos[old_ids] = torch.arange(len(old_ids))
    src = pos[vt]
    with torch.no_grad():
        w = target_module.lm_head.weight[vt].float().clone()
        kept = src >= 0
        kept_rows = head.lm_head.weight[src[kept]].float()
        if int(kept.sum()) >= 2 * w.shape[1] and not bool(kept.all()):
            # the head's rows are the target's moved by training: the linear map that takes the kept
            # tokens' target rows to their trained rows (least squares) moves the new ones alike.
            # Measured (SmolLM2 head, 3,252 of 8,192 tokens new): raw target rows outscore the trained
            # ones and held-out agreement falls to 0.02 at depth 1; mapped rows keep the head's 0.49
            a = torch.linalg.lstsq(w[kept], kept_rows).solution
            w = w @ a
        w[kept] = kept_rows
        new.lm_head.weight.copy_(w)
        new.d2t.copy_(vt - torch.arange(len(vt)))
        new.t2d.zero_()
        new.t2d[vt] = True
    return new.train(head.training)


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


def agrees(logits, top1, vocab_t, depth: int):
    """[B, n] bool: the draft's argmax at TTT step `depth` (mapped to target ids) is the target's
    greedy token of its row (top1 [B, W], target ids)."""
    n = logits.shape[1]
    return vocab_t[logits.argmax(-1)] == top1[:, 1 + depth : 1 + depth + n].long()


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
        accs.append(agrees(logits, top1, vocab_t, k).float().mean())
    return losses, accs


def shard_source(d: Path) -> str:
    import json

    try:
        return json.loads((d / "shard.json").read_text()).get("prompt_source", "templates")
    except (OSError, ValueError):
        return "templates"


def epoch_order(sources: np.ndarray, rng, template_share: float | None) -> np.ndarray:
    """One epoch's window order. template_share None: every window once. Else every window not
    from template prompts once, plus template windows drawn without replacement to make up that
    share of the epoch (all of them if there are too few; every window once if no other exists):
    the template stream repeats itself, so its windows teach a head that has seen it little."""
    n = len(sources)
    if template_share is None:
        return rng.permutation(n)
    tmpl = np.flatnonzero(sources == "templates")
    own = np.flatnonzero(sources != "templates")
    if len(own) == 0:
        return rng.permutation(n)
    k = min(len(tmpl), int(round(len(own) * template_share / (1.0 - template_share))))
    return rng.permutation(np.concatenate([own, rng.choice(tmpl, k, replace=False)]))


class ShardData:
    """The windows of every finished shard of a corpus (tools/train/eagle3_corpus.py), memory-
    mapped, under one global index in shard order: a corpus that grew between two runs keeps the
    indices it had and adds new ones at the end."""

    NAMES = ("tokens", "features", "top_ids", "top_lp", "top1")

    def __init__(
        self, corpus: Path, head_vocab: np.ndarray | None = None, shards: range | None = None, prefix: bool = False
    ):
        from arborspec.tools.train.eagle3_corpus import featurised, in_shards, shard_dirs, shards_text

        dirs = [d for d in shard_dirs(corpus) if in_shards(d, shards)]  # shards: these numbers only
        if prefix:  # the featurised ones up to the first that is not (`featurise` goes in order): the
            ready = [featurised(d) for d in dirs]  # rest join a later run at the end of the index
            dirs = dirs[: ready.index(False)] if False in ready else dirs
        for d in dirs:
            missing = [f"{n}.npy" for n in self.NAMES if not (d / f"{n}.npy").is_file()]
            if missing:
                from arborspec.runtime.errors import InputError

                if (d / "tokens.npy").is_file() and (d / "shard.json").is_file():
                    raise InputError(
                        f"the corpus shard {d} holds token ids only (grown with --defer-features or unpacked with "
                        f"--ids-only): featurise it first: python -m arborspec.tools.train.corpus_ids featurise "
                        f"--model MODEL --corpus {corpus}"
                        + ("" if shards is None else f" --shards {shards_text(shards)}")
                    )
                raise InputError(
                    f"the corpus shard {d} is incomplete (no {', '.join(missing)}): remove that folder "
                    "and train again (the corpus goes on without it)"
                )
        self.shards = [{n: np.load(d / f"{n}.npy", mmap_mode="r") for n in self.NAMES} for d in dirs]
        self.last = int(dirs[-1].name) if dirs else -1  # the last shard number read
        sizes = [s["tokens"].shape[0] for s in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        # each window's prompt source (shard.json; shards from before sources: the templates)
        self.sources = np.repeat([shard_source(d) for d in dirs] or ["templates"], sizes or [0])
        self.corpus_vocab = torch.from_numpy(np.load(corpus / "vocab.npy")).long()
        self.vocab_t, self.remap = self.corpus_vocab, None
        if head_vocab is not None:
            self.use_vocab(head_vocab)

    def use_vocab(self, head_vocab: np.ndarray) -> None:
        """Serve the top-K over `head_vocab` (a head's draft vocabulary, target ids) where it is not
        the corpus's own: each stored id mapped to the head's (-1, weight 0, where the head lacks
        it), plus one slot for the target's greedy token where the head holds it and the corpus's
        vocabulary did not, with the mass the stored top-K leaves (1 - their sum: the most it can
        have; the least is their largest)."""
        hv, cv = torch.as_tensor(np.asarray(head_vocab, dtype=np.int64)), self.corpus_vocab
        self.vocab_t = hv
        if hv.shape == cv.shape and bool((hv == cv).all()):
            self.remap = None
            return
        n = int(max(int(hv.max()), int(cv.max()))) + 1
        pos = torch.full((n,), -1, dtype=torch.long)
        pos[hv] = torch.arange(len(hv))
        in_corpus = torch.zeros(n, dtype=torch.bool)
        in_corpus[cv] = True
        self.remap = (pos[cv], pos, in_corpus)  # corpus draft id -> head's; target id -> head's (-1: none)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def batch_at(self, idx):
        """Global window indices -> (tokens, features, top_ids, top_lp, top1) tensors."""
        idx = np.sort(np.asarray(idx))
        sh = np.searchsorted(self.offsets, idx, side="right") - 1
        parts = {n: [] for n in self.NAMES}
        for s in np.unique(sh):
            rows = idx[sh == s] - self.offsets[s]
            for n in self.NAMES:
                parts[n].append(self.shards[s][n][rows])
        tk, fe, ti, tl, t1 = (np.concatenate(parts[n]) for n in self.NAMES)
        ti, tl, t1 = torch.from_numpy(ti), torch.from_numpy(tl.astype(np.float32)), torch.from_numpy(t1)
        if self.remap is not None:
            ti, tl = self._remapped(ti, tl, t1)
        return torch.from_numpy(tk.astype(np.int64)), torch.from_numpy(fe.astype(np.float32)), ti, tl, t1

    def _remapped(self, ti, tl, t1):
        """(top_ids, top_lp) over the head's vocabulary (use_vocab): [.., K] -> [.., K + 1]."""
        to_head, pos, in_corpus = self.remap
        none = torch.full_like(ti.long(), -1)
        ids = torch.where(ti >= 0, to_head[ti.long().clamp(min=0)], none)
        g = t1.long()
        known = (g >= 0) & (g < len(pos))
        g = torch.where(known, g, torch.zeros_like(g))
        new = known & ~in_corpus[g] & (pos[g] >= 0)  # the greedy token: the head holds it, the corpus did not
        extra = torch.where(new, pos[g], torch.full_like(g, -1))
        rest = (1.0 - tl.exp().sum(-1)).clamp(min=1e-6).log()
        return torch.cat([ids, extra[..., None]], -1).int(), torch.cat([tl, rest[..., None]], -1)


def training_precision(choice: str, device: str) -> str:
    """`auto` -> "bf16" where the device multiplies bfloat16 natively (a CUDA GPU with bf16, a CPU
    with AVX512-BF16 or AMX: oneDNN's bf16 kernels), else "fp32"; "fp32"/"bf16" as given.
    Measured on this project's 2-core AMD EPYC (AVX512-BF16), one thread, one batch of 4 x 512
    tokens with 4 TTT steps: 7.6-8.9 s fp32, 3.5-4.6 s bf16, the same losses to 3-4 digits and
    gradients with cosine similarity 1.000 (docs/drafts-training.md)."""
    if choice != "auto":
        return choice
    if device.startswith("cuda"):
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    try:
        return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    except (AttributeError, RuntimeError):
        return "fp32"


DEFAULT_LR = 5e-4  # the peak learning rate of a new run
STEP_DECAY = 0.8  # the loss of TTT step k weighs STEP_DECAY**k (EAGLE-3's)


def lr_at(i: int, peak: float, total: int, warm: int) -> float:
    """Linear warm-up over `warm` batches, then cosine from `peak` down to peak/10 at `total`
    (held there after)."""
    return peak * min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))


class StopFlag:
    """SIGTERM / SIGINT ask the loop to stop after the batch in flight (it then checkpoints,
    evaluates and writes the head): `kill PID` ends a background run cleanly."""

    def __init__(self):
        self.set = False
        self.old = {}

    def __enter__(self):
        import signal

        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self.old[s] = signal.signal(s, self._on)
            except ValueError:  # not the main thread: no handler, the budget still stops it
                pass
        return self

    def _on(self, *_):
        self.set = True

    def __exit__(self, *exc):
        import signal

        for s, h in self.old.items():
            signal.signal(s, h)
        return False


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save to a temp name, then rename: a killed save leaves the last checkpoint whole."""
    atomic_write(path, lambda f: torch.save(state, f))


@dataclass
class TrainConfig:
    """One training run's settings (train-draft's flags). `lr`, `schedule_batches`,
    `template_share`, `step_decay` and `shards` at None: a resumed run keeps its checkpoint's, a
    new one takes the default (DEFAULT_LR, 2 passes over the corpus, every window once,
    STEP_DECAY, every shard)."""

    steps: int = 4  # TTT steps per position
    batch: int = 4  # windows per batch
    lr: float | None = None  # the schedule's peak
    minutes: float = 60.0  # this run's budget
    batches: int | None = None  # at most this many batches in this run
    schedule_batches: int | None = None  # the schedule's length
    seed: int = 0  # the epochs' window orders
    resume: bool = True  # from out/train_state.pt where it exists
    evaluate: Callable[[Eagle3Head], dict] | None = None  # the held-out measure
    better: Callable[[dict, dict], bool] | None = None  # new beats old: keep best_head.pt
    eval_every_s: float = 600.0
    progress: bool = True  # a tqdm bar; else a log line every `log_every` batches
    log_every: int = 20  # batches per curve point
    save_every_s: float = 180.0
    device: str = "cpu"
    precision: str = "fp32"  # or "bf16" (training_precision)
    template_share: float | None = None  # epoch_order
    shards: range | None = None  # these shard numbers only
    featurised_prefix: bool = False  # of those, the featurised ones up to the first that is not
    step_decay: float | None = None  # the loss of TTT step k weighs step_decay**k


def train(head: Eagle3Head, embed: torch.Tensor, corpus: Path, out: Path,
          config: TrainConfig | None = None, **options) -> dict:
    """Train in place for `config.minutes` of this run (`options`: TrainConfig fields, over
    `config`); checkpoints `out/train_state.pt` (head, optimiser, step, epoch, the epoch's window
    order and the position in it, schedule, curve, time spent) every `save_every_s` and at the
    end; a later run resumes from it with the same state. The learning rate follows `lr_at` over
    `schedule_batches` (default: 2 passes over the corpus as the first run finds it) up to the
    peak `lr`. Each epoch draws a new order over all windows the corpus then has.
    `evaluate(head) -> dict` (the held-out measure) runs every `eval_every_s` and at the end; its
    results go into the curve, and with `better(new, old) -> bool` (train-draft passes the install
    rule, `eagle3_heldout.beats`) the head of the best measure so far is kept in
    `out/best_head.pt`: the report's "best" names its batch (the caller publishes that head).
    `device`: where the head trains ("cuda" on a GPU); the held-out measure and the checkpoints'
    heads are CPU copies, and checkpoints load with map_location="cpu", so a run resumes
    anywhere. `precision`: "bf16" runs the forward and backward matmuls under bfloat16 autocast
    (weights, optimiser state and the loss stay fp32), "fp32" everything in fp32. `shards`: a
    resumed run keeps its checkpoint's range, and refuses another."""
    run = _TrainingRun(head, embed, corpus, out, dataclasses.replace(config or TrainConfig(), **options))
    stopped = run.loop()
    return run.finish(stopped)


class _TrainingRun:
    """One call of `train`: the checkpoint it resumes, the data, the head on its device with its
    optimiser, the settings resolved against the checkpoint, and the progress it saves."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, corpus: Path, out: Path, cfg: TrainConfig):
        self.cfg, self.out, self.head, self.corpus = cfg, out, head, corpus
        self.state_file, self.best_file = out / "train_state.pt", out / "best_head.pt"
        st = self.load_checkpoint()
        self.data = self.load_data(corpus)
        self.dev = torch.device(cfg.device)
        self.embed = self.build_head(embed, st)
        self.resolve_settings(st)
        self.restore_progress(st)

    # -- setting up ------------------------------------------------------------------------------

    def load_checkpoint(self) -> dict | None:
        """The checkpoint to resume (None: a new run); sets the shard range it trained on."""
        from arborspec.runtime.errors import InputError
        from arborspec.tools.train.eagle3_corpus import shards_text

        cfg, state_file = self.cfg, self.state_file
        st = torch.load(state_file, map_location="cpu", weights_only=False) if cfg.resume and state_file.is_file() else None
        kept = st.get("shards") if st is not None else None  # [first, stop] or None (every shard)
        if st is not None and cfg.shards is not None and kept != [cfg.shards.start, cfg.shards.stop]:
            raise InputError(
                f"{state_file} trained on {'shards ' + shards_text(range(*kept)) if kept else 'every shard'}, not "
                f"--shards {shards_text(cfg.shards)}: resume it with the same range, or start over (--no-resume, or "
                "another --out)"
            )
        self.shards = range(*kept) if cfg.shards is None and kept is not None else cfg.shards
        return st

    def load_data(self, corpus: Path) -> ShardData:
        """The corpus's windows in the run's shards (their top-K over the head's vocabulary: set in
        build_head, once the checkpoint's head is in)."""
        from arborspec.runtime.errors import InputError

        data = ShardData(corpus, shards=self.shards, prefix=self.cfg.featurised_prefix)
        if len(data) == 0 and self.cfg.featurised_prefix:
            raise InputError(
                f"the corpus {corpus} has no featurised shard {'in those shards ' if self.shards else ''}yet "
                "(--featurised-prefix): run `corpus_ids featurise` first, or wait for the one running"
            )
        if len(data) == 0:
            raise InputError(
                f"the corpus {corpus} has no training window {'in those shards' if self.shards is not None else 'yet'} "
                "(its responses are shorter than one window): grow it (--corpus-minutes, --corpus-tokens), give a "
                "smaller --window or other --shards"
            )
        return data

    def build_head(self, embed: torch.Tensor, st: dict | None) -> torch.Tensor:
        """The head and the embeddings on the device, the optimiser, both resumed from the
        checkpoint; the data's top-K mapped onto the head's vocabulary. Returns the embeddings."""
        from arborspec.runtime.errors import InputError

        head = self.head
        head.to(self.dev)
        embed = embed.to(self.dev)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=DEFAULT_LR, betas=(0.9, 0.95), weight_decay=0.0)  # lr set every batch
        if st is not None:
            try:
                head.load_state_dict(st["head"])
            except RuntimeError:
                n = st["head"].get("lm_head.weight", torch.zeros(0)).shape[0]
                raise InputError(
                    f"{self.state_file} holds a head of another shape (a draft vocabulary of {n}): resume it with the "
                    "same --revocab, or start over (--no-resume, or another --out)"
                ) from None
            self.opt.load_state_dict(st["opt"])
        self.data.use_vocab(head.token_map().cpu().numpy())  # a head over another vocabulary (revocab_head) reads
        self.vocab_t = self.data.vocab_t.to(self.dev)  # the corpus's top-K mapped onto its own
        return embed

    def resolve_settings(self, st: dict | None) -> None:
        """Schedule, template share and step decay: as given, else the checkpoint's, else the defaults."""
        cfg = self.cfg
        total = int(cfg.schedule_batches or (st["schedule"]["total"] if st else 2 * max(1, len(self.data) // cfg.batch)))
        lr = cfg.lr if cfg.lr is not None else (st["schedule"]["peak"] if st else DEFAULT_LR)
        self.template_share = cfg.template_share
        if self.template_share is None and st is not None:
            self.template_share = st.get("template_share")
        self.step_decay = cfg.step_decay
        if self.step_decay is None:
            self.step_decay = st.get("step_decay", STEP_DECAY) if st else STEP_DECAY
        self.sched = {"total": total, "warm": min(50, total // 10 + 1), "peak": lr}
        self.weights = [self.step_decay**k for k in range(cfg.steps)]

    def restore_progress(self, st: dict | None) -> None:
        """Step, epoch, window order, curves, the best head so far and the clocks, from the checkpoint."""
        if st is None:
            st = {"step": 0, "epoch": 0, "order": None, "pos": 0, "curve": [], "evals": [], "spent_s": 0.0, "cpu_s": 0.0}
        self.step, self.epoch, self.order, self.pos = st["step"], st["epoch"], st["order"], st["pos"]
        self.best = st.get("best") if self.best_file.is_file() else None  # an older checkpoint kept no best head
        self.first = self.step
        self.curve, self.evals = st["curve"], st["evals"]
        self.t0, self.c0 = time.perf_counter() - st["spent_s"], time.process_time() - st["cpu_s"]
        self.run_start = time.perf_counter()

    # -- training --------------------------------------------------------------------------------

    def loop(self) -> str:
        """Train batch after batch until the schedule, the budget or a signal ends it; evaluates
        and checkpoints on their clocks. Returns why it stopped."""
        from tqdm import tqdm

        cfg, total = self.cfg, self.sched["total"]
        self.head.train()
        last_save = last_eval = time.perf_counter()
        bar = tqdm(total=total, initial=self.step, desc="train-draft", unit="batch", disable=None if cfg.progress else True)
        self.run_loss, self.run_acc = [], []
        stop_reason = "schedule done"
        with StopFlag() as stop:
            while self.step < total:
                reason = self.budget_spent(stop)
                if reason is not None:
                    stop_reason = reason
                    break
                self.train_batch()
                if self.step % cfg.log_every == 0 or self.step == total:
                    self.log_curve(bar)
                bar.update(1)
                if time.perf_counter() - last_eval > cfg.eval_every_s:
                    self.evaluate()
                    last_eval = time.perf_counter()
                if time.perf_counter() - last_save > cfg.save_every_s:
                    self.checkpoint()
                    last_save = time.perf_counter()
        bar.close()
        return stop_reason

    def budget_spent(self, stop: StopFlag) -> str | None:
        """Why this run stops before the next batch (None: it goes on)."""
        cfg = self.cfg
        if stop.set:
            return "stopped by a signal"
        if (time.perf_counter() - self.run_start) / 60 >= cfg.minutes or (
            cfg.batches is not None and self.step - self.first >= cfg.batches
        ):
            return f"this run's budget ({cfg.minutes:g} min)" if cfg.batches is None else f"{cfg.batches} batches"
        return None

    def next_batch(self) -> np.ndarray:
        """The next batch's window indices; a new epoch (a new order) when this one is used up."""
        batch = self.cfg.batch
        if self.order is None or self.pos + batch > len(self.order):
            if self.order is not None:
                self.epoch += 1
                if self.cfg.featurised_prefix:  # the shards `featurise` finished since join this epoch
                    self.data = ShardData(self.corpus, self.head.token_map().cpu().numpy(), self.shards, prefix=True)
            rng = np.random.default_rng([self.cfg.seed, self.epoch])
            self.order = epoch_order(self.data.sources, rng, self.template_share)
            self.pos = 0
        idx = self.order[self.pos : self.pos + batch]
        self.pos += batch
        return idx

    def train_batch(self) -> None:
        """One optimiser step on the next batch: the TTT forward, the step-weighted loss, clipped
        gradients."""
        cfg, sched, opt = self.cfg, self.sched, self.opt
        tk, fe, ti, tl, t1 = (x.to(self.dev, non_blocking=True) for x in self.data.batch_at(self.next_batch()))
        for g in opt.param_groups:
            g["lr"] = lr_at(self.step, sched["peak"], sched["total"], sched["warm"])
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            outs = ttt_forward(self.head, self.embed, tk, fe, cfg.steps)
            losses, accs = step_losses(outs, ti, tl, t1, self.vocab_t, cfg.steps)
        loss = sum(w * lo for w, lo in zip(self.weights, losses)) / sum(self.weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 0.5)
        opt.step()
        self.step += 1
        self.run_loss.append(float(loss.detach()))
        self.run_acc.append([float(a.detach()) for a in accs])

    def clock(self) -> dict:
        """Minutes of wall and CPU time over every run of this training so far."""
        return {
            "minutes": round((time.perf_counter() - self.t0) / 60, 2),
            "cpu_minutes": round((time.process_time() - self.c0) / 60, 2),
        }

    def log_curve(self, bar) -> None:
        """A curve point: the mean loss and train top-1 per step since the last one."""
        self.curve.append(
            {
                "batch": self.step,
                **self.clock(),
                "loss": round(float(np.mean(self.run_loss)), 4),
                "acc_per_step": [round(float(x), 4) for x in np.mean(self.run_acc, 0)],
            }
        )
        c = self.curve[-1]
        if not self.cfg.progress:
            from arborspec.tools.train.eagle3_corpus import log

            log(
                f"train-draft: batch {self.step}/{self.sched['total']} epoch {self.epoch} loss {c['loss']} "
                f"train top-1 {c['acc_per_step']} lr {self.opt.param_groups[0]['lr']:.2e}"
            )
        bar.set_postfix(loss=c["loss"], acc0=c["acc_per_step"][0])
        self.run_loss, self.run_acc = [], []

    def evaluate(self) -> None:
        """The held-out measure on a CPU copy of the head, into the curve; the best head so far kept."""
        cfg, head = self.cfg, self.head
        if cfg.evaluate is None:
            return
        import copy

        from arborspec.tools.train.eagle3_corpus import log

        res = cfg.evaluate(head if self.dev.type == "cpu" else copy.deepcopy(head).cpu())
        head.train()
        if cfg.better is not None and (self.best is None or cfg.better(res, self.best)):
            save_checkpoint(self.best_file, _cpu_state(head.state_dict()))
            self.best = {"batch": self.step, **res}
        self.evals.append({"batch": self.step, **self.clock(), **res})
        log(f"train-draft: held-out at batch {self.step}: {res['top1_agreement_per_depth']}")

    def checkpoint(self) -> None:
        """out/train_state.pt: everything a later run resumes from (its keys are the format)."""
        save_checkpoint(
            self.state_file,
            {
                "head": _cpu_state(self.head.state_dict()),
                "opt": self.opt.state_dict(),
                "step": self.step,
                "epoch": self.epoch,
                "order": self.order,
                "pos": self.pos,
                "schedule": self.sched,
                "template_share": self.template_share,
                "step_decay": self.step_decay,
                "shards": None if self.shards is None else [self.shards.start, self.shards.stop],
                "curve": self.curve,
                "evals": self.evals,
                "best": self.best,
                "spent_s": time.perf_counter() - self.t0,
                "cpu_s": time.process_time() - self.c0,
            },
        )

    # -- the end ---------------------------------------------------------------------------------

    def finish(self, stopped: str) -> dict:
        """The last held-out measure and checkpoint, and the report (also out/training.json); the
        head back on the CPU, in eval mode."""
        from arborspec.runtime.fileio import atomic_write_json

        cfg, evals, shards = self.cfg, self.evals, self.shards
        self.head.eval()
        if cfg.evaluate is not None and (not evals or evals[-1]["batch"] != self.step):
            self.evaluate()
        self.head.eval()
        self.checkpoint()
        report = {
            "batches": self.step,
            "schedule": self.sched,
            "epoch": self.epoch,
            "stopped": stopped,
            **self.clock(),
            "train_windows": len(self.data),
            "shards": None if shards is None else [shards.start, min(shards.stop, self.data.last + 1)],
            "ttt_steps": cfg.steps,
            "step_decay": self.step_decay,
            "batch_windows": cfg.batch,
            "precision": cfg.precision,
            "template_share": self.template_share,
            "seed": cfg.seed,
            "curve": self.curve,
            "heldout_curve": evals,
            "heldout": {k: v for k, v in evals[-1].items() if k not in ("batch", "minutes", "cpu_minutes")}
            if evals
            else None,
            "best": self.best,
        }
        atomic_write_json(self.out / "training.json", report)
        self.head.cpu()  # the caller saves and measures it on the CPU
        return report


def _cpu_state(sd: dict) -> dict:
    return {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in sd.items()}


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
    h = report["heldout"] or {}
    return (
        f"{report['batches']} batches, {report['minutes']} min in all ({report['stopped']}); held-out top-1 per depth "
        f"{h.get('top1_agreement_per_depth')}, tokens per step {h.get('tokens_per_step')}"
    )
