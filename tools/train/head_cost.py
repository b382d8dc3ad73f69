"""The EAGLE-3 head's cost against the target's: one head call (a tree level of T nodes over a
cache of P entries) vs one one-token target step (P cached), both PyTorch on this CPU, for draft
vocabularies of several sizes (the head's LM head is most of its cost); or, with --export-dir, an
export's own graphs as decoding runs them (ONNX Runtime, one shared thread pool as the CLI's,
the target's one-token call in the export's row layout, the head's call right after it: its
weights come back from memory then, as in a decode step, and again straight after: warm).

Role in one decode step: none; it measures step 1's call against step 3's (the issue's budget:
a head call <= 10% of a one-token target step).

    python -m arborspec.tools.train.head_cost --model smollm2-135m --vocab 8192 16384 32768 --threads 1
    python -m arborspec.tools.train.head_cost --export-dir EXPORT_A EXPORT_B --reps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from arborspec.tools.errors import reports_mistakes


def in_turn(fns, reps: int, warmup: int = 2) -> list[float]:
    """Median milliseconds of each of `fns`, called in turn `reps` times (after `warmup` rounds),
    so all see the same machine load (and each runs right after the one before it)."""
    times = [[] for _ in fns]
    for r in range(reps + warmup):
        for f, ts in zip(fns, times):
            t0 = time.perf_counter()
            f()
            if r >= warmup:
                ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


@torch.inference_mode()
def measure(model: str, vocabs: list[int], nodes: int, past: int, reps: int) -> dict:
    from arborspec.models.eagle3 import default_aux_layers
    from arborspec.models.registry import load_model
    from arborspec.tools.train.eagle3_train import init_head

    lm = load_model(model)
    cfg, m = lm.config, lm.module.eval()
    kv = [torch.randn(past, 1, cfg.n_kv_heads, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
    ids = torch.tensor([[42]])
    mask1 = torch.ones(1, 1, past + 1, dtype=torch.bool)
    pos1 = torch.tensor([[past]])
    rows = []
    for v in vocabs:
        head = init_head(cfg, m, default_aux_layers(cfg.n_layers), torch.arange(v).numpy(), 0).eval()
        c = head.config
        pk, pv = torch.randn(past, 1, c.n_kv_heads, c.head_dim), torch.randn(past, 1, c.n_kv_heads, c.head_dim)
        emb = torch.randn(1, nodes, c.hidden_size)
        hid = torch.randn(1, nodes, c.hidden_size)
        pos = torch.full((1, nodes), past)
        mask = torch.ones(1, nodes, past + nodes, dtype=torch.bool)
        tms, ms = in_turn([lambda: m(ids, pos1, mask1, *kv), lambda: head(emb, hid, pos, mask, pk, pv)], reps)
        rows.append(
            {
                "draft_vocab": v,
                "head_ms": round(ms, 2),
                "target_ms": round(tms, 2),
                "of_target_step": round(ms / tms, 3),
            }
        )
    return {"nodes": nodes, "past": past, "heads": rows}


@torch.inference_mode()
def measure_export(path: str, nodes: int, past: int, reps: int) -> dict:
    """An export's EAGLE-3 head against its target (module docstring): medians in ms."""
    from arborspec.runtime.errors import InputError
    from arborspec.runtime.export_dir import open_export
    from arborspec.runtime.kvcache import KVCache

    with open_export(path, draft="export", load_tok=False) as ex:
        head = getattr(ex.draft, "engine", None)
        if head is None or not hasattr(head, "forward_hidden"):
            raise InputError(f"{path}: the export's draft is not an EAGLE-3 head")
        t, tc = ex.target, KVCache(ex.target.info.cache, past + 4, 1)
        hc = KVCache(head.info.cache, past + nodes + 1, 1)
        tc.length = hc.length = past
        ids1, pos1 = torch.tensor([[42]]), torch.tensor([[past]])
        mask1 = torch.ones(1, 1, past + 1, dtype=torch.bool)
        ids = torch.full((1, nodes), 42)
        hid = torch.randn(1, nodes, head.hidden_size)
        pos = torch.full((1, nodes), past)
        mask = torch.ones(1, nodes, past + nodes, dtype=torch.bool)
        feats = torch.randn(nodes, head.feature_size)
        target_ms, head_ms, warm_ms, fc_ms = in_turn(
            [
                lambda: t.forward(ids1, pos1, mask1, tc),
                lambda: head.forward_hidden(ids, hid, pos, mask, hc),  # right after the target: cold
                lambda: head.forward_hidden(ids, hid, pos, mask, hc),  # straight again: warm
                lambda: head.project(feats),
            ],
            reps,
            warmup=3,
        )
        return {
            "export": str(path),
            "draft_vocab": int(head.info.vocab_size),
            "target_ms": round(target_ms, 3),
            "head_ms": round(head_ms, 3),
            "head_warm_ms": round(warm_ms, 3),
            "fc_ms": round(fc_ms, 3),
            "of_target_step": round((head_ms + fc_ms) / target_ms, 3),
        }


@reports_mistakes("head_cost")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--nodes", type=int, default=2, help="tree nodes per head call (default 2)")
    p.add_argument("--past", type=int, default=256, help="cached entries (default 256)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--export-dir", nargs="+", default=None, help="measure these exports' own head and target (ONNX Runtime)"
    )
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.export_dir:
        from arborspec.runtime.backends.ort_loader import enable_shared_pool

        enable_shared_pool()
        rows = [measure_export(e, a.nodes, a.past, a.reps) for e in a.export_dir]
        print(json.dumps({"nodes": a.nodes, "past": a.past, "exports": rows}, indent=1))
        return 0
    print(json.dumps({"threads": a.threads, **measure(a.model, a.vocab, a.nodes, a.past, a.reps)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
