"""In-process batched decoding throughput (docs/serving.md, "Batched decoding"): aggregate tokens/s of
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


def _row(kind, mode, batch, tokens, wall, stats) -> dict:
    """Aggregate tokens/s with and without the prefills (they run one prompt at a time in every
    configuration, so wall minus their sum is the decode time)."""
    n = sum(len(t) for t in tokens)
    decode_s = wall - sum(s.prefill_s for s in stats)
    row = {
        "draft": kind,
        "mode": mode,
        "max_batch": batch,
        "tokens": n,
        "wall_s": wall,
        "tokens_per_s": n / wall,
        "decode_tokens_per_s": n / decode_s,
        "tokens_per_step": n / sum(s.steps for s in stats),
        "tokens_list": tokens,
    }
    print(
        f"{kind:7s} {mode:7s} {'B=' + str(batch) if batch != 'solo' else 'solo':5s}: "
        f"{row['tokens_per_s']:6.1f} tok/s with prefill, {row['decode_tokens_per_s']:6.1f} decode, "
        f"{row['tokens_per_step']:.2f} tokens per sequence-step",
        flush=True,
    )
    return row


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
            runs = [solo.generate(p, a.max_new_tokens, eos) for p in prompts]
            ref = [r.tokens for r in runs]
            results.append(_row(kind, mode, "solo", ref, time.perf_counter() - t0, [r.stats for r in runs]))
            for b in [int(x) for x in a.batches.split(",")]:
                dec = BatchDecoder(ex.target, ex.draft, mode=mode, tree=a.tree, max_batch=b)
                t0 = time.perf_counter()
                seqs = dec.generate_many(prompts, a.max_new_tokens, eos)
                row = _row(kind, mode, b, [s.tokens for s in seqs], time.perf_counter() - t0, [s.stats for s in seqs])
                row.update(
                    equal_to_solo=row.pop("tokens_list") == ref,
                    speculate_max_batch=dec.speculate_max_batch,
                    draft_calls=dec.draft_batch.calls if dec.draft_batch else None,
                )
                results.append(row)
                print(f"    B={b}: greedy output equal to solo: {row['equal_to_solo']}", flush=True)
                dec.close()
    for r in results:
        r.pop("tokens_list", None)
    if a.json:
        meta = {"export_dir": a.export_dir, "machine": platform.processor() or platform.machine(), "args": vars(a)}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
