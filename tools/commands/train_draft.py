"""`arborspec train-draft`: train an EAGLE-3 head for a target on this machine, over as many runs
as it takes, and write it in the public EAGLE-3 checkpoint layout (config.json +
model.safetensors), which `--draft eagle3:DIR` (and other EAGLE-3 tools) load.

Role: none in a decode step; it makes the draft of step 1. Stages, each resumable: the corpus
(the target's own responses to a varied prompt mix, appended in shards until --corpus-tokens or
--corpus-minutes; cached in the user cache), the held-out set (tools/data/heldout_prompts.json
and the target's responses; built once), then training with the training-time test, which
checkpoints OUT/.train/train_state.pt every few minutes and continues from it on the next run.
`kill PID` (SIGTERM) stops a run cleanly: checkpoint, held-out measure, head written. --install
then replaces the shipped head only if this one measures better on the held-out set.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from arborspec.runtime.errors import InputError, OutputError
from arborspec.tools.commands.options import add_seed_arg, command_parser

EXAMPLE = """examples:
  arborspec train-draft --model smollm2-135m --out heads/smollm2-eagle3
  arborspec train-draft --model smollm2-135m --out /tmp/h --corpus-tokens 20000 --minutes 2   # a quick try
  arborspec train-draft --model smollm2-135m --init eagle3 --out heads/tuned --minutes 40      # fine-tune the shipped head
  arborspec train-draft --model smollm2-135m --init eagle3 --revocab 16384 --out heads/v16 --corpus-minutes 0 \\
      --corpus ~/.cache/arborspec/eagle3-corpus/KEY --minutes 60   # its vocabulary re-chosen from the corpus
  arborspec train-draft --model smollm2-135m --init eagle3 --out heads/gpu --device cuda --gen-batch 128 \\
      --corpus-tokens 20000000 --corpus-minutes 4 --minutes 4 --batch 32   # on a GPU (tools/train/gpu_train.sh)
  nohup nice -n 19 arborspec train-draft --model smollm2-135m --init eagle3 --out ~/.cache/arborspec/train/h \\
      --threads 1 --corpus-tokens 2000000 --corpus-minutes 30 --minutes 30 > train.log 2>&1 &  # rerun: it resumes
  arborspec train-draft --model smollm2-135m --init eagle3 --out ~/.cache/arborspec/train/h --corpus-minutes 0 \\
      --minutes 0 --install   # measure the trained head against the shipped one; install it only if better
  arborspec train-draft --model smollm2-135m --init eagle3 --out ~/.cache/arborspec/train/h --corpus-tokens 20000000 \\
      --corpus-minutes 600 --minutes 0 --defer-features   # grow the corpus as token ids only (features later)
  arborspec train-draft --model smollm2-135m --init eagle3 --out ~/.cache/arborspec/train/new --corpus-minutes 0 \\
      --shards 480:516 --minutes 50 --lr 1e-4   # the newest shards only (corpus_ids featurise --shards 480:516)"""


def register(sub) -> None:
    p = command_parser(
        sub, "train-draft", "train an EAGLE-3 draft head for a target on this machine (resumable)", __doc__, EXAMPLE
    )
    p.add_argument(
        "--model", required=True, help="target: a registered name (smollm2-135m), a GGUF file or a HF folder"
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the head (public EAGLE-3 layout)")
    c = p.add_argument_group("corpus (appended in shards; a later run continues it)")
    _add_corpus_args(c)
    t = p.add_argument_group("training (resumes from OUT/.train/train_state.pt)")
    _add_training_args(t)
    _add_corpus_dir_arg(c)  # (after the training flags in the usage line, as it always was)
    _add_precision_args(t)
    _add_install_and_machine_args(p)
    p.set_defaults(run=run)


def _add_corpus_args(c) -> None:
    """How the corpus grows: its size, time, prompts and the features kept per token."""
    c.add_argument("--corpus-tokens", type=int, default=500_000, help="grow the corpus to this many tokens (500000)")
    c.add_argument("--corpus-minutes", type=float, default=60.0, help="time this run may add shards (60; 0: none)")
    c.add_argument("--shard-prompts", type=int, default=64, help="responses generated per shard (default 64)")
    c.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="where a new corpus starts in the prompt stream (default 0; e.g. the next_prompt of the corpus the "
        "shipped head saw, in its training.json, to fine-tune it on new text)",
    )
    c.add_argument(
        "--prompt-source",
        choices=("self", "templates", "kinds"),
        default="self",
        help="prompts of the shards this run adds: self (default: requests the target writes itself from its chat "
        "template's user turn, new in every shard) or templates (the built-in template stream, which repeats itself: "
        "2,643 distinct prompts in its first 7,232) or kinds (translation, short QA, maths, long-document summaries, "
        "grounded answers: tools/train/kinds.py)",
    )
    c.add_argument(
        "--defer-features",
        action="store_true",
        help="add shards of token ids only (no features: ~1.5x the tokens a minute on the CPU) and stop after the "
        "corpus (needs --minutes 0); `python -m arborspec.tools.train.corpus_ids featurise`, or a GPU, computes "
        "their features before a run trains on them",
    )
    c.add_argument("--gen-len", type=int, default=192, help="max tokens per generated response (default 192)")
    c.add_argument("--gen-batch", type=int, default=32, help="responses generated at once (default 32)")
    c.add_argument("--window", type=int, default=512, help="training window in tokens (default 512)")
    c.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size, FR-Spec (default 8192)")
    c.add_argument("--topk", type=int, default=8, help="target distribution kept per row, top-K (default 8)")


def _add_training_args(t) -> None:
    """The training-time test's steps, batch, schedule, loss and the head it starts from."""
    t.add_argument("--ttt-steps", type=int, default=4, help="unrolled draft steps per position (default 4)")
    t.add_argument("--batch", type=int, default=4, help="windows per batch (default 4)")
    t.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: 5e-4 for a new run; a resumed run keeps its checkpoint's unless given)",
    )
    t.add_argument("--minutes", type=float, default=60.0, help="training time of this run (default 60; 0: none)")
    t.add_argument(
        "--schedule-batches",
        type=int,
        default=None,
        help="batches the warm-up + cosine schedule spans (default: 2 passes over the corpus at the first run; "
        "a resumed run keeps its checkpoint's unless given); training stops there",
    )
    t.add_argument("--eval-minutes", type=float, default=10.0, help="held-out measure every N minutes (default 10)")
    t.add_argument(
        "--template-share",
        type=float,
        default=None,
        metavar="F",
        help="each epoch: every window of the self-written shards once, plus windows of template-prompt shards "
        "making up this share of it (e.g. 0.25; default: every window once; a resumed run keeps its checkpoint's "
        "unless given)",
    )
    t.add_argument(
        "--shards",
        default=None,
        metavar="N:M",
        help="train on corpus shards N..M-1 only (N: to the end), e.g. the newest text, featurised alone with "
        "`corpus_ids featurise --shards N:M` where the whole corpus would take the CPU hours; a resumed run keeps "
        "its checkpoint's range",
    )
    t.add_argument(
        "--featurised-prefix",
        action="store_true",
        help="train on the shards (of --shards) whose features are there, up to the first that holds ids only: "
        "a run beside `corpus_ids featurise`, each later run taking the shards it has finished since",
    )
    t.add_argument(
        "--step-decay",
        type=float,
        default=None,
        metavar="F",
        help="the loss of training-time-test step k weighs F**k (default 0.8, EAGLE-3's; lower puts more of it on "
        "depth 1; a resumed run keeps its checkpoint's unless given)",
    )
    add_seed_arg(t, "training seed (default 0)")
    t.add_argument(
        "--init",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="fine-tune this EAGLE-3 head (public layout; `eagle3` = the one shipped for the model): "
        "its layer ids are kept, and its draft vocabulary unless --revocab",
    )
    t.add_argument(
        "--revocab",
        type=int,
        default=None,
        metavar="N",
        help="with --init: re-choose the head's draft vocabulary as the N most frequent tokens of the corpus "
        "(FR-Spec; every weight kept, new tokens' rows from the target's LM head); the corpus's stored top-K is "
        "mapped onto it. A resumed run keeps its checkpoint's vocabulary",
    )
    t.add_argument(
        "--revocab-by",
        choices=("tokens", "kinds"),
        default="tokens",
        help="with --revocab: tokens (default: the corpus's windows, every token counted once) or kinds (the target's "
        "greedy answers, each kind of request weighing the same: tools/train/vocab_choice.py; counts kept in "
        "OUT/.train/kind_counts.npz)",
    )


def _add_corpus_dir_arg(c) -> None:
    """--corpus DIR: this corpus folder, whatever the settings' key."""
    c.add_argument(
        "--corpus",
        type=Path,
        default=None,
        metavar="DIR",
        help="grow and train on this corpus folder (~/.cache/arborspec/eagle3-corpus/<key>) whatever its settings, "
        "not the one the settings and the --init head's vocabulary key: e.g. after --revocab",
    )


def _add_precision_args(t) -> None:
    """--precision of the training matmuls and --no-resume."""
    t.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="training matmuls: bf16 autocast (weights and optimiser stay fp32; ~2x on a CPU with AVX512-BF16) or "
        "fp32; auto (default): bf16 where the device has native bf16, else fp32. The held-out measure is fp32",
    )
    t.add_argument("--no-resume", action="store_true", help="start training over (default: resume from OUT)")


def _add_install_and_machine_args(p) -> None:
    """--install / --install-head (the shipped head replaced only by a better one), threads, device."""
    p.add_argument(
        "--install",
        action="store_true",
        help="afterwards, replace the head shipped for --model with OUT's only if it beats it on the held-out set",
    )
    p.add_argument(
        "--install-head",
        type=Path,
        default=None,
        metavar="DIR",
        help="no corpus, no training: measure the head in DIR (public layout, e.g. one trained on a GPU) and the "
        "shipped one on the held-out set here, and install DIR's only if it beats it",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch and ONNX Runtime; default: all)")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (the corpus through ONNX Runtime) or cuda[:N] (the corpus and the training in PyTorch on the GPU)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --device cuda: the corpus generator's batched calls replayed as CUDA graphs (eager calls are "
        "launch-bound there: 5.4x on one-sequence decoding measured on an H100)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars (also off when stderr is not a terminal)")


def check_args(args) -> None:
    if args.install_head is not None and not (args.install_head / "model.safetensors").is_file():
        raise InputError(
            f"--install-head {args.install_head}: no model.safetensors there (a public-layout EAGLE-3 head)"
        )
    if args.revocab is not None and args.init is None:
        raise InputError("--revocab re-chooses the vocabulary of a head given with --init")
    if args.revocab_by != "tokens" and args.revocab is None:
        raise InputError("--revocab-by chooses how --revocab counts: give --revocab N")
    if args.corpus is not None and not args.corpus.is_dir():
        raise InputError(f"--corpus {args.corpus}: no such folder")
    for name in ("corpus_tokens", "shard_prompts", "gen_len", "gen_batch", "window", "draft_vocab", "topk", "revocab"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.first_prompt < 0:
        raise InputError("--first-prompt must be >= 0")
    if args.template_share is not None and not 0.0 <= args.template_share < 1.0:
        raise InputError(f"--template-share must be in [0, 1), got {args.template_share}")
    if args.step_decay is not None and not 0.0 < args.step_decay <= 1.0:
        raise InputError(f"--step-decay must be in (0, 1], got {args.step_decay}")
    for name in ("ttt_steps", "batch"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.window <= args.ttt_steps + 2:
        raise InputError("--window must be larger than --ttt-steps + 2")
    if args.minutes < 0 or args.corpus_minutes < 0 or (args.lr is not None and args.lr <= 0) or args.eval_minutes <= 0:
        raise InputError("--minutes and --corpus-minutes must be >= 0, --lr and --eval-minutes > 0")
    if args.defer_features and (args.minutes > 0 or args.install or args.install_head is not None):
        raise InputError(
            "--defer-features only grows the corpus (its shards have no features to train on): give --minutes 0"
        )
    if args.shards is not None:
        from arborspec.tools.train.eagle3_corpus import shard_range

        args.shards = shard_range(args.shards)
        if args.defer_features:
            raise InputError("--shards chooses what a run trains on; --defer-features trains on nothing")
    if args.schedule_batches is not None and args.schedule_batches < 1:
        raise InputError("--schedule-batches must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise InputError("--threads must be >= 1")
    if args.out.exists() and not args.out.is_dir():
        raise InputError(f"--out {args.out} exists and is not a folder")
    if args.install and args.init is not None and str(args.init) != "eagle3":
        raise InputError("--install replaces the shipped head: use it with --init eagle3 or without --init")
    dev = str(args.device)
    if dev != "cpu" and not (dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise InputError(f"--device must be cpu, cuda or cuda:N, not {dev!r}")
    if args.cuda_graphs and dev == "cpu":
        raise InputError("--cuda-graphs needs --device cuda (CUDA graphs replay GPU calls)")
    if dev != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {dev}: this torch has no CUDA GPU (torch {torch.__version__})")


def commands_of(where: Path) -> list[str]:
    """The commands that trained the head in `where`, in order (its training.json)."""
    try:
        old = json.loads((where / "training.json").read_text())
        return list(old.get("commands") or ([old["command"]] if old.get("command") else []))
    except (ValueError, OSError):
        return []


def run(args) -> int:
    check_args(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from arborspec.models.eagle3 import eagle3_folder
    from arborspec.models.registry import cache_dir, load_model
    from arborspec.tools.train import eagle3_corpus, eagle3_heldout, eagle3_train
    from arborspec.tools.train.eagle3_corpus import log

    progress = not args.quiet and sys.stderr.isatty()
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    cfg = loaded.config
    if cfg.family != "llama":
        raise InputError(f"train-draft trains EAGLE-3 heads for Llama-family targets, not {cfg.family}")
    shipped = (
        eagle3_folder("eagle3", args.model) if args.install or args.install_head or str(args.init) == "eagle3" else None
    )
    if args.install_head is not None:
        return install_head(args, loaded, shipped)
    start = _starting_point(args, cfg, shipped)
    corpus = _grow_corpus(args, loaded, start)
    info = eagle3_corpus.read_progress(corpus)
    log(
        f"corpus: {info['tokens']} tokens in {info['windows']} windows, {info['shards']} shards "
        f"({info['generated_responses']} responses by the target); {corpus}"
    )
    if args.defer_features:
        waiting = sum(not eagle3_corpus.featurised(d) for d in eagle3_corpus.shard_dirs(corpus))
        log(f"corpus: {waiting} shards hold token ids only (--defer-features): no training in this run")
        return 0

    def target_source():  # what runs the target for the held-out set, built only if it is not cached
        return eagle3_corpus.corpus_source(loaded, corpus, start["aux"], args.device)

    heldout = eagle3_heldout.build_heldout(
        loaded, start["aux"], target_source, cache_dir() / "eagle3-heldout", threads=args.threads
    )
    embed = loaded.module.model.embed_tokens.weight.detach().float()

    def measure(h):
        return eagle3_heldout.evaluate_heldout(h, embed, heldout, args.ttt_steps)

    work = args.out / ".train"
    try:
        work.mkdir(parents=True, exist_ok=True)
        if args.no_resume:
            for f in ("train_state.pt", "training.json", "before.json"):
                (work / f).unlink(missing_ok=True)
        head = _head_to_train(args, loaded, start, corpus)
        before_file = work / "before.json"  # the starting point on the held-out set, measured once
        if not before_file.is_file():
            from arborspec.runtime.fileio import atomic_write_json

            atomic_write_json(before_file, measure(head))
        before = json.loads(before_file.read_text())
        torch.manual_seed(args.seed)
        report = eagle3_train.train(head, embed, corpus, work, _train_config(args, measure, before, progress))
        report.update(_run_record(args, info, heldout, before, t0))
        _publish(args, head, report, info, work)
        if args.install:
            install(args, shipped, report, measure, cfg)
    except OSError as e:
        from arborspec.runtime.fileio import describe_os_error

        if (
            isinstance(e, FileNotFoundError)
            and e.filename
            and not Path(e.filename).resolve().is_relative_to(args.out.resolve())
        ):
            raise  # a file it reads is gone (the CLI's line names it), not OUT unwritable
        raise OutputError(describe_os_error(e, e.filename or args.out)) from e
    return 0


def _starting_point(args, cfg, shipped) -> dict:
    """The head training starts from (--init: a trained one, its aux layers and draft vocabulary
    fixed; else None: a new head on the default aux layers and --draft-vocab tokens)."""
    import torch

    from arborspec.models.eagle3 import default_aux_layers, load_eagle3

    start = {"aux": default_aux_layers(cfg.n_layers), "init": None, "fixed_vocab": None,
             "draft_vocab": args.draft_vocab}
    if args.init is not None:
        folder = shipped if str(args.init) == "eagle3" else args.init
        init = load_eagle3(folder, cfg)
        if args.revocab is not None and args.revocab > cfg.vocab_size:
            raise InputError(f"--revocab {args.revocab} exceeds the target's vocabulary ({cfg.vocab_size})")
        fixed_vocab = (torch.arange(init.config.draft_vocab_size) + init.d2t.long()).numpy()
        start.update(aux=list(init.config.aux_layers), init=init, fixed_vocab=fixed_vocab,
                     draft_vocab=len(fixed_vocab))
    return start


def _grow_corpus(args, loaded, start: dict) -> Path:
    """The corpus folder, grown by this run's budget (--corpus-tokens, --corpus-minutes)."""
    from arborspec.models.registry import cache_dir
    from arborspec.tools.train import eagle3_corpus

    return eagle3_corpus.grow_corpus(
        loaded,
        start["aux"],
        root=cache_dir() / "eagle3-corpus",
        total_tokens=args.corpus_tokens,
        minutes=args.corpus_minutes,
        shard_prompts=args.shard_prompts,
        gen_len=args.gen_len,
        batch=args.gen_batch,
        window=args.window,
        draft_vocab=start["draft_vocab"],
        topk=args.topk,
        seed=args.seed,
        vocab=start["fixed_vocab"],
        threads=args.threads,
        device=args.device,
        first_prompt=args.first_prompt,
        cuda_graphs=args.cuda_graphs,
        prompt_source=args.prompt_source,
        folder=args.corpus,
        features=not args.defer_features,
    )


def _head_to_train(args, loaded, start: dict, corpus: Path):
    """--init's head (over a re-chosen vocabulary with --revocab), trainable; else a new one
    over the corpus's draft vocabulary."""
    import numpy as np

    from arborspec.tools.train import eagle3_corpus, eagle3_train
    from arborspec.tools.train.eagle3_corpus import log

    cfg = loaded.config
    if start["init"] is None:
        return eagle3_train.init_head(cfg, loaded.module, start["aux"], np.load(corpus / "vocab.npy"), args.seed)
    head = start["init"].float()
    if args.revocab is not None:
        if args.revocab_by == "kinds":
            from arborspec.tools.train import vocab_choice

            vocab = vocab_choice.vocab_for(loaded, corpus, args.revocab, args.out / ".train" / "kind_counts.npz")
        else:
            counts = eagle3_corpus.token_counts(corpus, cfg.vocab_size)  # grow_corpus required a tokenizer
            vocab = eagle3_corpus.revocabulary(counts, args.revocab, loaded.tokenizer)
        head = eagle3_train.revocab_head(head, vocab, loaded.module)
        log(
            f"train-draft: draft vocabulary re-chosen: {args.revocab} tokens, "
            f"{int((~np.isin(vocab, start['fixed_vocab'])).sum())} new to the head (their rows mapped from the "
            "target's LM head)"
        )
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def _train_config(args, measure, before: dict, progress: bool):
    """The flags as eagle3_train's TrainConfig; a head is kept as best when it ranks above the
    best so far (eagle3_heldout.ranks_above, against the starting point `before`)."""
    from arborspec.tools.train import eagle3_heldout, eagle3_train

    return eagle3_train.TrainConfig(
        steps=args.ttt_steps,
        batch=args.batch,
        lr=args.lr,
        minutes=args.minutes,
        schedule_batches=args.schedule_batches,
        seed=args.seed,
        resume=not args.no_resume,
        evaluate=measure,
        better=lambda new, old: eagle3_heldout.ranks_above(new, old, before),
        eval_every_s=args.eval_minutes * 60,
        progress=progress,
        device=args.device,
        precision=eagle3_train.training_precision(args.precision, args.device),
        template_share=args.template_share,
        shards=args.shards,
        featurised_prefix=args.featurised_prefix,
        step_decay=args.step_decay,
    )


def _run_record(args, info: dict, heldout: Path, before: dict, t0: float) -> dict:
    """What training.json adds to the trainer's report: the corpus, the held-out set and the
    starting point, the commands that made the head, this run's minutes."""
    cmd = "arborspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    history = [] if args.no_resume else commands_of(args.out)
    return {
        "corpus": info,
        "heldout_set": json.loads((heldout / "heldout.json").read_text()),
        "heldout_before": before,
        "init": str(args.init) if args.init is not None else None,
        "command": cmd,
        "commands": history + [cmd],
        "total_minutes_this_run": round((time.perf_counter() - t0) / 60, 1),
    }


def _publish(args, head, report: dict, info: dict, work: Path) -> None:
    """OUT: the best head measured (not the last, where an earlier one ranked above it) in the
    public layout, and training.json."""
    import torch

    from arborspec.tools.train import eagle3_train
    from arborspec.tools.train.eagle3_corpus import log

    best = report.get("best")
    if best is not None and best["batch"] != report["batches"]:  # publish the best head, not the last
        head.load_state_dict(torch.load(work / "best_head.pt", map_location="cpu"))
        report["heldout_last"] = report["heldout"]
        report["heldout"] = {k: v for k, v in best.items() if k not in ("batch", "minutes", "cpu_minutes")}
        log(f"train-draft: the head of batch {best['batch']} measured best on the held-out set: publishing it")
    meta = {"heldout": report["heldout"], "corpus_tokens": info["tokens"], "minutes": report["minutes"]}
    if report.get("shards"):
        meta["shards"] = report["shards"]  # trained on these shards of the corpus only
    eagle3_train.save_public(head, args.out, {"arborspec_training": meta})
    (args.out / "training.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({eagle3_train.head_bytes(head) / 1e6:.1f} MB): {eagle3_train.describe(report)}")


def say_verdict(done: bool, new: dict, old: dict, shipped: Path) -> None:
    from arborspec.tools.train.eagle3_heldout import TUNED

    verdict = "installed" if done else "NOT installed (it does not beat the shipped head)"
    print(
        f"{verdict}: held-out top-1 per depth {new['top1_agreement_per_depth']} vs shipped "
        f"{old['top1_agreement_per_depth']}; tokens per step of the tuned tree "
        f"{new['tokens_per_step'][TUNED]} vs {old['tokens_per_step'][TUNED]} ({shipped})"
    )


def install_head(args, loaded, shipped: Path) -> int:
    """--install-head DIR: both heads measured on this machine's held-out set (built once, on the
    CPU), DIR's installed only if it beats the shipped one (the same rule as --install)."""
    from arborspec.models.eagle3 import load_eagle3
    from arborspec.tools.train import eagle3_heldout

    cfg = loaded.config
    measure = eagle3_heldout.heldout_measure(loaded, args.threads, args.ttt_steps)
    new = measure(load_eagle3(args.install_head, cfg).float())
    old = measure(load_eagle3(shipped, cfg).float())
    done = eagle3_heldout.install_if_better(args.install_head, shipped, new, old)
    say_verdict(done, new, old, shipped)
    return 0


def install(args, shipped: Path, report: dict, measure, cfg) -> None:
    """The compare-and-install step: the shipped head measured on the same held-out set now."""
    from arborspec.models.eagle3 import load_eagle3
    from arborspec.tools.train import eagle3_heldout

    old = measure(load_eagle3(shipped, cfg).float())
    new = report["heldout"]
    done = eagle3_heldout.install_if_better(args.out, shipped, new, old)
    say_verdict(done, new, old, shipped)
