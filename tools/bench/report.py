"""`arborspec bench` results: the JSON schema, aggregation over prompts (medians, totals,
speed-ups), the markdown table, the plot, and the machine/version record.

Role in one decode step: none; reports what the measured steps cost and bought.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
from pathlib import Path

SCHEMA_VERSION = 1


SPLIT_KEYS = ("draft_s", "verify_s", "accept_kv_s", "other_s")


SCHEMA = """\
{
  "schema_version": 1,
  "meta": {"machine": {"platform", "processor", "cpu_count", "torch_threads", "device"},
           "backend", "model", "draft", "source", "versions": {python, arborspec, torch,
           onnxruntime, onnxruntime-genai, llama-cpp-python, ...},
           "command", "args": {...}, "date" (ISO 8601 UTC), "temperature", "max_new_tokens",
           "seed", "prompts_file", "notes": [str],
           "peers": {peer name: {"package", "version", model folder/file, threads, options}},
           "skipped": {baseline name: one-line reason it did not run}},
  "configs": [{"name", "kind": "ours"|"hf"|"peer", "mode": "vanilla"|"chain"|"tree"|"hf-greedy"|
               "ort-genai"|"llama-cpp"|...,
               "tree": spec|null, "policy": "vanilla"|"chain"|"full"|"beam"|"dynamic"|"static"|"hf"|"peer",
               "max_nodes": int (tree budget; 0 for vanilla; null for hf and peers),
               "candidates": "topk"|"sample"|"sample-unique" (ours; how children are drawn when sampling)}],
  "per_prompt": [{"id", "category", "prompt_tokens", "text" (vanilla's output, if a tokenizer),
                  "runs": {config name: RUN}}],
      RUN = {"new_tokens", "tokens_per_s", "speedup_vs_vanilla", "speedup_vs_hf_greedy",
             "mean_accepted", "target_calls", "draft_calls", "steps", "tree_nodes",
             "decode_s", "prefill_s", "time_split": {"draft_s", "verify_s", "accept_kv_s",
             "other_s"}, "draft_model_s", "overhead_per_step_ms", "accepted_hist": {"k": count},
             "stop_reason", "greedy_match": bool|null, "agree_prefix": int|null (leading
             tokens equal to vanilla's), "tokens": [int], "peer_stats": {...} (GenAI n-gram only)}
  "aggregate": {"configs": {config name: {"prompts", "new_tokens", "decode_s",
                 "tokens_per_s_median", "tokens_per_s_total", "speedup_vs_vanilla_median",
                 "speedup_vs_vanilla_total", "speedup_vs_hf_greedy_median",
                 "speedup_vs_hf_greedy_total", "mean_accepted", "target_calls", "draft_calls",
                 "time_split": {...seconds, summed}, "time_split_frac": {...},
                 "ms_per_token": {...split per generated token}, "overhead_per_step_ms",
                 "accepted_hist": {...summed}, "greedy_match": bool|null,
                 "identical_prompts": int|null (prompts whose tokens equal vanilla's),
                 "agree_prefix_frac": float|null (sum of agree_prefix / sum of vanilla's tokens)}},
                "greedy_match": bool|null (all of our configs on all prompts),
                "by_category": {category: {config name: {"tokens_per_s_median",
                                "speedup_vs_vanilla_median", "mean_accepted"}}}}
}"""


def _ratio(a, b):
    return a / b if a and b else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(per_prompt: list[dict], configs: list) -> dict:
    names = [c.name for c in configs if per_prompt and c.name in per_prompt[0]["runs"]]
    kinds = {c.name: c.kind for c in configs}
    out: dict[str, dict] = {}
    for name in names:
        runs = [p["runs"][name] for p in per_prompt]
        new = sum(r["new_tokens"] for r in runs)
        # hf and peers: the first token comes with the prefill, so (new - 1) tokens over the decode time
        baseline = kinds.get(name, "ours") != "ours"
        dec_tokens = sum(max(r["new_tokens"] - 1, 0) for r in runs) if baseline else new
        dec_s = sum(r["decode_s"] for r in runs)
        steps = sum(r["steps"] or 0 for r in runs)
        split = {k: sum(r["time_split"][k] for r in runs) for k in SPLIT_KEYS}
        tot = sum(split.values())
        hist: dict[str, int] = {}
        for r in runs:
            for k, v in r["accepted_hist"].items():
                hist[k] = hist.get(k, 0) + v
        own = [r["overhead_per_step_ms"] * r["steps"] for r in runs if r["overhead_per_step_ms"] is not None]
        gm = [r.get("greedy_match") for r in runs]
        agree = [r.get("agree_prefix") for r in runs]
        van_tokens = sum(len(p["runs"]["vanilla"]["tokens"]) for p in per_prompt) if "vanilla" in names else 0
        out[name] = {
            "prompts": len(runs),
            "new_tokens": new,
            "decode_s": dec_s,
            "tokens_per_s_median": _median([r["tokens_per_s"] for r in runs]),
            "tokens_per_s_total": dec_tokens / dec_s if dec_s > 0 else None,
            "mean_accepted": (new / steps) if steps else None,
            "target_calls": sum(r["target_calls"] or 0 for r in runs),
            "draft_calls": sum(r["draft_calls"] or 0 for r in runs),
            "time_split": split,
            "time_split_frac": {k: (v / tot if tot else None) for k, v in split.items()},
            "ms_per_token": {k: (1e3 * v / dec_tokens if dec_tokens else None) for k, v in split.items()},
            "overhead_per_step_ms": (sum(own) / steps) if own and steps else None,
            "accepted_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "greedy_match": None if any(g is None for g in gm) else all(gm),
            "identical_prompts": None if any(g is None for g in gm) else sum(bool(g) for g in gm),
            "agree_prefix_frac": (sum(agree) / van_tokens)
            if van_tokens and all(a is not None for a in agree)
            else None,
            "ttft_s_median": _median([r.get("ttft_s") for r in runs if r.get("ttft_s") is not None]),
        }
    van = out.get("vanilla", {}).get("tokens_per_s_total")
    hfg = out.get("hf-greedy", {}).get("tokens_per_s_total")
    for name, a in out.items():
        a["speedup_vs_vanilla_median"] = _median([p["runs"][name]["speedup_vs_vanilla"] for p in per_prompt])
        a["speedup_vs_vanilla_total"] = _ratio(a["tokens_per_s_total"], van)
        a["speedup_vs_hf_greedy_median"] = _median([p["runs"][name].get("speedup_vs_hf_greedy") for p in per_prompt])
        a["speedup_vs_hf_greedy_total"] = _ratio(a["tokens_per_s_total"], hfg)
    ours = [c.name for c in configs if c.kind == "ours" and c.name in out]
    gms = [out[n]["greedy_match"] for n in ours]
    by_cat: dict[str, dict] = {}
    for cat in sorted({p["category"] for p in per_prompt}):
        ps = [p for p in per_prompt if p["category"] == cat]
        by_cat[cat] = {
            n: {
                "prompts": len(ps),
                "tokens_per_s_median": _median([p["runs"][n]["tokens_per_s"] for p in ps]),
                "speedup_vs_vanilla_median": _median([p["runs"][n]["speedup_vs_vanilla"] for p in ps]),
                "mean_accepted": _median([p["runs"][n]["mean_accepted"] for p in ps]),
            }
            for n in names
        }
    return {"configs": out, "greedy_match": None if any(g is None for g in gms) else all(gms), "by_category": by_cat}


# ---------------------------------------------------------------------------------- reporting
def _f(x, fmt="{:.2f}", none="—"):
    return none if x is None else fmt.format(x)


def format_table(results: dict) -> str:
    """The aggregate as a markdown table (one row per configuration)."""
    agg = results["aggregate"]["configs"]
    cfgs = {c["name"]: c for c in results["configs"]}
    head = (
        "| config | nodes | tok/s median | tok/s total | speed-up vs vanilla (median / total) | "
        "vs hf-greedy (total) | accepted/call | target calls | ms/token draft / verify / accept+KV / other "
        "| overhead ms/step | TTFT ms median | greedy = vanilla |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, a in agg.items():
        c = cfgs.get(name, {})
        mpt = a["ms_per_token"]
        gm = a["greedy_match"]
        if c.get("kind", "ours") == "ours" or a.get("identical_prompts") is None:
            same = "—" if gm is None else ("yes" if gm else "NO")
        else:  # a baseline: how many prompts agree exactly, and the share of leading tokens that agree
            same = f"{a['identical_prompts']}/{a['prompts']} ({_f(a.get('agree_prefix_frac'), '{:.0%}')})"
        lines.append(
            f"| {name} | {_f(c.get('max_nodes'), '{}')} | {_f(a['tokens_per_s_median'], '{:.1f}')} | "
            f"{_f(a['tokens_per_s_total'], '{:.1f}')} | {_f(a['speedup_vs_vanilla_median'])}x / "
            f"{_f(a['speedup_vs_vanilla_total'])}x | {_f(a['speedup_vs_hf_greedy_total'], '{:.2f}x')} | "
            f"{_f(a['mean_accepted'])} | {a['target_calls']} | "
            + " / ".join(_f(mpt[k], "{:.1f}") for k in SPLIT_KEYS)
            + f" | {_f(a['overhead_per_step_ms'])} | "
            + f"{_f(None if a.get('ttft_s_median') is None else 1e3 * a['ttft_s_median'], '{:.0f}')} | "
            + f"{same} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: str | os.PathLike) -> None:
    """Three panels: speed-up vs tree budget per policy; accepted tokens per step (histogram);
    time per generated token split into draft / verify / accept+KV / other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = results["aggregate"]["configs"]
    cfgs = [c for c in results["configs"] if c["name"] in agg]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    ax = axes[0]
    by_pol: dict[str, list] = {}
    for c in cfgs:
        if c["kind"] == "ours" and c["mode"] != "vanilla":
            by_pol.setdefault(c["policy"], []).append(
                (c["max_nodes"], agg[c["name"]]["speedup_vs_vanilla_total"] or 0, c["name"])
            )
    for pol, pts in sorted(by_pol.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=pol)
        for x, y, n in pts:
            ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="our vanilla")
    for i, c in enumerate(c for c in cfgs if c["kind"] != "ours"):
        s = agg[c["name"]]["speedup_vs_vanilla_total"]
        if s:
            ax.axhline(s, color=f"C{5 + i}", lw=1, ls="--", label=c["name"])
    ax.set_xlabel("tree budget (max drafted nodes per step)")
    ax.set_ylabel("speed-up vs our vanilla (total tokens / total time)")
    ax.set_title("speed-up vs tree budget")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[1]
    ours = [c for c in cfgs if c["kind"] == "ours" and c["mode"] != "vanilla"]
    kmax = max([int(k) for c in ours for k in agg[c["name"]]["accepted_hist"]] + [1])
    w = 0.8 / max(len(ours), 1)
    for i, c in enumerate(ours):
        h = agg[c["name"]]["accepted_hist"]
        tot = sum(h.values()) or 1
        xs = list(range(1, kmax + 1))
        ax.bar(
            [x + (i - (len(ours) - 1) / 2) * w for x in xs],
            [h.get(str(x), 0) / tot for x in xs],
            width=w,
            label=f"{c['name']} (mean {_f(agg[c['name']]['mean_accepted'])})",
        )
    ax.set_xlabel("tokens committed per target call (accepted depth + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("accepted length per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")

    ax = axes[2]
    names = [c["name"] for c in cfgs]
    bottom = [0.0] * len(names)
    labels = {"draft_s": "draft", "verify_s": "verify (target)", "accept_kv_s": "accept+KV", "other_s": "other"}
    for k in SPLIT_KEYS:
        vals = [agg[n]["ms_per_token"][k] or 0.0 for n in names]
        ax.bar(names, vals, bottom=bottom, label=labels[k])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per generated token")
    ax.set_title("where the time goes")
    ax.tick_params(axis="x", rotation=35, labelsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    m = results["meta"]
    fig.suptitle(
        f"{m.get('model')} | draft {m.get('draft')} | {m.get('backend')} | "
        f"{m['machine'].get('cpu_count')} CPUs, {m['machine'].get('torch_threads')} threads | "
        f"T={m.get('temperature')} | {m.get('max_new_tokens')} new tokens",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in (
        "arborspec",
        "torch",
        "numpy",
        "transformers",
        "onnxruntime",
        "onnxruntime-gpu",
        "tensorrt-rtx",
        "tokenizers",
        "onnxruntime-genai",
        "llama-cpp-python",
    ):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def machine(device: str) -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    d = {
        "platform": platform.platform(),
        "processor": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    try:
        d["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]  # other work on the machine
    except OSError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name()
    return d


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def render_markdown(results: dict, title: str | None = None) -> str:
    """A results section for benchmarks/RESULTS.md: command, machine, date, aggregate table,
    per-category medians and notes."""
    m = results["meta"]
    mc = m["machine"]
    agg = results["aggregate"]
    v = m.get("versions", {})
    out = [
        f"## {title or (str(m.get('model')) + ' | draft ' + str(m.get('draft')) + ' | ' + str(m.get('backend')))}",
        "",
        "```",
        m.get("command", ""),
        "```",
        "",
        f"- date: {m.get('date')}",
        f"- machine: {mc.get('processor')} | {mc.get('cpu_count')} CPUs | torch threads {mc.get('torch_threads')} | "
        f"{mc.get('platform')} | load average before/after: {mc.get('loadavg_before')} / {mc.get('loadavg_1_5_15')}",
        "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items()),
        f"- {len(results['per_prompt'])} prompts ({', '.join(sorted({p['category'] for p in results['per_prompt']}))}), "
        f"{m.get('max_new_tokens')} new tokens, temperature {m.get('temperature')}, "
        f"greedy_match (all our configs == vanilla): {agg.get('greedy_match')}",
        "",
        format_table(results),
        "",
    ]
    cats = agg.get("by_category") or {}
    if cats:
        names = list(agg["configs"])
        out += [
            "Median speed-up vs our vanilla (and mean accepted tokens per target call) by category:",
            "",
            "| category | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for cat, d in cats.items():
            out.append(
                f"| {cat} ({next(iter(d.values()))['prompts']}) | "
                + " | ".join(f"{_f(d[n]['speedup_vs_vanilla_median'])}x ({_f(d[n]['mean_accepted'])})" for n in names)
                + " |"
            )
        out.append("")
    if m.get("notes"):
        out += ["Notes:", ""] + [f"- {n}" for n in m["notes"]] + [""]
    return "\n".join(out)
