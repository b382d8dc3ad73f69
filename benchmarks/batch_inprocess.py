"""In-process batched decoding throughput (README "Batched decoding"): aggregate tokens/s of
`BatchDecoder` over the packaged prompts at B = 1, 4 and 8, vanilla next to trees, side by side
in one process, next to the unbatched decoder (one prompt at a time); greedy outputs are checked
equal to the unbatched ones. Tokens/s are aggregate and include the prompts' prefill.

    python benchmarks/batch_inprocess.py --export-dir DIR [--drafts none,lookup,export] \
        [--tree full:3,2] [--prompts 16] [--max-new-tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.export_dir import open_export
from arborspec.tools.prompts import encode_prompts, read_prompts_file, select_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export-dir", required=True)
    ap.add_argument("--drafts", default="none,lookup", help="comma list: none, lookup, export (the export's draft)")
    ap.add_argument("--tree", default="full:3,2")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per run (the packaged ones, repeated)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = []
    for kind in a.drafts.split(","):
        draft = {"none": "none", "lookup": "lookup", "export": None}[kind]
        with open_export(a.export_dir, "onnxruntime", draft=draft) as ex:
            entries, _ = read_prompts_file(None)
            enc = encode_prompts(select_prompts(entries, 8), ex.tokenizer)
            prompts = [enc[i % len(enc)]["ids"] for i in range(a.prompts)]
            eos = list(getattr(ex.tokenizer, "eos_token_ids", []) or [])
            mode = "vanilla" if ex.draft is None else "tree"
            # the unbatched decoder, one prompt at a time: what batching is measured against
            solo = SpeculativeDecoder(ex.target, ex.draft, mode=mode, tree=a.tree)
            t0 = time.perf_counter()
            ref = [solo.generate(p, a.max_new_tokens, eos).tokens for p in prompts]
            wall = time.perf_counter() - t0
            n = sum(len(t) for t in ref)
            results.append(
                {
                    "draft": kind,
                    "mode": mode,
                    "max_batch": "solo",
                    "tokens": n,
                    "wall_s": wall,
                    "tokens_per_s": n / wall,
                }
            )
            print(
                f"{kind:7s} {mode:7s} solo: {n / wall:6.1f} tok/s (SpeculativeDecoder, one prompt at a time)",
                flush=True,
            )
            for b in [int(x) for x in a.batches.split(",")]:
                dec = BatchDecoder(ex.target, ex.draft, mode=mode, tree=a.tree, max_batch=b)
                t0 = time.perf_counter()
                seqs = dec.generate_many(prompts, a.max_new_tokens, eos)
                wall = time.perf_counter() - t0
                toks = [s.tokens for s in seqs]
                n = sum(len(t) for t in toks)
                steps = sum(s.stats.steps for s in seqs)
                row = {
                    "draft": kind,
                    "mode": mode,
                    "tree": a.tree if mode == "tree" else "",
                    "max_batch": b,
                    "speculate_max_batch": dec.speculate_max_batch,
                    "tokens": n,
                    "wall_s": wall,
                    "tokens_per_s": n / wall,
                    "tokens_per_step": n / steps,
                    "draft_calls": dec.draft_batch.calls if dec.draft_batch else None,
                    "equal_to_solo": toks == ref,
                }
                results.append(row)
                print(
                    f"{kind:7s} {mode:7s} B={b}: {row['tokens_per_s']:6.1f} tok/s aggregate, "
                    f"{row['tokens_per_step']:.2f} tokens per sequence-step, equal to solo: {row['equal_to_solo']}",
                    flush=True,
                )
                dec.close()
    if a.json:
        meta = {"export_dir": a.export_dir, "machine": platform.processor() or platform.machine(), "args": vars(a)}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
