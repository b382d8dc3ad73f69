"""Hardware-aware tree tuning (Sequoia): pick the static tree that maximises tokens per second
on THIS backend, for THIS target/draft pair.

Role in one decoding step: chooses the shape of step 1's tree once, offline. Three
measurements and one optimisation:

1. the verify cost curve c(T): one target call over T new tokens after P cached ones
   (P = --past, a typical context), for a few T in 1..max_nodes+1, interpolated linearly;
2. the draft's cost per level call d(F) over frontier sizes F (table drafts: a gather);
3. the draft's positional acceptance: greedy decoding of calibration prompts, then, at every
   generated position j, the rank r of the target's token among the draft's top-k (draft run
   teacher-forced on the committed text, exactly what it sees along an accepted path), split
   by depth d: q[d][r] = P(target token is the draft's rank-r candidate at depth d | the d-1
   tokens above it on the path were each within the draft's top-k);
4. Sequoia's dynamic programme over trees (see `sequoia_dp`) gives, for every node budget n
   and depth limit D, the tree maximising the expected accepted tokens under q; each such
   tree is priced exactly (c(n+1) + d(1) for the root call + d(F_l) for every level l < depth
   with F_l expandable nodes) and the (n, D) with the best E[accepted + 1] / step time wins.

The result is a static tree spec (`static:FILE.json` accepts it) with its metadata; `--tree
auto` in generate/bench resolves to it through `resolve_tree`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from arborspec.runtime.errors import InputError, MissingFileError

FORMAT = 1
AUTO_FILE = "tree_auto.json"


# ----------------------------------------------------------------------------- the DP
@dataclass
class DPResult:
    """Tables of one depth limit D: value[n] = best expected accepted tokens (bonus excluded)
    with at most n nodes; `tree(n)` rebuilds the rank paths."""

    depth_limit: int
    value: list[float]
    _choice: dict
    _order: list[list[int]]

    def tree(self, n: int) -> list[list[int]]:
        paths: list[list[int]] = []

        def build(d: int, budget: int, prefix: tuple):
            if d > self.depth_limit or budget <= 0:
                return
            sizes = []
            j = len(self._order[d])
            b = budget
            while j > 0:
                s = self._choice[(d, j, b)]
                if s:
                    sizes.append((self._order[d][j - 1], s))
                    b -= s
                j -= 1
            for rank, s in sorted(sizes):
                p = prefix + (rank,)
                paths.append(list(p))
                build(d + 1, s - 1, p)

        build(1, n, ())
        return sorted(paths, key=lambda p: (len(p), p))


def _q_at(q: Sequence[Sequence[float]], d: int) -> list[float]:
    """Acceptance row for depth d (1-based); depths past the measured ones reuse the last."""
    return list(q[min(d, len(q)) - 1])


def sequoia_dp(q: Sequence[Sequence[float]], n_max: int, depth_limit: int) -> DPResult:
    """Best tree with <= n nodes and depth <= D, for every n <= n_max (Sequoia, Chen et al. 2024).

    q[d-1][r]: probability that the target's token at depth d is the draft's rank-r
    candidate (ranks are distinct tokens, so at most one child of a node is accepted). The
    expected number of accepted tokens of a tree is the sum over its nodes of the product of
    q along the node's path. F(n, d): the best forest of children (at depth d) of one node
    using at most n nodes:  F(n, d) = max over children j with subtree sizes s_j >= 1,
    sum s_j <= n, of  sum_j q[d][r_j] * (1 + F(s_j - 1, d + 1)),  F(., D + 1) = 0.
    A 0/1 knapsack over the k ranks (best q first) computes it in O(k n^2) per depth."""
    order = {}
    choice = {}
    F_next = [0.0] * (n_max + 1)
    for d in range(depth_limit, 0, -1):
        row = _q_at(q, d)
        ranks = sorted(range(len(row)), key=lambda r: (-row[r], r))
        ranks = [r for r in ranks if row[r] > 0] or ranks[:1]
        order[d] = ranks
        sub = [0.0] + [1.0 + F_next[s - 1] for s in range(1, n_max + 1)]  # value of a child subtree of s nodes
        G = [0.0] * (n_max + 1)
        for j, r in enumerate(ranks, start=1):
            a = row[r]
            newG = list(G)
            for b in range(n_max + 1):
                best, arg = G[b], 0
                for s in range(1, b + 1):
                    v = G[b - s] + a * sub[s]
                    if v > best + 1e-15:
                        best, arg = v, s
                newG[b] = best
                choice[(d, j, b)] = arg
            G = newG
        F_next = G
    return DPResult(depth_limit, F_next, choice, [[]] + [order[d] for d in range(1, depth_limit + 1)])


def tree_value(paths: Sequence[Sequence[int]], q: Sequence[Sequence[float]]) -> float:
    """Expected accepted tokens (bonus excluded) of a tree under the acceptance model q."""
    total = 0.0
    for p in paths:
        v = 1.0
        for d, r in enumerate(p, start=1):
            row = _q_at(q, d)
            v *= row[r] if r < len(row) else 0.0
        total += v
    return total


def level_frontiers(paths: Sequence[Sequence[int]]) -> list[int]:
    """Draft call sizes after the root call: for each level l = 1..depth-1, the number of
    level-l nodes that have children (the frontier expanded by that level's draft call)."""
    if not paths:
        return []
    depth = max(len(p) for p in paths)
    parents = {tuple(p[:-1]) for p in paths if len(p) > 1}
    return [sum(1 for p in parents if len(p) == lvl) for lvl in range(1, depth)]


# ----------------------------------------------------------------------------- costs
def interp(curve: dict, x: float) -> float:
    """Piecewise-linear interpolation of {size: ms}; linear extrapolation past the ends."""
    xs = sorted(curve)
    if len(xs) == 1:
        return float(curve[xs[0]])
    if x <= xs[0]:
        a, b = xs[0], xs[1]
    elif x >= xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        b = next(v for v in xs if v >= x)
        a = max(v for v in xs if v <= x)
        if a == b:
            return float(curve[a])
    return float(curve[a] + (curve[b] - curve[a]) * (x - a) / (b - a))


def sample_sizes(max_size: int) -> list[int]:
    base = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    return sorted({s for s in base if s <= max_size} | {max_size})


def _sync_of(engine):
    dev = getattr(engine, "device", None)
    return torch.cuda.synchronize if dev is not None and getattr(dev, "type", "") == "cuda" else None


def _time_sizes(calls: dict, reps: int, sync=None) -> dict:
    """{size: ms}: every call warmed up, then timed `reps` times in round-robin rounds (so a
    burst of load from other processes hits all sizes alike); the minimum per size (the
    least-disturbed run), then made non-decreasing in size (a slower small call is noise:
    it is capped by the cost of the next larger size)."""
    times: dict = {s: [] for s in calls}
    for fn in calls.values():
        fn()
    if sync:
        sync()
    for _ in range(reps):
        for s, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            times[s].append(time.perf_counter() - t0)
    out = {s: 1e3 * min(ts) for s, ts in times.items()}
    run = float("inf")
    for s in sorted(out, reverse=True):
        run = min(run, out[s])
        out[s] = run
    return dict(sorted(out.items()))


def engine_cost_curve(engine, sizes: Sequence[int], past: int = 256, reps: int = 5, progress=None) -> dict:
    """{T: ms} of one engine call with T new tokens after `past` cached positions (cache
    contents are zeros: the cost does not depend on them)."""
    from arborspec.runtime.kvcache import KVCache

    past = max(0, min(past, engine.info.max_position - max(sizes) - 1))
    cache = KVCache(engine.info.cache, past + max(sizes) + 1, 1, engine.device)
    dev = engine.device
    calls = {}
    for t in sizes:
        ids = torch.randint(0, engine.info.vocab_size, (1, t), generator=torch.Generator().manual_seed(t)).to(dev)
        pos = (torch.arange(t) + past)[None].to(dev)
        mask = torch.ones(1, t, past + t, dtype=torch.bool, device=dev)

        def call(ids=ids, pos=pos, mask=mask):
            cache.length = past
            engine.forward(ids, pos, mask, cache)

        calls[int(t)] = call
    return _time_sizes(calls, reps, _sync_of(engine))


def draft_cost_curve(draft, sizes: Sequence[int], past: int = 256, reps: int = 5, progress=None) -> dict:
    """{F: ms} of one draft level call over F frontier nodes (an engine call, or a table gather)."""
    from arborspec.runtime.drafts import BigramDraft

    if isinstance(draft, BigramDraft):
        calls = {}
        for f in sizes:
            toks = torch.randint(0, draft.vocab_size, (f,), generator=torch.Generator().manual_seed(f))
            calls[int(f)] = lambda toks=toks: draft._rows(toks)
        return _time_sizes(calls, reps)
    return engine_cost_curve(draft, sizes, past, reps, progress)


def step_cost_ms(paths, verify: dict, dcost: dict) -> float:
    """Predicted time of one step with this tree: verify over root + nodes, the draft's root
    call and one draft call per expanded level."""
    n = len(paths)
    return interp(verify, n + 1) + interp(dcost, 1) + sum(interp(dcost, f) for f in level_frontiers(paths) if f)


# ----------------------------------------------------------------------------- acceptance
def _draft_topk_ranks(draft, seq: list[int], k: int, chunk: int = 128) -> torch.Tensor:
    """rank[j] (j >= 1) of seq[j] among the draft's top-k given seq[:j] (k when not in it)."""
    from arborspec.runtime.drafts import BigramDraft
    from arborspec.runtime.kvcache import KVCache

    n = len(seq)
    if not isinstance(draft, BigramDraft) and not (hasattr(draft, "forward") and hasattr(draft, "info")):
        raise InputError(f"tune measures model and bigram drafts; the {getattr(draft, 'kind', type(draft).__name__)} "
                         "draft is not supported (give --tree explicitly)")
    if isinstance(draft, BigramDraft):
        logits = draft._rows(torch.tensor(seq[:-1]))
    else:
        cache = KVCache(draft.info.cache, n, 1, draft.device)
        dev = draft.device
        limit = draft.info.max_tokens or chunk
        step = max(1, min(chunk, limit))
        parts = []
        with torch.inference_mode():
            for a in range(0, n - 1, step):
                b = min(n - 1, a + step)
                t = b - a
                ids = torch.tensor([seq[a:b]], device=dev)
                pos = torch.arange(a, b, device=dev)[None]
                mask = torch.ones(1, t, a + t, dtype=torch.bool)
                mask[0, :, a:] = torch.ones(t, t, dtype=torch.bool).tril()
                parts.append(draft.forward(ids, pos, mask.to(dev), cache)[0].float().cpu())
                cache.length = b
        logits = torch.cat(parts)
    top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices  # [n-1, k]
    nxt = torch.tensor(seq[1:])[:, None]
    hit = top == nxt
    rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full((n - 1,), k))
    return torch.cat([torch.tensor([k]), rank])


def measure_acceptance(target, draft, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                       k: int = 8, max_depth: int = 6, eos: Sequence[int] = (), min_count: int = 8,
                       progress=None) -> dict:
    """Sequoia's positional acceptance vector, per depth, from greedy decoding of the prompts."""
    from arborspec.runtime.decode import SpeculativeDecoder

    dec = SpeculativeDecoder(target, mode="vanilla")
    hits = [[0] * k for _ in range(max_depth)]
    counts = [0] * max_depth
    it = progress(prompts) if progress else prompts
    for p in it:
        gen = dec.generate(list(p), max_new_tokens, eos).tokens
        seq = list(p) + gen
        if len(gen) < 1:
            continue
        rank = _draft_topk_ranks(draft, seq, k).tolist()
        start = len(p)  # the first generated position
        for j in range(start, len(seq)):
            # depth d: the node is seq[j], the step's root seq[j-d]; the d-1 path tokens
            # seq[j-d+1..j-1] must be generated tokens matched within the draft's top-k
            for d in range(1, max_depth + 1):
                counts[d - 1] += 1
                if rank[j] < k:
                    hits[d - 1][rank[j]] += 1
                above = j - d
                if above < start or rank[above] >= k:
                    break
    q = []
    for d in range(max_depth):
        if counts[d] >= min_count or not q:
            c = max(1, counts[d])
            q.append([h / c for h in hits[d]])
        else:
            q.append(list(q[-1]))  # too few samples at this depth: reuse the shallower row
    return {"q": q, "counts": counts, "k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


def tree_children(paths: Sequence[Sequence[int]]) -> dict:
    """{parent path tuple: set of child ranks} of a static tree (the root is ())."""
    kids: dict = {}
    for p in paths:
        kids.setdefault(tuple(p[:-1]), set()).add(p[-1])
    return kids


def simulate_greedy_steps(rank: Sequence[int], start: int, end: int, paths: Sequence[Sequence[int]]) -> int:
    """Verify steps that greedy speculative decoding with this static tree takes to produce
    the target's tokens seq[start:end], given rank[j] = rank of seq[j] among the draft's
    candidates given seq[:j] (from `_draft_topk_ranks`).

    Exact for drafts whose candidates depend only on the committed text plus the path (any
    model or table draft with `--candidates topk`): along an accepted path the draft saw
    exactly the target's tokens. `full:D,W` is the static tree of all rank paths < W, depth
    <= D; `chain:K` is [[0], [0,0], ...]."""
    kids = tree_children(paths)
    pos, steps = start, 0
    while pos < end:
        node: tuple = ()
        a = 0
        while pos + a < end and rank[pos + a] in kids.get(node, ()):
            node = node + (rank[pos + a],)
            a += 1
        steps += 1
        pos += a + 1
    return steps


def full_tree_paths(depth: int, width: int) -> list[list[int]]:
    out: list[list[int]] = []
    level = [()]
    for _ in range(depth):
        level = [p + (r,) for p in level for r in range(width)]
        out += [list(p) for p in level]
    return out


def spec_paths(spec: str) -> list[list[int]]:
    """Rank paths of a data-independent tree spec (chain:K, full:D,W, static:FILE)."""
    from arborspec.runtime.trees import ChainTree, FullTree, StaticTree, parse_tree_spec

    pol = parse_tree_spec(spec)
    if isinstance(pol, StaticTree):
        return [list(p) for p in pol.paths]
    if isinstance(pol, (ChainTree, FullTree)):
        return full_tree_paths(pol.depth, pol.w)
    raise InputError(f"tree {spec!r} depends on draft scores: it cannot be simulated, only run")


# ----------------------------------------------------------------------------- tuning
def choose_tree(q, verify: dict, dcost: dict, max_nodes: int, max_depth: int) -> dict:
    """Every (n, D): DP tree, expected tokens/step, predicted step ms and tokens/s; the best."""
    grid = []
    for D in range(1, max_depth + 1):
        res = sequoia_dp(q, max_nodes, D)
        for n in range(1, max_nodes + 1):
            paths = res.tree(n)
            if len(paths) < n and n > 1:
                continue  # the DP found nothing worth adding: same tree as a smaller budget
            e = res.value[n] + 1.0
            ms = step_cost_ms(paths, verify, dcost)
            grid.append({"nodes": len(paths), "depth_limit": D, "depth": max(len(p) for p in paths),
                         "expected_tokens_per_step": e, "step_ms": ms, "tokens_per_s": 1e3 * e / ms,
                         "paths": paths})
    best = max(grid, key=lambda g: g["tokens_per_s"])
    return {"best": best, "grid": grid, "vanilla_tokens_per_s": 1e3 / interp(verify, 1)}


def _key(args) -> str:
    model = str(args.model)
    p = Path(model).expanduser()
    if p.exists():
        model = str(p.resolve())
    draft = str(args.draft or "")
    dp = Path(draft).expanduser()
    if draft and dp.exists():
        draft = str(dp.resolve())
    backend = args.backend or "torch"
    return json.dumps({"model": model, "draft": draft, "backend": backend,
                       "device": getattr(args, "device", "cpu")}, sort_keys=True)


def auto_tree_path(args) -> Path:
    """Where `--tree auto` looks: EXPORT_DIR/tree_auto.json, or the user cache for --model
    runs, keyed by model + draft + backend + device."""
    if getattr(args, "export_dir", None):
        return Path(args.export_dir) / AUTO_FILE
    from arborspec.models.registry import cache_dir

    key = _key(args)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{Path(str(args.model)).name}-{Path(str(args.draft or 'none')).name}")[:80]
    return cache_dir() / "tune" / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def resolve_tree(spec: str | None, models=None, args=None) -> str | None:
    """`auto` -> `static:PATH` of the tuned tree for these models (see auto_tree_path);
    any other spec is returned unchanged. A missing tuned file is one clear error."""
    if spec is None or str(spec).strip().lower() != "auto":
        return spec
    if args is None:
        raise InputError("--tree auto needs the model arguments to find the tuned tree")
    path = auto_tree_path(args)
    if not path.is_file():
        if getattr(args, "export_dir", None):
            how = f"arborspec tune --export-dir {args.export_dir}" + (f" --backend {args.backend}" if args.backend else "")
        else:
            how = f"arborspec tune --model {args.model} --draft {args.draft}" + (f" --backend {args.backend}" if args.backend else "")
        raise MissingFileError(f"--tree auto: no tuned tree for these models ({path}); run `{how}` first")
    try:
        meta = json.loads(path.read_text())
    except ValueError:
        raise InputError(f"--tree auto: {path} is not valid JSON; re-run `arborspec tune`") from None
    tuned_backend = meta.get("backend") if isinstance(meta, dict) else None
    backend = args.backend or ("torch" if getattr(args, "model", None) else "onnxruntime")
    if tuned_backend and tuned_backend != backend:
        print(f"arborspec: note: {path} was tuned for the {tuned_backend} backend, running on {backend}",
              file=sys.stderr)
    return f"static:{path}"


def calibration_prompts(tok, prompts_file=None, n: int = 8, chat: bool = False, vocab: int = 0,
                        seed: int = 0) -> list[list[int]]:
    """Calibration prompts: the prompts file's training split (tools/data/prompts.json by
    default; held-out entries are left for evaluation), then built-in seeds."""
    from .distill_draft import (
        SEEDS,
        _random_seed_ids,
        encode_entry,
        load_prompt_entries,
        split_prompts,
    )

    entries = load_prompt_entries(prompts_file)
    train, _ = split_prompts(entries) if entries else ([], [])
    out = []
    for e in train + [{"text": s} for s in SEEDS]:
        ids = encode_entry(e, tok, chat=chat if "text" in e else None)
        if ids:
            out.append(ids)
        if len(out) >= n:
            break
    if len(out) < n:
        out += _random_seed_ids(vocab, n - len(out), seed)
    return out[:n]


def tune(models, args, progress: bool = True) -> dict:
    """Measure, optimise, and write the tuned tree file(s). Returns the written document."""
    target, draft = models.target, models.draft
    if draft is None:
        raise InputError("tune needs a draft: give --draft layers:K|bigram|MODEL (or an export with a draft)")
    max_nodes = int(args.max_nodes)
    lim = models.limits.get("max_tree_nodes")
    if lim and max_nodes > lim:
        max_nodes = int(lim)
    if target.info.max_tokens is not None:
        max_nodes = min(max_nodes, target.info.max_tokens - 1)
    if max_nodes < 1 or args.max_depth < 1 or args.max_width < 1:
        raise InputError("--max-nodes, --max-depth and --max-width must be >= 1")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = lambda it, desc="": tqdm(it, desc=desc, leave=False)  # noqa: E731
    t0 = time.perf_counter()
    verify = engine_cost_curve(target, sample_sizes(max_nodes + 1), args.past, args.reps,
                               (lambda it: bar(it, "verify cost c(T)")) if bar else None)
    dcost = draft_cost_curve(draft, sample_sizes(max_nodes), args.past, args.reps,
                             (lambda it: bar(it, "draft cost d(F)")) if bar else None)
    tok = models.tokenizer
    eos = list(tok.meta.get("eos_token_ids") or []) if tok is not None else []
    prompts = calibration_prompts(tok, args.prompts, args.n_prompts, getattr(args, "chat", False),
                                  target.info.vocab_size, args.seed)
    acc = measure_acceptance(target, draft, prompts, args.calib_tokens, args.max_width, args.max_depth, eos,
                             progress=(lambda it: bar(it, "acceptance (greedy)")) if bar else None)
    choice = choose_tree(acc["q"], verify, dcost, max_nodes, args.max_depth)
    best = choice["best"]
    backend = args.backend or ("torch" if getattr(args, "model", None) else "onnxruntime")
    doc = {
        "format": FORMAT, "paths": best["paths"], "nodes": best["nodes"], "depth": best["depth"],
        "expected_tokens_per_step": best["expected_tokens_per_step"],
        "predicted_step_ms": best["step_ms"], "predicted_tokens_per_s": best["tokens_per_s"],
        "vanilla_tokens_per_s": choice["vanilla_tokens_per_s"],
        "predicted_speedup": best["tokens_per_s"] / choice["vanilla_tokens_per_s"],
        "backend": backend, "device": getattr(args, "device", "cpu"),
        "model": str(args.model) if getattr(args, "model", None) else None,
        "draft": str(args.draft) if getattr(args, "draft", None) else None,
        "export_dir": str(args.export_dir) if getattr(args, "export_dir", None) else None,
        "past": args.past, "cost_curve_ms": {str(k): v for k, v in verify.items()},
        "draft_cost_ms": {str(k): v for k, v in dcost.items()},
        "acceptance": acc, "max_nodes": max_nodes, "max_depth": args.max_depth,
        "budget_curve": [{k: v for k, v in g.items() if k != "paths"} for g in choice["grid"]],
        "tune_s": round(time.perf_counter() - t0, 2),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    targets = [auto_tree_path(args)]
    if getattr(args, "out", None):
        targets.append(Path(args.out))
    written = []
    for path in targets:
        try:
            _atomic_json(path, doc)
            written.append(str(path))
        except OSError as e:
            print(f"arborspec: note: could not write {path}: {e}", file=sys.stderr)
    if not written:
        raise PermissionError(f"could not write the tuned tree to {targets[0]} (give --out FILE)")
    doc["written"] = written
    if getattr(args, "plot", None):
        plot_tuning(doc, args.plot)
    return doc


def _atomic_json(path: Path, doc: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def plot_tuning(doc: dict, out: str | Path) -> None:
    """Two panels: measured cost curves (verify c(T), draft d(F)), and predicted tokens/s vs
    node budget per depth limit (vanilla as a line, the chosen tree marked)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    v = {int(k): x for k, x in doc["cost_curve_ms"].items()}
    d = {int(k): x for k, x in doc["draft_cost_ms"].items()}
    a.plot(sorted(v), [v[k] for k in sorted(v)], "o-", label="verify c(T)")
    a.plot(sorted(d), [d[k] for k in sorted(d)], "s--", label="draft level d(F)")
    a.set_xlabel("tokens per call (T = nodes + 1, or frontier F)")
    a.set_ylabel("ms per call (median)")
    a.set_title(f"cost on {doc['backend']} (P = {doc['past']})")
    a.grid(alpha=0.3)
    a.legend()
    by_d: dict[int, list] = {}
    for g in doc["budget_curve"]:
        by_d.setdefault(g["depth_limit"], []).append(g)
    for D, gs in sorted(by_d.items()):
        gs = sorted(gs, key=lambda g: g["nodes"])
        b.plot([g["nodes"] for g in gs], [g["tokens_per_s"] for g in gs], ".-", label=f"depth <= {D}")
    b.axhline(doc["vanilla_tokens_per_s"], color="k", ls=":", label="vanilla")
    b.plot([doc["nodes"]], [doc["predicted_tokens_per_s"]], "r*", ms=14, label="chosen")
    b.set_xlabel("tree nodes (budget)")
    b.set_ylabel("predicted tokens/s")
    b.set_title("Sequoia DP tree per budget")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
