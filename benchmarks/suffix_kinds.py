"""The suffix draft per kind of request, side by side: vanilla, the export's head, lookup, suffix
and the head mixed with each, interleaved per request (one request runs every configuration in
turn, then the next), greedy, cold requests (no prefix cache, no memory across requests).

Prints a markdown table of median decode tok/s and tokens per target call per kind (the 24
requests of benchmarks/vs_llamacpp.py, six kinds) and checks every configuration's output against
vanilla's, token for token. Example (a 2-core CPU, ~15 min for one round):

  python benchmarks/suffix_kinds.py --export-dir ~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24 \\
      --out /tmp/suffix.json --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def configs(ex, export_dir: Path, suffix_spec: str, lookup_tree: str, head_tree: str | None = None):
    """name -> (draft, tree) over the opened export `ex` (its head shared by the head configs);
    head_tree: the head's tree (default: the tuned one, DIR/tree_auto.json)."""
    from arborspec.runtime.drafts.lookup import LookupDraft
    from arborspec.runtime.drafts.mixed import LookupMixDraft
    from arborspec.runtime.drafts.spec import parse_draft_spec
    from arborspec.runtime.drafts.suffix import SuffixDraft, SuffixMixDraft

    v = ex.target.info.vocab_size
    opts = parse_draft_spec(suffix_spec).arg
    tuned = head_tree or f"static:{export_dir / 'tree_auto.json'}"
    head = ex.draft
    return {
        "vanilla": (None, None),
        "export": (head, tuned),
        "lookup": (LookupDraft(v), lookup_tree),
        "suffix": (SuffixDraft(v, opts), "chain:1"),
        "export+lookup": (LookupMixDraft(head, LookupDraft(v)), tuned),
        "export+suffix": (SuffixMixDraft(head, SuffixDraft(v, opts)), tuned),
    }


def step_cost(tokens: list[int], spec: str, context: int = 2048, steps: int = 300) -> dict:
    """The suffix draft's own cost on a `context`-token text (`tokens`' first ones, then `steps`
    steps over the next ones, each accepting the proposal's longest correct prefix): the build
    (reset) in ms, propose + tree + commit in us per step (propose_us: the proposal alone), with
    the nodes proposed and accepted. CPU time of this process (time.process_time): on a shared
    machine wall time counts the other jobs' time slices too."""
    import torch

    from arborspec.runtime.drafts.proposed import proposal_tree
    from arborspec.runtime.drafts.spec import parse_draft_spec
    from arborspec.runtime.drafts.suffix import SuffixDraft

    d = SuffixDraft(1 << 20, parse_draft_spec(spec).arg)
    t0 = time.process_time()
    d.reset(tokens[: context - 1])
    build = time.process_time() - t0
    i, spent, nodes, acc, n, pure = context, 0.0, 0, 0, 0, 0.0
    root = tokens[context - 1]
    while n < steps and i < len(tokens):
        t0 = time.process_time()
        prop = d.propose(root)
        pure += time.process_time() - t0
        tree = proposal_tree(prop)
        toks, par = tree.tokens.tolist(), tree.parents.tolist()
        path, at = [], -1
        while i < len(tokens):
            nxt = [j for j in range(len(toks)) if par[j] == at and toks[j] == tokens[i]]
            if not nxt:
                break
            at = nxt[0]
            path.append(at)
            i += 1
        d.commit(tree, torch.tensor(path, dtype=torch.long))
        spent += time.process_time() - t0
        root, i, n, nodes, acc = (
            tokens[i] if i < len(tokens) else root,
            i + 1,
            n + 1,
            nodes + len(toks),
            acc + len(path),
        )
    return {
        "build_ms": 1e3 * build,
        "us_per_step": 1e6 * spent / max(n, 1),
        "propose_us": 1e6 * pure / max(n, 1),
        "steps": n,
        "nodes_per_step": nodes / max(n, 1),
        "accepted_per_step": acc / max(n, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--suffix", default="suffix", help="the suffix draft's spec (default: suffix)")
    ap.add_argument("--lookup-tree", default="chain:3")
    ap.add_argument("--head-tree", default=None, help="the head's tree (default: the tuned DIR/tree_auto.json)")
    ap.add_argument("--only", default="", help="comma-separated configurations (default: all)")
    ap.add_argument("--limit", type=int, default=0, help="requests per kind (0: all four)")
    ap.add_argument("--step-cost", action="store_true", help="only the draft's own cost on a 2k-token text")
    args = ap.parse_args()
    import vs_llamacpp

    if args.step_cost:
        from arborspec.runtime.tokenizer import TextTokenizer

        tok = TextTokenizer.load(args.export_dir)
        text = "\n\n".join(e["text"] for e in vs_llamacpp.prompts())
        print(json.dumps(step_cost(tok.encode(text), args.suffix), indent=1))
        return 0

    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.export_dir import open_export
    from arborspec.tools.prompts import encode_prompts

    ex = open_export(args.export_dir, draft="export")
    cfgs = configs(ex, args.export_dir, args.suffix, args.lookup_tree, args.head_tree)
    if args.only:
        keep = set(args.only.split(",")) | {"vanilla"}
        cfgs = {k: c for k, c in cfgs.items() if k in keep}
    decs = {
        name: SpeculativeDecoder(ex.target, d, mode="vanilla" if d is None else "tree", tree=t, prefix_cache=False)
        for name, (d, t) in cfgs.items()
    }
    entries = vs_llamacpp.prompts()
    if args.limit:
        seen: dict = {}
        entries = [
            e for e in entries if seen.setdefault(e["category"], []).append(1) or len(seen[e["category"]]) <= args.limit
        ]
    prompts = encode_prompts(entries, ex.tokenizer)
    runs = []
    for rnd in range(args.rounds):
        for p in prompts:
            ref = None
            for name, dec in decs.items():
                r = dec.generate(p["ids"], args.max_new_tokens)
                st = r.stats
                if name == "vanilla":
                    ref = r.tokens
                runs.append(
                    {
                        "round": rnd,
                        "id": p["id"],
                        "kind": p["category"],
                        "config": name,
                        "tok_s": st.tokens_per_s,
                        "per_call": st.mean_accepted,
                        "nodes": st.tree_nodes / max(st.steps, 1),
                        "draft_ms": 1e3 * st.draft_s / max(st.steps, 1),
                        "same": r.tokens == ref,
                    }
                )
                print(
                    f"{p['id']:16s} {name:14s} {st.tokens_per_s:6.1f} tok/s {st.mean_accepted:.2f}/call "
                    f"nodes {runs[-1]['nodes']:.1f} same={runs[-1]['same']}",
                    file=sys.stderr,
                    flush=True,
                )
            args.out.write_text(json.dumps({"runs": runs, "when": time.ctime()}, indent=1))
    print(table(runs, list(decs)))
    return 0


def table(runs: list[dict], names: list[str]) -> str:
    kinds = list(dict.fromkeys(r["kind"] for r in runs))

    def med(name, kind, key):
        xs = [r[key] for r in runs if r["config"] == name and (kind is None or r["kind"] == kind)]
        return statistics.median(xs) if xs else float("nan")

    out = ["| config | " + " | ".join(kinds) + " | all |", "|---" * (len(kinds) + 2) + "|"]
    for name in names:
        cells = []
        for k in kinds + [None]:
            ratio = med(name, k, "tok_s") / med("vanilla", k, "tok_s")
            cells.append(f"{med(name, k, 'per_call'):.2f} / {med(name, k, 'tok_s'):.0f} ({ratio:.2f}x)")
        same = all(r["same"] for r in runs if r["config"] == name)
        out.append(f"| {name}{'' if same else ' (DIFFERS)'} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
