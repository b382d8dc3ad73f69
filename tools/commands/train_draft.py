"""`arborspec train-draft`: train an EAGLE-3 head for a target on this CPU and write it in the
public EAGLE-3 checkpoint layout (config.json + model.safetensors), which `--draft eagle3:DIR`
(and other EAGLE-3 tools) load.

Role: none in a decode step; it makes the draft of step 1. Stages: corpus (the target's own
responses to a varied prompt mix, generated in batches, plus text on this machine), the draft
vocabulary from the corpus's token frequencies (FR-Spec), the target's features and next-token
distributions (ONNX Runtime), then training with the training-time test. The corpus is cached in
the user cache; training checkpoints in OUT and resumes from there (--no-resume: start over).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from arborspec.runtime.errors import InputError, OutputError
from arborspec.tools.commands.cli import summary

EXAMPLE = """examples:
  arborspec train-draft --model smollm2-135m --out heads/smollm2-eagle3
  arborspec train-draft --model smollm2-135m --out /tmp/h --corpus-tokens 20000 --minutes 2   # a quick try
  arborspec train-draft --model smollm2-135m --init eagle3 --out heads/tuned --minutes 40      # fine-tune the shipped head
  arborspec generate --model smollm2-135m --draft eagle3:heads/smollm2-eagle3 --mode tree --prompt 'Hello'"""


def register(sub) -> None:
    import argparse

    p = sub.add_parser(
        "train-draft",
        help="train an EAGLE-3 draft head for a target on this machine",
        description=summary(__doc__),
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="target: a registered name (smollm2-135m), a GGUF file or a HF folder"
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the head (public EAGLE-3 layout)")
    c = p.add_argument_group("corpus")
    c.add_argument("--corpus-tokens", type=int, default=500_000, help="corpus size in tokens (default 500000)")
    c.add_argument(
        "--generated-tokens",
        type=int,
        default=300_000,
        help="of which the target's own responses (default 300000; the rest is text on this machine)",
    )
    c.add_argument("--gen-len", type=int, default=192, help="max tokens per generated response (default 192)")
    c.add_argument("--gen-batch", type=int, default=32, help="responses generated at once (default 32)")
    c.add_argument("--window", type=int, default=512, help="training window in tokens (default 512)")
    c.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size, FR-Spec (default 8192)")
    c.add_argument("--topk", type=int, default=8, help="target distribution kept per row, top-K (default 8)")
    t = p.add_argument_group("training")
    t.add_argument("--ttt-steps", type=int, default=4, help="unrolled draft steps per position (default 4)")
    t.add_argument("--batch", type=int, default=4, help="windows per batch (default 4)")
    t.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    t.add_argument("--epochs", type=float, default=2.0, help="passes over the corpus (default 2)")
    t.add_argument("--minutes", type=float, default=60.0, help="training time budget (default 60)")
    t.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    t.add_argument(
        "--init",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="fine-tune this EAGLE-3 head (public layout; `eagle3` = the one shipped for the model): "
        "its draft vocabulary and layer ids are kept",
    )
    t.add_argument("--no-resume", action="store_true", help="start training over (default: resume from OUT)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args) -> int:
    for name in ("corpus_tokens", "gen_len", "gen_batch", "window", "draft_vocab", "topk", "ttt_steps", "batch"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.generated_tokens < 0 or args.generated_tokens > args.corpus_tokens:
        raise InputError("--generated-tokens must be between 0 and --corpus-tokens")
    if args.window <= args.ttt_steps + 2:
        raise InputError("--window must be larger than --ttt-steps + 2")
    if args.minutes <= 0 or args.epochs <= 0 or args.lr <= 0:
        raise InputError("--minutes, --epochs and --lr must be > 0")
    if args.corpus_tokens < 2 * args.window:
        raise InputError(f"--corpus-tokens must hold at least two windows ({2 * args.window} tokens)")
    if args.out.exists() and not args.out.is_dir():
        raise InputError(f"--out {args.out} exists and is not a folder")
    import torch

    from arborspec.models.eagle3 import default_aux_layers
    from arborspec.models.registry import cache_dir, load_model
    from arborspec.tools.train import eagle3_corpus as eagle3_corpus
    from arborspec.tools.train import eagle3_train as eagle3_train

    progress = not args.quiet
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    cfg = loaded.config
    if cfg.family != "llama":
        raise InputError(f"train-draft trains EAGLE-3 heads for Llama-family targets, not {cfg.family}")
    aux, init, fixed_vocab, draft_vocab = default_aux_layers(cfg.n_layers), None, None, args.draft_vocab
    if args.init is not None:
        from arborspec.models.eagle3 import eagle3_folder, load_eagle3

        folder = eagle3_folder("eagle3", args.model) if str(args.init) == "eagle3" else args.init
        init = load_eagle3(folder, cfg)
        aux = list(init.config.aux_layers)
        fixed_vocab = (torch.arange(init.config.draft_vocab_size) + init.d2t.long()).numpy()
        draft_vocab = len(fixed_vocab)
    corpus = eagle3_corpus.build_corpus(
        loaded,
        aux,
        root=cache_dir() / "eagle3-corpus",
        total_tokens=args.corpus_tokens,
        generated_tokens=args.generated_tokens,
        gen_len=args.gen_len,
        batch=args.gen_batch,
        window=args.window,
        draft_vocab=draft_vocab,
        topk=args.topk,
        seed=args.seed,
        vocab=fixed_vocab,
        progress=progress,
    )
    info = json.loads((corpus / "corpus.json").read_text())
    print(
        f"corpus: {info['total_tokens']} tokens ({info['generated_tokens']} generated by the target in "
        f"{info['generated_responses']} responses, {info['machine_tokens']} from {info['machine_files']} files "
        f"on this machine), {info['windows']} windows; {corpus}",
        file=sys.stderr,
    )
    import numpy as np

    work = args.out / ".train"
    try:
        work.mkdir(parents=True, exist_ok=True)
        if args.no_resume:
            for f in ("train_state.pt", "training.json"):
                (work / f).unlink(missing_ok=True)
        vocab = np.load(corpus / "vocab.npy")
        if init is not None:
            head = init.float()
            for p in head.parameters():
                p.requires_grad_(True)
        else:
            head = eagle3_train.init_head(cfg, loaded.module, aux, vocab, args.seed)
        embed = loaded.module.model.embed_tokens.weight.detach().float()
        before = None
        if init is not None:  # the starting point, on the same held-out windows
            before = eagle3_train.heldout_agreement(head, embed, corpus, args.ttt_steps, args.batch)
        torch.manual_seed(args.seed)
        report = eagle3_train.train(
            head,
            embed,
            corpus,
            work,
            steps=args.ttt_steps,
            batch=args.batch,
            lr=args.lr,
            minutes=args.minutes,
            epochs=args.epochs,
            seed=args.seed,
            resume=not args.no_resume,
            progress=progress,
        )
        import shlex

        cmd = "arborspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])

        def commands_of(where: Path) -> list[str]:
            """The commands that trained the head in `where`, in order (its training.json)."""
            try:
                old = json.loads((where / "training.json").read_text())
                return list(old.get("commands") or ([old["command"]] if old.get("command") else []))
            except (ValueError, OSError):
                return []

        # the commands that made this head: the --init head's, a resumed run's, then this one
        history = commands_of(folder) if init is not None else []
        if not args.no_resume:
            history += [c for c in commands_of(args.out) if c not in history]
        report.update(
            {
                "corpus": info,
                "command": cmd,
                "commands": history + [cmd],
                "total_minutes": round((time.perf_counter() - t0) / 60, 1),
            }
        )
        if init is not None:
            report["init"] = {"folder": str(folder), "heldout_before": before}
        eagle3_train.save_public(
            head,
            args.out,
            {
                "arborspec_training": {
                    "heldout": report["heldout"],
                    "corpus_tokens": info["total_tokens"],
                    "minutes": report["minutes"],
                }
            },
        )
        (args.out / "training.json").write_text(json.dumps(report, indent=1))
    except OSError as e:
        from arborspec.runtime.fileio import describe_os_error

        raise OutputError(describe_os_error(e, args.out)) from e
    print(f"wrote {args.out} ({eagle3_train.head_bytes(head) / 1e6:.1f} MB): {eagle3_train.describe(report)}")
    return 0
