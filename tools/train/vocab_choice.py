"""The head's draft vocabulary chosen from what the target writes, kind by kind (issue 67, item 2).

Role in one decode step: none; it chooses the draft vocabulary (d2t) step 1's head scores, whose
coverage of the target's tokens caps how often the head can agree with step 3's verify.

A corpus shard's token stream is, row after row, a chat prompt, the target's response and one
separator (eagle3_corpus.Corpus._responses): the first half of a shard's prompts answered greedily,
the rest sampled. `response_rows` finds each response again from the prompt texts the shard
records (each prompt's ids are checked against the stream, so a shard laid out otherwise is an
error, never a silent miscount); `kind_counts` counts the target's own (greedy) response tokens per
kind (the kinds corpus's five kinds, "chat" for every other shard); `choose_vocab` takes the N
tokens with the highest mean share over the kinds (each kind weighs the same, so 34k tokens of
translation are not drowned by 11M of chat), EOS always in; `coverage` is the share of a kind's
tokens a vocabulary holds: the ceiling it puts on that kind's agreement.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHAT = "chat"  # the kind of every shard not grown from kinds.py's prompts


def response_rows(stream: np.ndarray, prompts: list, eos: set) -> list[tuple[int, np.ndarray]]:
    """(row, response ids) of each prompt of `prompts` (the ids of the rows the shard holds, in
    order) found in `stream` (the shard's windows, flattened): prompt, response up to its first
    EOS, then separators. The stream's last row may be cut: what of it is there is returned."""
    out, pos, eos_ids = [], 0, np.fromiter(eos, dtype=np.int64)
    for r, p in enumerate(prompts):
        end = pos + len(p)
        if end > len(stream):
            break  # the windows end inside this prompt
        if not np.array_equal(stream[pos:end], p):
            raise ValueError(f"row {r}: the stream does not hold its prompt at position {pos}")
        stops = np.flatnonzero(np.isin(stream[end:], eos_ids))
        stop = end + int(stops[0]) if len(stops) else len(stream)
        out.append((r, np.asarray(stream[end:stop])))
        pos = stop
        while pos < len(stream) and int(stream[pos]) in eos:
            pos += 1  # the response's own EOS and the separator
    return out


def shard_responses(folder: Path, prompt_ids, max_prompt: int, eos: set) -> list[tuple[str, bool, np.ndarray]]:
    """(kind, greedy, response ids) of each response a corpus shard holds. prompt_ids: text ->
    its chat-template ids; max_prompt: the longest prompt the corpus answered (the graph's
    context less gen_len; longer ones were left out of the stream)."""
    info = json.loads((folder / "shard.json").read_text())
    texts = info.get("prompt_texts") or []
    kinds = info.get("prompt_kinds") or [CHAT] * len(texts)
    ids = [prompt_ids(t) for t in texts]
    half = len(texts) // 2
    fits = [i for i, p in enumerate(ids) if len(p) <= max_prompt]
    stream = np.load(folder / "tokens.npy").ravel().astype(np.int64)
    rows = response_rows(stream, [ids[i] for i in fits], eos)
    return [(kinds[fits[r]], fits[r] < half, resp) for r, resp in rows]


def kind_counts(responses, vocab_size: int, greedy_only: bool = True) -> dict[str, np.ndarray]:
    """{kind: how often each token id occurs in its responses} over (kind, greedy, ids) rows."""
    out: dict[str, np.ndarray] = {}
    for kind, greedy, ids in responses:
        if greedy_only and not greedy:
            continue
        c = out.setdefault(kind, np.zeros(vocab_size, dtype=np.int64))
        c += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return out


def choose_vocab(counts: dict[str, np.ndarray], n: int, always=()) -> np.ndarray:
    """The `n` token ids with the highest mean share over the kinds of `counts` (each kind's
    counts divided by its total), ties by the total count then by id; `always` (EOS) first."""
    kinds = [c for c in counts.values() if c.sum() > 0]
    if not kinds:
        raise ValueError("no token counted: the vocabulary cannot be chosen")
    share = np.mean([c / c.sum() for c in kinds], axis=0)
    total = np.sum(kinds, axis=0)
    share[list(always)] = share.max() + 1.0
    order = np.lexsort((np.arange(len(share)), -total, -share))
    return order[:n].astype(np.int64)


def coverage(vocab: np.ndarray, counts: dict[str, np.ndarray]) -> dict[str, float]:
    """{kind: the share of its counted tokens `vocab` holds} (4 digits)."""
    held = np.zeros(len(next(iter(counts.values()))), dtype=bool)
    held[np.asarray(vocab, dtype=np.int64)] = True
    return {k: round(float(c[held].sum() / max(1, c.sum())), 4) for k, c in counts.items()}


def sizes_table(counts: dict[str, np.ndarray], sizes, always=(), current=None) -> dict:
    """{label: coverage per kind} for each size of `choose_vocab` and for `current` (a head's own
    vocabulary, target ids)."""
    rows = {f"kinds-{n}": coverage(choose_vocab(counts, n, always), counts) for n in sizes}
    if current is not None:
        rows = {f"current-{len(current)}": coverage(current, counts), **rows}
    return rows


def corpus_counts(loaded, corpus: Path, shards=None, greedy_only: bool = True) -> dict[str, np.ndarray]:
    """kind_counts over every shard of a corpus folder (`shards`: a range of shard numbers)."""
    from arborspec.tools.train import eagle3_corpus as ec

    tok, settings = loaded.tokenizer, ec.corpus_settings(corpus)
    max_prompt = ec.graph_context(loaded.config, settings) - settings["gen_len"]
    eos = set(tok.meta.get("eos_token_ids") or [])
    out: dict[str, np.ndarray] = {}
    for d in ec.shard_dirs(corpus):
        if not ec.in_shards(d, shards):
            continue
        rows = shard_responses(d, lambda t: ec.chat_ids(tok, t), max_prompt, eos)
        for kind, c in kind_counts(rows, loaded.config.vocab_size, greedy_only).items():
            out[kind] = out[kind] + c if kind in out else c
    return out


def save_counts(path: Path, counts: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **counts)


def load_counts(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def vocab_for(loaded, corpus: Path, n: int, cache: Path) -> np.ndarray:
    """`train-draft --revocab N --revocab-by kinds`: choose_vocab over the corpus's counts per
    kind (EOS in), the counts kept in `cache` (a resumed run reads them, not the corpus again)."""
    if cache.is_file():
        counts = load_counts(cache)
    else:
        counts = corpus_counts(loaded, corpus)
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_counts(cache, counts)
    return choose_vocab(counts, n, list(loaded.tokenizer.meta.get("eos_token_ids") or []))


def heldout_coverage(loaded, vocabs: dict[str, np.ndarray], aux) -> dict[str, dict]:
    """{label: {kind: share of the held-out greedy answer tokens the vocabulary holds}} over the
    chat and kinds held-out sets (eagle3_heldout's, built once in the user cache)."""
    from arborspec.models.registry import cache_dir
    from arborspec.tools.train import eagle3_heldout as eh

    root = cache_dir() / "eagle3-heldout"

    def source():
        return eh.heldout_graph(loaded, aux, root)

    folders = [eh.build_heldout(loaded, aux, source, root)]
    folders += list(eh.kinds_heldout(loaded, aux, source, root).values())
    out = {}
    for label, vocab in vocabs.items():
        row = {}
        for f in folders:
            row.update(eh.in_vocab_by_kind(f, vocab))
        row["chat (all)"] = eh.in_vocab_share(np.load(folders[0] / "top1.npy"), np.load(folders[0] / "spans.npy"), vocab)
        out[label] = row
    return out


def table(rows: dict[str, dict]) -> str:
    """{label: {kind: share}} as a Markdown table, one row per label."""
    kinds = sorted({k for r in rows.values() for k in r})
    lines = ["| vocabulary | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for label, r in rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in kinds) + " |")
    return "\n".join(lines)


def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.train.vocab_choice",
        description="The draft vocabulary chosen from the target's own greedy answers per kind (each kind weighs the "
        "same): coverage per kind of the head's vocabulary and of the chosen one at each size, on the corpus and on "
        "the held-out sets.",
        epilog="example:\n  python -m arborspec.tools.train.vocab_choice --model smollm2-135m "
        "--corpus ~/.cache/arborspec/eagle3-corpus/KEY --sizes 8192 16384 32768 --heldout --out /tmp/cov.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="the target (e.g. smollm2-135m)")
    p.add_argument("--corpus", type=Path, required=True, help="a corpus folder (~/.cache/arborspec/eagle3-corpus/KEY)")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768], help="vocabulary sizes to compare")
    p.add_argument("--head", default="eagle3", help="the head whose vocabulary is compared (default: the shipped one)")
    p.add_argument("--counts", type=Path, default=None, help="cache of the per-kind counts (.npz; written if absent)")
    p.add_argument("--heldout", action="store_true", help="also the coverage of the held-out sets' greedy answers")
    p.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    p.add_argument(
        "--write-head",
        type=Path,
        default=None,
        metavar="DIR",
        help="write --head over the chosen vocabulary of --size tokens here (public layout; kept rows bit for bit, "
        "new rows from the target's LM head through the kept rows' map): train it with train-draft --init DIR",
    )
    p.add_argument("--size", type=int, default=None, help="the vocabulary size --write-head uses")
    return p


def check_args(a) -> None:
    from arborspec.runtime.errors import InputError

    if not (a.corpus / "settings.json").is_file():
        raise InputError(f"--corpus {a.corpus}: not a corpus folder (no settings.json)")
    if any(n < 1 for n in a.sizes):
        raise InputError("--sizes must be >= 1")
    if (a.write_head is None) != (a.size is None):
        raise InputError("--write-head and --size go together")
    if a.size is not None and a.size < 1:
        raise InputError("--size must be >= 1")
    if a.head != "eagle3" and not (Path(a.head) / "model.safetensors").is_file():
        raise InputError(f"--head {a.head}: no model.safetensors there (a public-layout EAGLE-3 head)")


def main(argv=None) -> int:
    from arborspec.tools.errors import reports_mistakes

    return reports_mistakes("vocab_choice")(_main)(argv)


def _main(argv=None) -> int:
    from arborspec.models.registry import load_model
    from arborspec.runtime.errors import InputError
    from arborspec.runtime.fileio import atomic_write_json
    from arborspec.tools.train.eagle3_heldout import head_to_measure

    a = build_parser().parse_args(argv)
    check_args(a)
    loaded = load_model(a.model)
    if max(a.sizes) > loaded.config.vocab_size:
        raise InputError(f"--sizes {max(a.sizes)} exceeds the target's vocabulary ({loaded.config.vocab_size})")
    head = head_to_measure(a.head, a.model, loaded.config)
    current = head.token_map().cpu().numpy()
    if a.counts is not None and a.counts.is_file():
        counts = load_counts(a.counts)
    else:
        counts = corpus_counts(loaded, a.corpus)
        if a.counts is not None:
            save_counts(a.counts, counts)
    eos = list(loaded.tokenizer.meta.get("eos_token_ids") or [])
    report = {"tokens": {k: int(c.sum()) for k, c in counts.items()}, "corpus": sizes_table(counts, a.sizes, eos, current)}
    print(table(report["corpus"]))
    if a.heldout:
        from arborspec.tools.train.eagle3_corpus import revocabulary, token_counts

        windows = token_counts(a.corpus, loaded.config.vocab_size)  # what --revocab N --revocab-by tokens counts
        vocabs = {f"current-{len(current)}": current, **{f"kinds-{n}": choose_vocab(counts, n, eos) for n in a.sizes}}
        vocabs.update({f"tokens-{n}": revocabulary(windows, n, loaded.tokenizer) for n in a.sizes})
        report["heldout"] = heldout_coverage(loaded, vocabs, list(head.config.aux_layers))
        print(table(report["heldout"]))
    if a.write_head is not None:
        report["written"] = write_head(loaded, head, choose_vocab(counts, a.size, eos), a.write_head)
        print(f"wrote {a.write_head}: {report['written']}")
    if a.out is not None:
        atomic_write_json(a.out, report, indent=1)
    return 0


def write_head(loaded, head, vocab: np.ndarray, folder: Path) -> dict:
    """`head` over `vocab` (eagle3_train.revocab_head) saved in the public layout in `folder`."""
    from arborspec.tools.train import eagle3_train

    new = eagle3_train.revocab_head(head, vocab, loaded.module)
    new_tokens = int((~np.isin(vocab, head.token_map().cpu().numpy())).sum())
    info = {"draft_vocab": len(vocab), "new_tokens": new_tokens, "chosen_by": "vocab_choice (kinds weigh the same)"}
    eagle3_train.save_public(new, folder, {"revocab": info})
    return info


if __name__ == "__main__":
    raise SystemExit(main())
