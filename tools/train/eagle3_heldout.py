"""The held-out set an EAGLE-3 head is judged on, and the rule that replaces the shipped head.

Role in one decode step: none; it measures how often step 1's draft (the head) agrees with what
step 3's verify (the target) accepts, on prompts no training run sees.

The set: the chat-template prompts of tools/data/heldout_prompts.json (instructions, code,
summaries, extraction; written for this project, disjoint from the training prompt mix and from
prompts.json), the target's greedy responses to them, and the target's features and greedy
next tokens over prompt + response (built once per target, cached in the user cache).

The measure, teacher-forced (the true tokens along each chain, the head's own hidden states
below depth 1, the same unrolled forward that trains it): over every chain rooted at the last
prompt token or later, the top-1 agreement per depth, and the tokens per verify step that greedy
decoding with a static tree would reach (acceptance_sim's exact replay of the loop over the
head's per-depth ranks), for the tuned tree of the fp32 export and a chain of 4.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import PartialFolder, atomic_write_bytes, atomic_write_json
from arborspec.tools.prompts import heldout_prompts_path

PROMPTS_PATH = heldout_prompts_path()
TREES = {"tuned [[0],[1],[0,0]]": [[0], [1], [0, 0]], "chain:4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}
TUNED = "tuned [[0],[1],[0,0]]"
SINGLE = "single [[0]]"  # the int4 export's tuned tree: one drafted node


def heldout_prompts(path: Path = PROMPTS_PATH) -> list[dict]:
    return json.loads(Path(path).read_text())["prompts"]


def build_heldout(loaded, aux_layers, source, root: Path, *, gen_len=160, steps=4, threads=None, prompts=None):
    """The held-out folder for this target (cached: built once, atomically): tokens [N, W]
    (prompt + greedy response, padded with EOS), spans [N, 2] (first response token, end),
    features [N, W, F], top1 [N, W]. `source`: the target's features graph or a feature_engine
    (eagle3_corpus); a callable returning one is called only when the folder must be built."""
    from arborspec.tools.train.eagle3_corpus import (
        ResponseGenerator,
        build_features,
        chat_ids,
        graph_context,
        target_id_of,
    )

    tok, cfg = loaded.tokenizer, loaded.config
    prompts = heldout_prompts() if prompts is None else prompts
    texts = [p["text"] for p in prompts]
    key = hashlib.sha256(
        json.dumps({"t": target_id_of(loaded), "p": texts, "g": gen_len, "a": list(aux_layers)}).encode()
    ).hexdigest()[:20]
    out = root / key
    if (out / "heldout.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with PartialFolder(out) as tmp:
        eos = list(tok.meta.get("eos_token_ids") or [])
        # prompts the graph cannot hold with a response are left out (none for SmolLM2)
        limit = graph_context(cfg, {"window": 0, "gen_len": gen_len}) - gen_len - steps - 2
        ids, kinds = [], []
        for p in prompts:
            p_ids = chat_ids(tok, p["text"])
            if len(p_ids) <= limit:
                ids.append(p_ids)
                kinds.append(p.get("kind", ""))
        if not ids:
            raise InputError(f"none of the {len(prompts)} held-out prompts fits the target's context with a response")
        t0 = time.perf_counter()
        source = source() if callable(source) else source
        gen = ResponseGenerator(source, min(16, len(ids)), threads)
        try:
            resp = gen(ids, gen_len, set(eos), 0.0, 0)
        finally:
            gen.close()
        seqs = [p + r for p, r in zip(ids, resp)]
        w = max(len(s) for s in seqs) + steps + 2
        pad = eos[0] if eos else 0
        tokens = np.full((len(seqs), w), pad, dtype=np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        spans = np.array([[len(p), len(p) + len(r)] for p, r in zip(ids, resp)], dtype=np.int64)
        np.save(tmp / "tokens.npy", tokens)
        np.save(tmp / "spans.npy", spans)
        feat = build_features(source, tokens, np.arange(cfg.vocab_size), tmp, 1, threads)
        for f in ("top_ids.npy", "top_lp.npy"):  # top1 is what the measure needs
            (tmp / f).unlink()
        info = {
            "prompts": len(ids),
            "prompts_too_long": len(texts) - len(ids),
            "kinds": sorted({p.get("kind", "") for p in prompts}),
            "row_kinds": kinds,  # each row's prompt kind (the per-kind agreement)
            "response_tokens": int((spans[:, 1] - spans[:, 0]).sum()),
            "gen_len": gen_len,
            "generation_s": round(time.perf_counter() - t0 - feat["features_s"], 1),
            **feat,
        }
        atomic_write_json(tmp / "heldout.json", info)
    return out


@torch.no_grad()
def depth_ranks(head, embed, folder: Path, steps: int = 4, k: int = 8, batch: int = 2):
    """Per held-out row: [steps, W] ranks of the target's greedy token among the head's top-k
    target ids at each depth (k: a miss or no chain), and the row's (start, end)."""
    from arborspec.tools.train.eagle3_train import ttt_forward

    tokens = np.load(folder / "tokens.npy")
    feats = np.load(folder / "features.npy", mmap_mode="r")
    top1 = torch.from_numpy(np.load(folder / "top1.npy")).long()
    spans = np.load(folder / "spans.npy")
    tmap = head.token_map().cpu().long()
    was = head.training
    head.eval()
    rows = []
    n_rows, w = tokens.shape
    n = w - steps - 1
    for a in range(0, n_rows, batch):
        tk = torch.from_numpy(tokens[a : a + batch].astype(np.int64))
        fe = torch.from_numpy(feats[a : a + batch].astype(np.float32))
        outs = ttt_forward(head, embed, tk, fe, steps)
        ranks = torch.full((len(tk), steps, w), k, dtype=torch.long)
        for d, logits in enumerate(outs):
            top = tmap[torch.topk(logits, k, -1).indices]  # [b, n, k] target ids
            want = top1[a : a + batch, 1 + d : 1 + d + n]  # entry j's label: the greedy token at j + 2 + d
            hit = top == want[..., None]
            r = torch.where(hit.any(-1), hit.float().argmax(-1).long(), torch.full_like(want, k))
            ranks[:, d, 2 + d : 2 + d + n] = r
        rows += [(ranks[i].tolist(), int(spans[a + i, 0]), int(spans[a + i, 1])) for i in range(len(tk))]
    head.train(was)
    return rows


def per_depth_top1(rows, steps: int, keep=None) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 agreement per depth over `depth_ranks` rows, and the positions counted per depth.
    keep: per row, a bool array over its positions: only those count."""
    hits, counts = np.zeros(steps), np.zeros(steps)
    for i, (ranks, start, end) in enumerate(rows):
        for d in range(1, steps + 1):
            # token p drafted at depth d: its chain's root p - d is the last prompt token or later
            lo = max(start, start - 1 + d)
            r = np.asarray(ranks[d - 1][lo:end])
            if keep is not None:
                r = r[keep[i][lo:end]]
            hits[d - 1] += (r == 0).sum()
            counts[d - 1] += len(r)
    return hits / np.maximum(counts, 1), counts


def copied_from_prompt(tokens: np.ndarray, start: int) -> np.ndarray:
    """[len(tokens)] bool: position p >= start continues a bigram of the prompt (tokens[:start]),
    i.e. (tokens[p-1], tokens[p]) occurs there: what an answer copies from a text it was given."""
    t = np.asarray(tokens, dtype=np.int64)
    pairs = set(zip(t[: start - 1].tolist(), t[1:start].tolist()))
    out = np.zeros(len(t), dtype=bool)
    for p in range(max(start, 1), len(t)):
        out[p] = (int(t[p - 1]), int(t[p])) in pairs
    return out


def evaluate_heldout(head, embed, folder: Path, steps: int = 4, k: int = 8) -> dict:
    """Top-1 agreement per depth over chains rooted in the responses, the chain acceptance it
    implies (1 + sum of cumulative products), the tokens per verify step of `TREES` and the single
    node (chain_measure), and, where the set records its rows' kinds (instruction, code, summary,
    extraction; translation, qa, ... for kinds_heldout's sets), the same per kind (`per_kind`;
    `top1_per_kind` its agreement per depth)."""
    rows = depth_ranks(head, embed, folder, steps, k)
    out = chain_measure(rows, steps)
    tokens = np.load(folder / "tokens.npy")
    greedy = np.load(folder / "top1.npy")
    spans = [(s, e) for _, s, e in rows]
    out["greedy_in_vocab"] = in_vocab_share(greedy, spans, head.token_map().cpu().numpy())  # the ceiling
    copied = [copied_from_prompt(tokens[i], s) for i, (_, s, _) in enumerate(rows)]
    share = sum(c[s:e].sum() for c, (_, s, e) in zip(copied, rows)) / max(sum(e - s for _, s, e in rows), 1)
    out["top1_copied"] = {  # answer tokens copied from the prompt vs the rest
        "share": round(float(share), 4),
        "copied": per_depth_top1(rows, steps, copied)[0].round(4).tolist(),
        "other": per_depth_top1(rows, steps, [~c for c in copied])[0].round(4).tolist(),
    }
    kinds = json.loads((folder / "heldout.json").read_text()).get("row_kinds")  # absent in sets built before
    if kinds and len(kinds) == len(rows):
        out["per_kind"] = kind_breakdown(rows, kinds, steps)
        out["top1_per_kind"] = {kind: m["top1_agreement_per_depth"] for kind, m in out["per_kind"].items()}
    return out


def chain_measure(rows, steps: int) -> dict:
    """What a run of `depth_ranks` rows gives decoding: top-1 agreement per depth, the chain
    acceptance it implies, the tokens per verify step of `TREES` and of the single node [[0]]
    (the int4 export's tree), and the positions counted."""
    from arborspec.tools.tune.acceptance_sim import simulated_tokens_per_step

    acc, counts = per_depth_top1(rows, steps)
    runs = [{"by_depth": r, "start": s, "end": e} for r, s, e in rows]
    trees = {**TREES, SINGLE: [[0]]}
    return {
        "top1_agreement_per_depth": [round(float(x), 4) for x in acc],
        "expected_accepted_chain": round(1.0 + float(np.sum(np.cumprod(acc))), 3),
        "tokens_per_step": {name: round(simulated_tokens_per_step(runs, p), 3) for name, p in trees.items()},
        "positions": int(counts[0]),
    }


def kind_breakdown(rows, kinds: list[str], steps: int) -> dict:
    """{kind: chain_measure over the rows of that kind}, kinds sorted."""
    return {kind: chain_measure([r for r, k in zip(rows, kinds) if k == kind], steps) for kind in sorted(set(kinds))}


def head_to_measure(arg: str, model: str, config):
    """A tool's --head argument: `eagle3` (the head shipped for the registry model `model`) or a
    head folder -> that head, fp32, loaded and checked against the target's `config`."""
    from arborspec.models.eagle3 import eagle3_folder, load_eagle3

    return load_eagle3(eagle3_folder("eagle3", model) if arg == "eagle3" else Path(arg), config).float()


def heldout_graph(loaded, aux: list[int], root: Path, gen_len: int = 160) -> Path:
    """The target's features graph for held-out sets with responses of `gen_len` (cached in
    `root`, named by the target, the layers and the context it holds)."""
    from arborspec.tools.train import eagle3_corpus

    cfg = loaded.config
    tid = hashlib.sha256(eagle3_corpus.target_id_of(loaded).encode()).hexdigest()[:16]
    ctx = eagle3_corpus.graph_context(cfg, {"window": 0, "gen_len": gen_len})
    graph = root / f"target-features-{tid}-{'-'.join(map(str, aux))}-c{ctx}.onnx"
    if not graph.is_file():
        graph.parent.mkdir(parents=True, exist_ok=True)
        eagle3_corpus.target_graph(loaded.module.eval(), cfg, ctx, aux, graph)
    return graph


def heldout_measure(loaded, threads: int | None = None, steps: int = 4):
    """head -> its held-out measure (evaluate_heldout) for the target `loaded`, on the CPU, with
    the head's own feature layers (the target's features graph and the held-out set built once
    per layer set, in the user cache): how `--install-head` and `head_blend` measure heads."""
    from arborspec.models.registry import cache_dir

    embed = loaded.module.model.embed_tokens.weight.detach().float()
    root = cache_dir() / "eagle3-heldout"

    def measure(head) -> dict:
        aux = list(head.config.aux_layers)
        heldout = build_heldout(loaded, aux, lambda: heldout_graph(loaded, aux, root), root, threads=threads)
        return evaluate_heldout(head, embed, heldout, steps)

    return measure


def kinds_heldout(loaded, aux, source, root: Path, *, per_kind: int = 10, seed: int = 0, threads=None) -> dict:
    """{kind: held-out folder} of kinds.heldout_set (translation, qa, math, long_summary,
    retrieval; one folder a kind, each padded to its own longest row), built once each; a kind
    none of whose prompts fits the target's context is left out."""
    from arborspec.tools.train import kinds

    prompts = kinds.heldout_set(per_kind, seed)
    out = {}
    for kind in kinds.KINDS:
        try:
            mine = [p for p in prompts if p["kind"] == kind]
            out[kind] = build_heldout(loaded, aux, source, root, threads=threads, prompts=mine)
        except InputError:
            continue
    return out


def kinds_report(loaded, heads: dict, *, threads=None, steps: int = 4, per_kind: int = 10, root: Path | None = None):
    """{head name: {kind: chain_measure}} over the chat held-out set's kinds (instruction, code,
    summary, extraction) and kinds_heldout's, and "all" (the chat set as a whole). heads: {name:
    a loaded head}; all must read the same feature layers."""
    from arborspec.models.registry import cache_dir

    root = root or cache_dir() / "eagle3-heldout"
    embed = loaded.module.model.embed_tokens.weight.detach().float()
    aux = {tuple(h.config.aux_layers) for h in heads.values()}
    if len(aux) != 1:
        raise ValueError(f"the heads read different feature layers: {sorted(aux)}")
    aux = list(aux.pop())

    def source():
        return heldout_graph(loaded, aux, root)

    chat = build_heldout(loaded, aux, source, root, threads=threads)
    kinds = kinds_heldout(loaded, aux, source, root, per_kind=per_kind, threads=threads)
    out = {}
    for name, head in heads.items():
        whole = evaluate_heldout(head, embed, chat, steps)
        keep = (
            "top1_agreement_per_depth",
            "expected_accepted_chain",
            "tokens_per_step",
            "positions",
            "greedy_in_vocab",
        )
        row = {"all": {k: whole[k] for k in keep}}
        row.update(whole.get("per_kind", {}))
        for kind, folder in kinds.items():
            row[kind] = chain_measure(depth_ranks(head, embed, folder, steps), steps)
        vocab = head.token_map().cpu().numpy()
        for folder in (chat, *kinds.values()):
            for kind, share in in_vocab_by_kind(folder, vocab).items():
                row[kind]["greedy_in_vocab"] = share
        out[name] = row
    return out


def in_vocab_by_kind(folder: Path, vocab: np.ndarray) -> dict:
    """{kind: the share of the target's greedy answer tokens that `vocab` (a head's draft
    vocabulary, target ids) holds}: the ceiling of that kind's agreement, over a held-out
    folder's rows by their recorded kinds (none recorded: {})."""
    kinds = json.loads((folder / "heldout.json").read_text()).get("row_kinds") or []
    greedy, spans = np.load(folder / "top1.npy"), np.load(folder / "spans.npy")
    if len(kinds) != len(spans):
        return {}
    out = {}
    for kind in sorted(set(kinds)):
        out[kind] = in_vocab_share(greedy, spans, vocab, [k == kind for k in kinds])
    return out


def in_vocab_share(greedy: np.ndarray, spans, vocab: np.ndarray, keep=None) -> float:
    """The share of the greedy answer tokens (rows' spans; keep: which rows) that `vocab` holds."""
    held = np.concatenate(
        [greedy[i, s - 1 : e - 1] for i, (s, e) in enumerate(spans) if keep is None or keep[i]]
    )  # row p predicts p + 1
    return round(float(np.isin(held, vocab).mean()), 4)


def report_table(report: dict) -> str:
    """kinds_report as a Markdown table: one row per head and kind."""
    lines = [
        "| head | kind | positions | top-1 depth 1 / 2 / 3 / 4 | chain | tok/step [[0]] | tuned | chain:4 | in vocab |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report.items():
        for kind, m in row.items():
            t = m["tokens_per_step"]
            lines.append(
                f"| {name} | {kind} | {m['positions']} | {' / '.join(f'{x:.3f}' for x in m['top1_agreement_per_depth'])} "
                f"| {m['expected_accepted_chain']:.3f} | {t.get(SINGLE, float('nan')):.3f} | {t[TUNED]:.3f} | {t['chain:4']:.3f} "
                f"| {m.get('greedy_in_vocab', float('nan')):.3f} |"
            )
    return "\n".join(lines)


def beats(new: dict, old: dict) -> bool:
    """The install rule: a head replaces the shipped one only if, on the same held-out set, its
    mean top-1 agreement over the depths is higher AND the tokens per step of each tree the
    exports were tuned to is not lower: the fp32 export's (`TUNED`: a head that agrees more at
    depth 1 but collapses deeper does not pass) and the int4 export's single node [[0]], whose
    worth is the depth-1 agreement (a head that gains deeper but loses at depth 1 does not pass:
    run 20's blend, +0.002 mean and +0.003 tokens a step on TUNED, -0.003 at depth 1)."""
    top_new, top_old = new["top1_agreement_per_depth"], old["top1_agreement_per_depth"]
    return bool(
        np.mean(top_new) > np.mean(top_old)
        and new["tokens_per_step"][TUNED] >= old["tokens_per_step"][TUNED]
        and top_new[0] >= top_old[0]
    )


def ranks_above(new: dict, old: dict, start: dict) -> bool:
    """Which of a run's held-out measures to keep as its head (`train-draft` publishes that one):
    first one that beats the head the run started from (`start`) by the install rule, then the
    higher mean agreement over the depths. `beats` alone is a partial order: a run that kept an
    early head with the highest tuned tree passed over later ones that beat the start, and
    published a head --install then refused (run 19: batch 1017 kept, mean 0.6144; batch 2079,
    mean 0.6185 with the start's tuned tree, would have passed)."""

    def key(r: dict) -> tuple[bool, float]:
        return beats(r, start), float(np.mean(r["top1_agreement_per_depth"]))

    return key(new) > key(old)


def install_if_better(candidate: Path, shipped: Path, new: dict, old: dict) -> bool:
    """Copy the candidate head's files over the shipped head's (each file atomically) when
    `beats(new, old)`; returns whether it did. Nothing is touched otherwise. The installed
    training.json keeps the replaced head's under `replaced` (the history of every run)."""
    if not beats(new, old):
        return False
    try:
        history = json.loads((shipped / "training.json").read_text())
    except (OSError, ValueError):
        history = None
    for name in ("model.safetensors", "config.json"):
        atomic_write_bytes(shipped / name, (candidate / name).read_bytes())
    if (candidate / "training.json").is_file():
        report = json.loads((candidate / "training.json").read_text())
        report.update({"replaced_measured_now": old, "replaced": history})
        atomic_write_json(shipped / "training.json", report, indent=1)
    return True


def vocab_coverage(corpus: Path, folder: Path, sizes=(8192, 16384, 32768), vocab=None) -> dict:
    """The ceiling the draft vocabulary puts on agreement: the fraction of the held-out responses'
    tokens inside the `sizes` most frequent tokens of the corpus (FR-Spec's choice at that size),
    and inside `vocab` (a head's own draft vocabulary, target ids)."""
    from arborspec.tools.train.eagle3_corpus import most_frequent, token_counts

    counts = token_counts(corpus)
    tokens, spans = np.load(folder / "tokens.npy"), np.load(folder / "spans.npy")
    held = np.concatenate([row[s:e] for row, (s, e) in zip(tokens, spans)])
    out = {f"top_{v}": round(float(np.isin(held, most_frequent(counts, v)).mean()), 4) for v in sizes}
    out["corpus_distinct_tokens"] = int((counts > 0).sum())
    if vocab is not None:
        out["head_vocab"] = round(float(np.isin(held, np.asarray(vocab)).mean()), 4)
    return out


def main(argv=None) -> int:
    """`python -m arborspec.tools.train.eagle3_heldout`: the per-kind agreement of heads."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.train.eagle3_heldout",
        description="The held-out agreement of EAGLE-3 heads per kind of request: the chat held-out set's kinds "
        "and kinds.py's (translation, qa, math, long_summary, retrieval); sets built once in the user cache.",
        epilog="example:\n  python -m arborspec.tools.train.eagle3_heldout --model smollm2-135m --heads eagle3 "
        "~/.cache/arborspec/train/h --threads 1 --out /tmp/kinds.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="the target (e.g. smollm2-135m)")
    p.add_argument("--heads", nargs="+", required=True, help="eagle3 (the shipped head) or head folders")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch and ONNX Runtime; default: all)")
    p.add_argument("--per-kind", type=int, default=10, help="held-out prompts per new kind (default 10)")
    p.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    a = p.parse_args(argv)
    if (a.threads is not None and a.threads < 1) or a.per_kind < 1:
        print("error: --threads and --per-kind must be >= 1", file=sys.stderr)
        return 2
    for h in a.heads:
        if h != "eagle3" and not (Path(h) / "model.safetensors").is_file():
            print(f"error: --heads {h}: no model.safetensors there (a public-layout EAGLE-3 head)", file=sys.stderr)
            return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    from arborspec.models.registry import load_model

    loaded = load_model(a.model)
    heads = {h: head_to_measure(h, a.model, loaded.config) for h in a.heads}
    report = kinds_report(loaded, heads, threads=a.threads, per_kind=a.per_kind)
    print(report_table(report))
    if a.out is not None:
        atomic_write_json(a.out, report, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
