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
   tree's tokens per step are then replayed on the calibration text (the decoding loop run
   over the measured ranks, `simulated_tokens_per_step`: q treats positions as independent
   and overestimates, see there), it is priced exactly (c(n+1) + d(1) for the root call +
   d(F_l) for every level l < depth with F_l expandable nodes) and the (n, D) with the best
   tokens per step / step time wins.

The result is a static tree spec (`static:FILE.json` accepts it) with its metadata, written where
runtime/tuned_tree.py says; `--tree auto` in every command resolves to it through
runtime/decoder_config.resolve_config.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from arborspec.runtime.errors import InputError, OutputError
from arborspec.runtime.fileio import atomic_write_json
from arborspec.runtime.sampling import SamplingParams
from arborspec.runtime.tuned_tree import ModelsKey
from arborspec.tools.prompts import calibration_prompts
from arborspec.tools.tune.acceptance_sim import (  # noqa: F401 - the tuning API, re-exported
    draft_topk_ranks,
    full_tree_paths,
    measure_acceptance,
    simulate_greedy_steps,
    simulated_tokens_per_step,
    spec_paths,
    tree_children,
)
from arborspec.tools.tune.cost_curves import decoder_threads, draft_cost_curve, engine_cost_curve, sample_sizes
from arborspec.tools.tune.tree_dp import (  # noqa: F401 - the tuning API, re-exported
    DPResult,
    choose_tree,
    interp,
    layout_calls,
    level_frontiers,
    sequoia_dp,
    step_cost_ms,
    tree_value,
)

FORMAT = 1
# sampled tuning keeps top-k candidates unless sample-unique made this much more in the loop: the
# int4 export's [[0]] measured 114.9 against 114.3 tok/s there and 1.32x against 1.36x in the bench
SAMPLED_MARGIN = 1.02


@dataclass
class TuneOptions:
    """What `tune` measures and searches (the CLI flags of `arborspec tune`)."""

    max_nodes: int = 32
    max_depth: int = 6
    max_width: int = 8
    past: int = 256
    reps: int = 5
    prompts: str | os.PathLike | None = None
    n_prompts: int = 8
    chat: bool | None = None  # None: each prompt's own `chat` flag (as bench reads them)
    calib_tokens: int = 64
    loop_candidates: int = 4  # best trees by the cost model re-priced in the decoding loop (0: none)
    loop_tokens: int = 32  # tokens per calibration prompt in that pass
    seed: int = 0
    out: str | os.PathLike | None = None
    plot: str | os.PathLike | None = None
    sampling: SamplingParams | None = None  # temperature > 0: tune for sampled decoding (its own file)


def auto_tree_path(key: ModelsKey, sampled: bool = False) -> Path:
    """Where `tune` writes and `--tree auto` reads these models' tree (runtime/tuned_tree.py)."""
    return key.path(sampled)


def loop_measure(
    target, draft, policies, prompts, tokens: int, eos, progress=None, sampling=None
) -> list[tuple[float, float]]:
    """(mean decode time per step in ms, tokens per step) of real decoding (greedy, or sampled
    with `sampling`, prompt i drawn with seed i) with each of `policies` (None: vanilla; a policy;
    or (policy, candidates)) over `prompts`: the verify at the prompts' own context lengths, the
    draft's level calls, the projection and top-k, the accept (sampled: each row the walk reads
    warped and drawn) and the cache commit, as a user's decoding pays them.
    Interleaved: each prompt is decoded by every policy in turn, so a slow spell of the
    machine falls on all of them alike (measured one policy after the other, a 1-node tree was
    once priced at 11.3 ms a step against vanilla's 7.2, "1.00x", where the bench then measured
    1.44x; four re-runs priced it at 1.33-1.47x)."""
    from arborspec.runtime.decode import SpeculativeDecoder

    decs = []
    for pol in policies:
        pol, cand = pol if isinstance(pol, tuple) else (pol, None)
        # every run a cold request (prefix_cache=False): the configurations share the prompts and
        # the draft, and a kept prefix would speed up whichever ran a prompt second; every step
        # drafts (adaptive=False): the tree's own cost is what is measured, not the governor's
        if pol is None:
            decs.append(SpeculativeDecoder(target, mode="vanilla", sampling=sampling, prefix_cache=False))
        else:
            decs.append(
                SpeculativeDecoder(
                    target, draft, tree=pol, candidates=cand, sampling=sampling, prefix_cache=False, adaptive=False
                )
            )
    for dec in decs:
        dec.generate(list(prompts[0]), 4, eos)  # warm
    secs, steps, made = [0.0] * len(decs), [0] * len(decs), [0] * len(decs)
    for n, p in enumerate(progress(prompts) if progress else prompts):
        for i, dec in enumerate(decs):
            st = dec.generate(list(p), tokens, eos, seed=n).stats
            secs[i] += st.decode_s
            steps[i] += st.steps
            made[i] += st.new_tokens
    return [(1e3 * s / max(k, 1), m / max(k, 1)) for s, k, m in zip(secs, steps, made)]


def price_in_loop(
    target, draft, choice: dict, prompts, eos, n: int, tokens: int, bar=None, sampling=None
) -> dict | None:
    """Re-price the cost model's `n` best trees (and vanilla) with step times measured in the
    decoding loop over the calibration prompts, and pick the best by replayed tokens per step /
    measured step time. The isolated costs miss what only the loop pays (measured, SmolLM2 +
    int8 EAGLE-3 head: predicted 21.7 ms per step of [[0],[1],[0,0]], the loop took 24-26 ms:
    the projection, top-k and host work around the head's 0.4 ms calls). Updates
    `choice["best"]` and `choice["vanilla_tokens_per_s"]`; returns what it measured.

    Sampled (`sampling` with temperature > 0): each tree runs twice in the loop, with `topk`
    and with `sample-unique` candidates (drawn from the draft's q, accepted by recursive
    rejection sampling: more tokens a call where the draft's q is close to the target's, a
    little more host work a level), and every one is priced by the tokens per second it made
    there (the replay describes `topk` only); the winner's `candidates` go into the file, top-k
    unless the other rule made SAMPLED_MARGIN times as many tokens a second."""
    from arborspec.runtime.trees import StaticTree

    if n <= 0 or not prompts:
        return None
    seen, cands = set(), []
    for g in sorted(choice["grid"], key=lambda g: -g["tokens_per_s"]):
        key = tuple(map(tuple, g["paths"]))
        if key not in seen:
            seen.add(key)
            cands.append(g)
        if len(cands) >= n:
            break
    sampled = sampling is not None and not sampling.greedy
    if sampled:
        cands = [dict(g, candidates=m) for m in ("topk", "sample-unique") for g in cands]
    pols = [(StaticTree(g["paths"]), g.get("candidates")) for g in cands] + [None]
    per_prompt = (lambda it: bar(it, "in-loop step times")) if bar else None
    *got, (vanilla_ms, _) = loop_measure(target, draft, pols, prompts, tokens, eos, per_prompt, sampling)
    for g, (m, tps) in zip(cands, got):
        g["loop_step_ms"] = m
        g["loop_tokens_per_step"] = tps
        if sampled:  # the tokens it made in the loop
            g["expected_tokens_per_step"] = tps
        g["loop_tokens_per_s"] = 1e3 * g["expected_tokens_per_step"] / m
    best = max(cands, key=lambda g: g["loop_tokens_per_s"])
    if sampled and best["candidates"] != "topk":  # top-k unless the other rule is clearly faster
        best_topk = max((g for g in cands if g["candidates"] == "topk"), key=lambda g: g["loop_tokens_per_s"])
        if best["loop_tokens_per_s"] < SAMPLED_MARGIN * best_topk["loop_tokens_per_s"]:
            best = best_topk
    best = dict(best, step_ms=best["loop_step_ms"], tokens_per_s=best["loop_tokens_per_s"])
    choice["best"] = best
    choice["vanilla_tokens_per_s"] = 1e3 / vanilla_ms
    return {
        "vanilla_step_ms": vanilla_ms,
        "tokens_per_prompt": tokens,
        "candidates": [
            {
                "nodes": g["nodes"],
                "depth": g["depth"],
                "candidates": g.get("candidates", "topk"),
                "model_step_ms": g["step_ms"],
                "loop_step_ms": g["loop_step_ms"],
                "loop_tokens_per_step": g["loop_tokens_per_step"],
                "loop_tokens_per_s": g["loop_tokens_per_s"],
            }
            for g in cands
        ],
    }


def tune(models, key: ModelsKey, opts: TuneOptions | None = None, progress: bool = True) -> dict:
    """Measure, optimise, and write the tuned tree file(s). Returns the written document."""
    opts = opts or TuneOptions()
    target, draft = models.target, models.draft
    if draft is None:
        raise InputError("tune needs a draft: give --draft layers:K|bigram|MODEL (or an export with a draft)")
    max_nodes = _node_budget(models, opts)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = lambda it, desc="": tqdm(it, desc=desc, leave=False, disable=None)  # noqa: E731
    t0 = time.perf_counter()
    verify = engine_cost_curve(
        target,
        sample_sizes(max_nodes + 1),
        opts.past,
        opts.reps,
        (lambda it: bar(it, "verify cost c(T)")) if bar else None,
    )
    with decoder_threads(target):  # the draft's calls beside the target's, as the decoder makes them
        dcost = draft_cost_curve(
            draft,
            sample_sizes(max_nodes),
            opts.past,
            opts.reps,
            (lambda it: bar(it, "draft cost d(F)")) if bar else None,
        )
    tok = models.tokenizer
    eos = list(tok.meta.get("eos_token_ids") or []) if tok is not None else []
    prompts = calibration_prompts(tok, opts.prompts, opts.n_prompts, opts.chat, target.info.vocab_size, opts.seed)
    sp = opts.sampling if opts.sampling is not None and not opts.sampling.greedy else None
    text = "greedy" if sp is None else f"sampled, T={sp.temperature:g}"
    acc = measure_acceptance(
        target,
        draft,
        prompts,
        opts.calib_tokens,
        opts.max_width,
        opts.max_depth,
        eos,
        progress=(lambda it: bar(it, f"acceptance ({text})")) if bar else None,
        sampling=sp,
        seed=opts.seed,
    )
    runs = acc.pop("runs")
    choice = choose_tree(
        acc["q"],
        verify,
        dcost,
        max_nodes,
        opts.max_depth,
        lambda paths: simulated_tokens_per_step(runs, paths),
        layout_calls if target.caps.row_invariant else None,
    )
    loop = price_in_loop(target, draft, choice, prompts, eos, opts.loop_candidates, opts.loop_tokens, bar, sp)
    measured = {"verify": verify, "dcost": dcost, "acc": acc, "loop": loop, "max_nodes": max_nodes}
    doc = _tuned_doc(choice, measured, key, opts, sp)
    doc["tune_s"] = round(time.perf_counter() - t0, 2)
    doc["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    doc["written"] = _write_tuned(doc, key, opts, sampled=sp is not None)
    if opts.plot:
        plot_tuning(doc, opts.plot)
    return doc


def _node_budget(models, opts: TuneOptions) -> int:
    """--max-nodes within the export's max_tree_nodes and the target's largest call."""
    max_nodes = int(opts.max_nodes)
    lim = models.limits.get("max_tree_nodes")
    if lim and max_nodes > lim:
        max_nodes = int(lim)
    if models.target.info.max_tokens is not None:
        max_nodes = min(max_nodes, models.target.info.max_tokens - 1)
    if max_nodes < 1 or opts.max_depth < 1 or opts.max_width < 1:
        raise InputError("--max-nodes, --max-depth and --max-width must be >= 1")
    return max_nodes


def _tuned_doc(choice: dict, measured: dict, key: ModelsKey, opts: TuneOptions, sp) -> dict:
    """The tuned tree file's document (without tune_s, created, written)."""
    best = choice["best"]
    return {
        "format": FORMAT,
        "paths": best["paths"],
        "nodes": best["nodes"],
        "depth": best["depth"],
        # replayed (simulated_tokens_per_step); sampled, as made in the loop (price_in_loop)
        "expected_tokens_per_step": best["expected_tokens_per_step"],
        "dp_tokens_per_step": best["dp_tokens_per_step"],  # Sequoia's estimate under q
        "predicted_step_ms": best["step_ms"],
        "predicted_tokens_per_s": best["tokens_per_s"],
        "vanilla_tokens_per_s": choice["vanilla_tokens_per_s"],
        "in_loop": measured["loop"],  # the candidates' step times measured in the decoding loop (price_in_loop)
        "predicted_speedup": best["tokens_per_s"] / choice["vanilla_tokens_per_s"],
        # None: tuned on greedy text, for temperature 0; else the sampling it was tuned for
        "sampling": None if sp is None else {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p},
        # sampled: the candidates that made the most tokens a second in the loop (price_in_loop);
        # decoding with this file takes them unless --candidates says otherwise
        "candidates": best.get("candidates") if sp is not None else None,
        "backend": key.resolved_backend,
        "device": key.device,
        "model": str(key.model) if key.model else None,
        "draft": str(key.draft) if key.draft else None,
        "export_dir": str(key.export_dir) if key.export_dir else None,
        "past": opts.past,
        "cost_curve_ms": {str(k): v for k, v in measured["verify"].items()},
        "draft_cost_ms": {str(k): v for k, v in measured["dcost"].items()},
        "acceptance": measured["acc"],
        "max_nodes": measured["max_nodes"],
        "max_depth": opts.max_depth,
        "budget_curve": [{k: v for k, v in g.items() if k != "paths"} for g in choice["grid"]],
    }


def _write_tuned(doc: dict, key: ModelsKey, opts: TuneOptions, sampled: bool) -> list[str]:
    """The document at the models' auto tree path and at --out: the paths written (a note for
    each that could not be; an error when none could)."""
    targets = [auto_tree_path(key, sampled=sampled)]
    if opts.out:
        targets.append(Path(opts.out))
    written = []
    for path in targets:
        try:
            _atomic_json(path, doc)
            written.append(str(path))
        except (OSError, OutputError) as e:
            print(f"arborspec: note: could not write {path}: {e}", file=sys.stderr)
    if not written:
        raise OutputError(f"could not write the tuned tree to {targets[0]} (give --out FILE)")
    return written


def _atomic_json(path: Path, doc: dict) -> None:
    atomic_write_json(path, doc, indent=1)


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
