"""A train-draft corpus as token ids only, and back: `pack` writes one small file (every shard's
windows of token ids, its shard.json, the corpus's settings, draft vocabulary and progress);
`unpack` rebuilds the corpus folder from it, the target computing each shard's features, top-K
and greedy tokens again (runtime of build_features; on a GPU in seconds).

Why: a corpus is ~3.5 KB a token with its features (6 GB for the 1.89M tokens the shipped
SmolLM2 head saw) and took ~9 CPU-hours to generate, 55 % of them the generation. Its ids are 2
bytes a token: small enough to keep beside the code (a machine whose cache is emptied loses
only the features) and to carry to a lent GPU, which featurises them there and trains on them
with its own new shards (tools/train/gpu_train.sh, CORPUS_IDS=FILE).

Role in one decode step: none; it keeps the data that step 1's draft head is trained on.

    python -m arborspec.tools.train.corpus_ids pack --model smollm2-135m \\
        --corpus ~/.cache/arborspec/eagle3-corpus/KEY --out corpus-ids.npz
    python -m arborspec.tools.train.corpus_ids unpack --model smollm2-135m --ids corpus-ids.npz
    python -m arborspec.tools.train.corpus_ids unpack --model smollm2-135m --ids corpus-ids.npz --draft-vocab 16384
    python -m arborspec.tools.train.corpus_ids pack --model smollm2-135m --corpus ~/.cache/arborspec/eagle3-corpus/KEY \\
        --from 496 --out corpus-ids-00496.npz      # shards 496.. only: a continuation
    python -m arborspec.tools.train.corpus_ids unpack --model smollm2-135m --ids corpus-ids*.npz --ids-only
    python -m arborspec.tools.train.corpus_ids featurise --model smollm2-135m --corpus ~/.cache/arborspec/eagle3-corpus/KEY
    python -m arborspec.tools.train.corpus_ids featurise --model smollm2-135m --corpus ~/.cache/arborspec/eagle3-corpus/KEY \\
        --shards 480:508     # those shards only (train-draft --shards 480:508 trains on them)
    python -m arborspec.tools.train.corpus_ids stats --corpus ~/.cache/arborspec/eagle3-corpus/KEY --shards 566:
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import PartialFolder, atomic_write, atomic_write_bytes, atomic_write_json
from arborspec.tools.errors import reports_mistakes

FORMAT = 1
MEASURED = ("features_s", "feature_size")  # what unpack measures again: not kept in the pack


def target_sha(loaded) -> str:
    from arborspec.tools.train.eagle3_corpus import target_id_of

    return hashlib.sha256(target_id_of(loaded).encode()).hexdigest()[:16]


def pack(loaded, folder: Path, out: Path, first: int = 0) -> dict:
    """Write corpus `folder`'s ids, shard records, settings, vocabulary and progress to `out`
    (an .npz, written whole or not at all). first: pack shards `first`.. only (a continuation
    of the packs that hold the shards before it: `unpack` takes them all). -> what it holds."""
    from arborspec.tools.train.eagle3_corpus import corpus_settings, read_progress, shard_dirs

    settings = corpus_settings(folder)
    shards = shard_dirs(folder)
    if not shards:
        raise InputError(f"--corpus {folder}: no finished shard to pack")
    if not 0 <= first < len(shards):
        raise InputError(f"--from {first}: the corpus has shards 0..{len(shards) - 1}")
    arrays, infos = {}, []
    for i, d in enumerate(shards[first:], first):
        try:
            t = np.load(d / "tokens.npy")
            info = json.loads((d / "shard.json").read_text())
        except (OSError, ValueError):
            raise InputError(f"--corpus {folder}: shard {d.name} is incomplete (no tokens.npy or shard.json)") from None
        small = t.size == 0 or (0 <= t.min() and t.max() < 1 << 16)
        arrays[f"shard{i:05d}"] = t.astype(np.uint16) if small else t
        infos.append({k: v for k, v in info.items() if k not in MEASURED})
    prog = read_progress(folder)
    meta = {
        "format": FORMAT,
        "key": folder.name,
        "target": target_sha(loaded),
        "settings": settings,
        "progress": {k: v for k, v in prog.items() if k not in MEASURED},
        "first_shard": first,
        "shards": infos,
    }
    arrays["vocab"] = np.load(folder / "vocab.npy")
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(out, buf.getvalue())
    return {"shards": len(infos), "tokens": int(sum(a.size for k, a in arrays.items() if k.startswith("shard")))}


def read_pack(path: Path) -> tuple[dict, np.lib.npyio.NpzFile]:
    try:
        z = np.load(path, allow_pickle=False)
        meta = json.loads(bytes(z["meta"]).decode())
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"--ids {path}: not a corpus-ids file ({type(e).__name__})") from None
    if meta.get("format") != FORMAT:
        raise InputError(f"--ids {path}: format {meta.get('format')!r}, this arborspec reads {FORMAT}")
    return meta, z


class Packs:
    """One corpus from one pack or a chain of them (a pack and its continuations, `pack --from`),
    in any order: ordered by their first shard, each the continuation of the ones before it (the
    same corpus, settings and vocabulary). The whole corpus's progress is the last pack's."""

    def __init__(self, paths: list[Path]):
        packs = sorted((read_pack(p) + (p,) for p in paths), key=lambda m: m[0].get("first_shard", 0))
        head, z0, _ = packs[0]
        self.key, self.target, self.settings = head["key"], head["target"], head["settings"]
        self.vocab = np.asarray(z0["vocab"], dtype=np.int64)
        self.infos, self._z = [], []
        for meta, z, p in packs:
            if (meta["key"], meta["settings"]) != (self.key, self.settings) or not np.array_equal(
                z["vocab"], self.vocab
            ):
                raise InputError(
                    f"--ids {p}: another corpus than {packs[0][2]} (its key, settings or vocabulary differ)"
                )
            if meta.get("first_shard", 0) != len(self.infos):
                raise InputError(
                    f"--ids {p}: it starts at shard {meta.get('first_shard', 0)}, the packs before it hold "
                    f"{len(self.infos)} (give every pack of the chain)"
                )
            self.infos += meta["shards"]
            self._z += [z] * len(meta["shards"])
        self.progress = packs[-1][0]["progress"]

    def windows(self, i: int) -> np.ndarray:
        return self._z[i][f"shard{i:05d}"]


def progress_after(total: dict, shards: list[dict]) -> dict:
    """corpus.json as it stood after the first of a pack's shards (`shards`, their records): the
    pack's totals with the counts summed over those shards (responses: the prompts each took)."""
    return {
        **total,
        "shards": len(shards),
        "windows": sum(s["windows"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "generated_tokens": sum(s.get("generated_tokens", 0) for s in shards),
        "generated_responses": sum(s["prompts"][1] - s["prompts"][0] for s in shards),
        "next_prompt": shards[-1]["prompts"][1],
        "generation_s": round(sum(s.get("generation_s", 0.0) for s in shards), 1),
    }


def revocab(loaded, packs: Packs, draft_vocab: int) -> tuple[dict, np.ndarray, str]:
    """The packs' corpus over another draft vocabulary: the `draft_vocab` most frequent tokens of
    its windows, EOS always in (what `train-draft --revocab N` chooses from the same corpus, so a
    head re-vocabularied there reads the stored top-K as it is). -> (settings, vocabulary, key)."""
    from arborspec.tools.train import eagle3_corpus as ec

    v = loaded.config.vocab_size
    if not 1 <= draft_vocab <= v:
        raise InputError(f"--draft-vocab {draft_vocab}: not in 1..{v} (the target's vocabulary)")
    counts = ec.count_tokens((packs.windows(i) for i in range(len(packs.infos))), v)
    vocab = ec.revocabulary(counts, draft_vocab, loaded.tokenizer)
    sha = hashlib.sha256(vocab.tobytes()).hexdigest()[:16]
    settings = {**packs.settings, "draft_vocab": draft_vocab, "vocab_sha256": sha}
    return settings, vocab, ec.corpus_key(ec.target_id_of(loaded), settings)


def unpack(
    loaded,
    path: Path | list[Path],
    root: Path,
    device: str = "cpu",
    threads: int | None = None,
    verbose: bool = True,
    draft_vocab: int | None = None,
    ids_only: bool = False,
) -> Path:
    """Rebuild the corpus of ids file `path` (or a chain of them, Packs) under `root` (its own
    folder name, the key it had):
    the shards not there yet are written as token ids (each published whole, progress written
    after each), then every shard without features gets them from the target again
    (eagle3_corpus.featurise: one shard at a time; an interrupted unpack resumes). ids_only: the
    ids alone (seconds), for a grower that goes on from the pack's last prompt
    (`train-draft --defer-features`) or a later `featurise`. draft_vocab: the top-K over another
    draft vocabulary (`revocab`; its own folder). -> the corpus folder."""
    from arborspec.tools.train import eagle3_corpus as ec

    paths = [path] if isinstance(path, (str, Path)) else list(path)
    packs = Packs([Path(p) for p in paths])
    if packs.target != target_sha(loaded):
        raise InputError(f"--ids {paths[0]}: made for another target than this --model (its weights differ)")
    settings, infos, vocab = packs.settings, packs.infos, packs.vocab
    folder = root / packs.key
    if draft_vocab is not None and draft_vocab != len(vocab):
        settings, vocab, key = revocab(loaded, packs, draft_vocab)
        folder = root / key
    folder.mkdir(parents=True, exist_ok=True)
    lock, holder = ec.grow_lock(folder)
    if lock is None:
        raise InputError(f"another run (pid {holder}) is adding shards to {folder}: unpack when it is done")
    try:
        if (folder / "settings.json").is_file():
            if ec.corpus_settings(folder) != settings or not np.array_equal(np.load(folder / "vocab.npy"), vocab):
                raise InputError(f"{folder} holds a corpus with other settings or vocabulary: not overwritten")
        else:
            atomic_write(folder / "vocab.npy", lambda f: np.save(f, vocab))
            atomic_write_json(folder / "settings.json", settings)
        have = len(ec.shard_dirs(folder))
        measured = {k: v for k, v in ec.read_progress(folder).items() if k in MEASURED}  # of shards there
        for i in range(have, len(infos)):
            with PartialFolder(folder / "shards" / f"{i:05d}") as tmp:
                np.save(tmp / "tokens.npy", np.asarray(packs.windows(i), dtype=np.int32))
                atomic_write_json(tmp / "shard.json", infos[i])
            # progress as the shards so far hold it; the packs' own totals once all are in
            total = packs.progress
            prog = total if i + 1 == len(infos) else progress_after(total, infos[: i + 1])
            atomic_write_json(folder / "corpus.json", {**prog, **measured})
        if verbose and have < len(infos):
            ec.log(f"corpus ids: {len(infos) - have} shards of token ids written ({folder})")
        if not ids_only:
            ec.featurise(loaded, folder, device, threads, verbose, lock=lock)
    finally:
        lock.close()
    return folder


def corpus_stats(folder: Path, shards: range | None = None) -> dict:
    """What a corpus (its shards in `shards`, None: all) holds, from the shard records: per prompt
    source the shards, prompts, tokens and how many shards are featurised; per kind of the kinds
    stream (kinds.py) the prompts asked and the tokens (prompt + response) each put in."""
    from arborspec.tools.train.eagle3_corpus import featurised, in_shards, shard_dirs

    sources: dict = {}
    by_kind: dict = {}
    for d in shard_dirs(folder):
        if not in_shards(d, shards):
            continue
        info = json.loads((d / "shard.json").read_text())
        src = sources.setdefault(
            info.get("prompt_source", "templates"), dict.fromkeys(("shards", "prompts", "tokens", "featurised"), 0)
        )
        src["shards"] += 1
        src["prompts"] += info["prompts"][1] - info["prompts"][0]
        src["tokens"] += info.get("tokens", 0)
        src["featurised"] += featurised(d)
        for kind in info.get("prompt_kinds", []):
            by_kind.setdefault(kind, {"prompts": 0, "tokens": 0})["prompts"] += 1
        for kind, n in info.get("kind_tokens", {}).items():
            by_kind.setdefault(kind, {"prompts": 0, "tokens": 0})["tokens"] += n
    return {"sources": sources, "kinds": dict(sorted(by_kind.items()))}


CORPUS_HELP = "the corpus folder (~/.cache/arborspec/eagle3-corpus/KEY)"
MODEL_HELP = "the corpus's target (e.g. smollm2-135m)"


def _add_device_threads(parser) -> None:
    """--device and --threads: where the target computes the features."""
    parser.add_argument("--device", default="cpu", help="cpu (ONNX Runtime) or cuda[:N] (PyTorch on the GPU)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.train.corpus_ids",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + "\n".join(__doc__.rstrip().split("\n")[-10:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="write a corpus's ids, records and settings to one file")
    a.add_argument("--model", required=True, help=MODEL_HELP)
    a.add_argument("--corpus", type=Path, required=True, help=CORPUS_HELP)
    a.add_argument("--out", type=Path, required=True, help="the file to write (.npz)")
    a.add_argument(
        "--from",
        dest="first",
        type=int,
        default=0,
        metavar="N",
        help="pack shards N.. only: a continuation of the packs holding shards 0..N-1 (unpack takes them all), "
        "so a grown corpus adds a small file instead of rewriting the whole pack",
    )
    b = sub.add_parser("unpack", help="rebuild the corpus folder from such a file (features computed again)")
    b.add_argument("--model", required=True, help=MODEL_HELP)
    b.add_argument(
        "--ids", type=Path, nargs="+", required=True, help="the file pack wrote, or a pack and its continuations"
    )
    b.add_argument(
        "--root", type=Path, default=None, help="where corpora live (default: the user cache's eagle3-corpus)"
    )
    _add_device_threads(b)
    b.add_argument(
        "--ids-only",
        action="store_true",
        help="write the shards' token ids only (seconds): a grower goes on from the pack's last prompt "
        "(train-draft --defer-features); `featurise` computes the features later",
    )
    b.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="store the top-K over the N most frequent tokens of the pack (EOS always in) instead of its own draft "
        "vocabulary: another corpus folder, for a head trained with train-draft --revocab N",
    )
    f = sub.add_parser("featurise", help="compute the features of a corpus's shards that hold token ids only")
    f.add_argument("--model", required=True, help=MODEL_HELP)
    f.add_argument("--corpus", type=Path, required=True, help=CORPUS_HELP)
    _add_device_threads(f)
    f.add_argument(
        "--shards",
        default=None,
        metavar="N:M",
        help="only shards N..M-1 (N: to the end): the text a head has not seen yet, for train-draft --shards N:M",
    )
    g = sub.add_parser("stats", help="what a corpus holds: shards, prompts and tokens per prompt source and per kind")
    g.add_argument("--corpus", type=Path, required=True, help=CORPUS_HELP)
    g.add_argument("--shards", default=None, metavar="N:M", help="only shards N..M-1 (N: to the end)")
    return p


def _check_paths(args) -> None:
    """One line for a --corpus folder or an --ids file that is not there."""
    if args.cmd in ("pack", "featurise", "stats") and not args.corpus.is_dir():
        raise InputError(f"--corpus {args.corpus}: no such folder")
    for ids in args.ids if args.cmd == "unpack" else ():
        if not ids.is_file():
            raise InputError(f"--ids {ids}: no such file")


@reports_mistakes("corpus_ids")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _check_paths(args)
    if args.cmd == "stats":
        from arborspec.tools.train.eagle3_corpus import corpus_settings, shard_range

        corpus_settings(args.corpus)  # one line if it is not a corpus
        print(
            json.dumps(corpus_stats(args.corpus, None if args.shards is None else shard_range(args.shards)), indent=1)
        )
        return 0
    from arborspec.models.registry import cache_dir, load_model

    loaded = load_model(args.model)
    if args.cmd == "pack":
        got = pack(loaded, args.corpus, args.out, args.first)
        print(f"{args.out}: {got['shards']} shards, {got['tokens']} tokens ({args.out.stat().st_size} bytes)")
    elif args.cmd == "featurise":
        from arborspec.tools.train.eagle3_corpus import corpus_settings, featurise, shard_range

        corpus_settings(args.corpus)  # one line if it is not a corpus
        shards = None if args.shards is None else shard_range(args.shards)
        n = featurise(loaded, args.corpus, args.device, args.threads, shards=shards)
        print(f"corpus: {args.corpus}: {n} shards featurised")
    else:
        folder = unpack(
            loaded,
            args.ids,
            args.root or cache_dir() / "eagle3-corpus",
            args.device,
            args.threads,
            draft_vocab=args.draft_vocab,
            ids_only=args.ids_only,
        )
        print(f"corpus: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
