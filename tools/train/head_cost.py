"""The EAGLE-3 head's cost against the target's: one head call (a tree level of T nodes over a
cache of P entries) vs one one-token target step (P cached), both PyTorch on this CPU, for draft
vocabularies of several sizes (the head's LM head is most of its cost).

Role in one decode step: none; it measures step 1's call against step 3's (the issue's budget:
a head call <= 10% of a one-token target step).

    python -m arborspec.tools.train.head_cost --model smollm2-135m --vocab 8192 16384 32768 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def paired(f, g, reps: int) -> tuple[float, float]:
    """Median milliseconds of `f()` and of `g()`, called in turn `reps` times (after two warm-up
    rounds), so both see the same machine load."""
    tf, tg = [], []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        f()
        t1 = time.perf_counter()
        g()
        t2 = time.perf_counter()
        if r >= 2:
            tf.append((t1 - t0) * 1e3)
            tg.append((t2 - t1) * 1e3)
    return statistics.median(tf), statistics.median(tg)


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
        tms, ms = paired(lambda: m(ids, pos1, mask1, *kv), lambda: head(emb, hid, pos, mask, pk, pv), reps)
        rows.append(
            {
                "draft_vocab": v,
                "head_ms": round(ms, 2),
                "target_ms": round(tms, 2),
                "of_target_step": round(ms / tms, 3),
            }
        )
    return {"nodes": nodes, "past": past, "heads": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--nodes", type=int, default=2, help="tree nodes per head call (default 2)")
    p.add_argument("--past", type=int, default=256, help="cached entries (default 256)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(json.dumps({"threads": a.threads, **measure(a.model, a.vocab, a.nodes, a.past, a.reps)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
