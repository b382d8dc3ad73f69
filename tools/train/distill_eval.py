"""Draft evaluation: mean accepted tokens per verify call of drafts on held-out prompts, by
real decoding or by exact simulation, and its table.

Role in one decode step: none; measures what steps 1 and 4 achieve with a draft.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from arborspec.runtime.decoder_config import DEFAULT_CHAIN, DEFAULT_TREE
from arborspec.tools.prompts import encode_entry, load_prompt_entries, split_prompts


# ----------------------------------------------------------------------------- evaluation
@dataclass
class DraftTrial:
    """What a draft evaluation runs: the target model, the drafts, the held-out prompts (token
    ids), the trees, and how long each answer is."""

    model: str
    drafts: list[str]
    prompts: list[list[int]]
    trees: Sequence[str] = (DEFAULT_TREE, DEFAULT_CHAIN)
    max_new_tokens: int = 64
    progress: bool = True


def evaluate_drafts(trial: DraftTrial) -> list[dict]:
    """Greedy speculative decoding (torch backend) of each prompt with each draft and tree:
    mean accepted tokens per target call (the target's bonus token included) and tok/s."""
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.tools.engines import open_engines

    rows = []
    base = None
    for spec in trial.drafts:
        om = open_engines(model=trial.model, draft=spec, backend="torch", device="cpu")
        if base is None:
            base = om
        eos = list(om.tokenizer.meta.get("eos_token_ids") or []) if om.tokenizer is not None else []
        for tree in trial.trees:
            mode = "vanilla" if tree == "vanilla" else "chain" if tree.startswith("chain:") else "tree"
            dec = SpeculativeDecoder(
                om.target,
                om.draft if mode != "vanilla" else None,
                mode=mode,
                tree=tree if mode != "vanilla" else "chain:1",
            )
            toks = steps = 0
            dec_s = draft_s = 0.0
            for p in trial.prompts:
                r = dec.generate(p, trial.max_new_tokens, eos)
                toks += r.stats.new_tokens
                steps += r.stats.steps
                dec_s += r.stats.decode_s
                draft_s += r.stats.draft_s
            row = {
                "draft": spec,
                "tree": tree,
                "mean_accepted": toks / max(1, steps),
                "tokens_per_s": toks / dec_s if dec_s else 0.0,
                "draft_share": draft_s / dec_s if dec_s else 0.0,
                "tokens": toks,
                "steps": steps,
            }
            rows.append(row)
            if trial.progress:
                print(
                    f"[eval] {spec:>40s} {tree:10s} mean accepted {row['mean_accepted']:.2f} "
                    f"{row['tokens_per_s']:.1f} tok/s (draft {100 * row['draft_share']:.0f}% of time)",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def simulate_drafts(trial: DraftTrial) -> list[dict]:
    """Mean accepted tokens per verify step of greedy decoding, without running the tree
    loop: the target's greedy text once per prompt (vanilla runtime decoding), then each
    draft teacher-forced over it once; `tune.simulate_greedy_steps` counts the steps each
    static-shaped tree (chain, full, static) would take. Equal to real decoding's steps
    (tests/tools/test_tune.py checks it)."""
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.tools.engines import open_engines
    from arborspec.tools.tune.acceptance_sim import draft_topk_ranks, simulate_greedy_steps, spec_paths

    tree_paths = {t: spec_paths(t) for t in trial.trees}
    k = max(max(p[-1] for p in ps) for ps in tree_paths.values()) + 1
    seqs = None
    rows = []
    for spec in trial.drafts:
        om = open_engines(model=trial.model, draft=spec, backend="torch", device="cpu")
        if seqs is None:
            eos = list(om.tokenizer.meta.get("eos_token_ids") or []) if om.tokenizer is not None else []
            dec = SpeculativeDecoder(om.target, mode="vanilla")
            seqs = []
            for p in trial.prompts:
                r = dec.generate(p, trial.max_new_tokens, eos)
                seqs.append((len(p), list(p) + r.tokens))
        ranks = [draft_topk_ranks(om.draft, s, k).tolist() for _, s in seqs]
        for t, paths in tree_paths.items():
            steps = sum(simulate_greedy_steps(rk, a, len(s), paths) for rk, (a, s) in zip(ranks, seqs))
            toks = sum(len(s) - a for a, s in seqs)
            row = {
                "draft": spec,
                "tree": t,
                "mean_accepted": toks / max(1, steps),
                "tokens": toks,
                "steps": steps,
                "tokens_per_s": float("nan"),
                "simulated": True,
            }
            rows.append(row)
            if trial.progress:
                print(
                    f"[eval/sim] {spec:>40s} {t:10s} mean accepted {row['mean_accepted']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
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
