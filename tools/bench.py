"""Benchmarks: vanilla vs chain vs tree decoding, and the Hugging Face alternatives, side by side.

Role: none inside a decoding step; this measures steps. Every configuration (our vanilla, our
chain, each tree policy, and optionally transformers' greedy / assisted / prompt-lookup
generation) runs on every prompt in one process, on the same engines and machine, one prompt at
a time (all configurations of prompt 1, then of prompt 2, ...), so slow drifts of the machine
hit every configuration alike.

Measurement
- ours: `GenerationStats` of one `SpeculativeDecoder.generate` call: tokens/s = new tokens /
  decode time (prefill excluded); mean accepted = tokens per verify call; time split draft /
  verify / accept+KV / other; runtime overhead per step (our own time, model calls excluded).
- hf-*: `model.generate` on the same token ids. Decode time = time(generate(max_new_tokens=N))
  - time(generate(max_new_tokens=1)) with the same arguments (the 1-token call is the prefill
  plus the first token), tokens/s = (new tokens - 1) / decode time. Target and assistant
  forward calls are counted and timed with forward hooks (verify / draft time, same
  subtraction), so mean accepted = new tokens / target forward calls.
- aggregate per configuration: the median over prompts AND the total (sum of tokens / sum of
  decode time); speed-up vs our vanilla (median of per-prompt ratios, and ratio of totals)
  and vs hf-greedy.
- greedy check (temperature 0): every one of our configurations must produce vanilla's tokens
  exactly (`greedy_match`); a mismatch is printed as a WARNING (only fp near-ties can cause
  one). For hf-* baselines the same comparison is recorded (`greedy_match`) for information:
  transformers is a different implementation, fp differences there are not our bug.

JSON schema (version 1): see `SCHEMA` below and benchmarks/RESULTS.md.
"""
from __future__ import annotations

import copy
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from arborspec.runtime.errors import InputError, MissingFileError

SCHEMA_VERSION = 1
BASELINES = ("hf-greedy", "hf-assisted", "hf-lookup")
SPLIT_KEYS = ("draft_s", "verify_s", "accept_kv_s", "other_s")

SCHEMA = """\
{
  "schema_version": 1,
  "meta": {"machine": {"platform", "processor", "cpu_count", "torch_threads", "device"},
           "backend", "model", "draft", "source", "versions": {python, arborspec, torch, ...},
           "command", "args": {...}, "date" (ISO 8601 UTC), "temperature", "max_new_tokens",
           "seed", "prompts_file", "notes": [str]},
  "configs": [{"name", "kind": "ours"|"hf", "mode": "vanilla"|"chain"|"tree"|"hf-greedy"|...,
               "tree": spec|null, "policy": "vanilla"|"chain"|"full"|"beam"|"dynamic"|"static"|"hf",
               "max_nodes": int (tree budget; 0 for vanilla; null for hf)}],
  "per_prompt": [{"id", "category", "prompt_tokens", "text" (vanilla's output, if a tokenizer),
                  "runs": {config name: RUN}}],
      RUN = {"new_tokens", "tokens_per_s", "speedup_vs_vanilla", "speedup_vs_hf_greedy",
             "mean_accepted", "target_calls", "draft_calls", "steps", "tree_nodes",
             "decode_s", "prefill_s", "time_split": {"draft_s", "verify_s", "accept_kv_s",
             "other_s"}, "draft_model_s", "overhead_per_step_ms", "accepted_hist": {"k": count},
             "stop_reason", "greedy_match": bool|null, "tokens": [int]}
  "aggregate": {"configs": {config name: {"prompts", "new_tokens", "decode_s",
                 "tokens_per_s_median", "tokens_per_s_total", "speedup_vs_vanilla_median",
                 "speedup_vs_vanilla_total", "speedup_vs_hf_greedy_median",
                 "speedup_vs_hf_greedy_total", "mean_accepted", "target_calls", "draft_calls",
                 "time_split": {...seconds, summed}, "time_split_frac": {...},
                 "ms_per_token": {...split per generated token}, "overhead_per_step_ms",
                 "accepted_hist": {...summed}, "greedy_match": bool|null}},
                "greedy_match": bool|null (all of our configs on all prompts),
                "by_category": {category: {config name: {"tokens_per_s_median",
                                "speedup_vs_vanilla_median", "mean_accepted"}}}}
}"""


# ---------------------------------------------------------------------------------- prompts
def default_prompts_path() -> Path:
    return Path(str(resources.files("arborspec.tools") / "data" / "prompts.json"))


def read_prompts_file(path: str | os.PathLike | None) -> tuple[list[dict], str]:
    """-> raw prompt entries and the path read. The file is {"prompts": [...]} or a list; each
    entry has "id", "category" and either "text" (+ optional "chat": true, "system") or "ids"."""
    p = Path(path) if path else default_prompts_path()
    if not p.is_file():
        raise MissingFileError(f"prompts file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except ValueError as e:
        raise InputError(f"{p}: not valid JSON ({e})") from None
    entries = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{p}: expected a non-empty list of prompts (or {{\"prompts\": [...]}})")
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or ("text" not in e and "ids" not in e):
            raise InputError(f"{p}: prompt #{i} needs a \"text\" or an \"ids\" entry")
    return entries, str(p)


def select_prompts(entries: list[dict], limit: int | None) -> list[dict]:
    """The first `limit` prompts taken round-robin over the categories (in file order), so a
    short run still covers every category."""
    if not limit or limit >= len(entries):
        return list(entries)
    if limit < 1:
        raise InputError(f"--limit-prompts must be >= 1, got {limit}")
    by_cat: dict[str, list[dict]] = {}
    for e in entries:
        by_cat.setdefault(str(e.get("category", "other")), []).append(e)
    out, queues = [], [list(v) for v in by_cat.values()]
    while len(out) < limit:
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    order = {id(e): i for i, e in enumerate(entries)}
    return sorted(out, key=lambda e: order[id(e)])


def encode_prompts(entries: list[dict], tok) -> list[dict]:
    """-> [{"id", "category", "ids"}]. Text prompts need a tokenizer; "ids" prompts do not."""
    out = []
    for i, e in enumerate(entries):
        pid = str(e.get("id", f"p{i}"))
        if "ids" in e:
            ids = [int(t) for t in e["ids"]]
        else:
            if tok is None:
                raise InputError(f"prompt {pid!r} is text but this model has no tokenizer: "
                                 "use a prompts file with \"ids\" entries")
            text = e["text"]
            if e.get("chat"):
                msgs = ([{"role": "system", "content": e["system"]}] if e.get("system") else [])
                msgs.append({"role": "user", "content": text})
                ids = tok.encode(tok.apply_chat(msgs), add_bos=False)
            else:
                ids = tok.encode(text)
        if not ids:
            raise InputError(f"prompt {pid!r} is empty")
        out.append({"id": pid, "category": str(e.get("category", "other")), "ids": ids})
    return out


# ---------------------------------------------------------------------------------- configs
@dataclass
class BenchConfig:
    name: str
    kind: str  # "ours" | "hf"
    mode: str
    tree: str | None = None
    policy: str = "vanilla"
    max_nodes: int | None = 0

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "mode": self.mode, "tree": self.tree,
                "policy": self.policy, "max_nodes": self.max_nodes}


def split_tree_specs(values: list[str] | None) -> list[str]:
    """--tree given repeatedly and/or as one ';'-separated list -> specs (commas stay inside)."""
    out: list[str] = []
    for v in values or []:
        out += [s.strip() for s in str(v).split(";") if s.strip()]
    return out


def build_configs(modes: list[str], trees: list[str], chain: str, baselines: list[str]) -> list[BenchConfig]:
    from arborspec.runtime.trees import ChainTree, parse_tree_spec

    bad = [m for m in modes if m not in ("vanilla", "chain", "tree")]
    if bad:
        raise InputError(f"unknown mode {bad[0]!r} in --modes (expected vanilla, chain, tree)")
    badb = [b for b in baselines if b not in BASELINES]
    if badb:
        raise InputError(f"unknown baseline {badb[0]!r} in --baselines (expected {', '.join(BASELINES)})")
    cfgs = [BenchConfig("vanilla", "ours", "vanilla", None, "vanilla", 0)]  # always: the reference
    if "chain" in modes:
        pol = parse_tree_spec(chain)
        if not isinstance(pol, ChainTree):
            raise InputError(f"--chain needs a chain:K spec, got {chain!r}")
        cfgs.append(BenchConfig(pol.spec, "ours", "chain", pol.spec, "chain", pol.max_nodes))
    if "tree" in modes:
        if not trees:
            raise InputError("mode tree needs at least one --tree SPEC")
        for spec in trees:
            pol = parse_tree_spec(spec)
            if any(c.name == pol.spec for c in cfgs):
                continue  # the same loop already in the list (e.g. chain:4 as chain and as tree)
            cfgs.append(BenchConfig(pol.spec, "ours", "tree", pol.spec, pol.kind, pol.max_nodes))
    for b in baselines:
        cfgs.append(BenchConfig(b, "hf", b, None, "hf", None))
    return cfgs


# ---------------------------------------------------------------------------------- HF baselines
def hf_source_path(source: dict | None) -> tuple[Path | None, str | None, str]:
    """Where transformers can load the target from: (dir, gguf file name or None, note)."""
    if not source:
        return None, None, "no model source recorded"
    path = source.get("path") or source.get("location")
    name = source.get("name") or source.get("model")
    if not path and name == "smollm2-135m":
        from arborspec.models.registry import smollm2_path

        path = str(smollm2_path())
    if not path:
        return None, None, "the model source has no path"
    p = Path(path).expanduser()
    if not p.exists() and name == "smollm2-135m":
        from arborspec.models.registry import smollm2_path

        p = smollm2_path()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name, ""
    if p.is_dir() and (p / "config.json").is_file():
        return p, None, ""
    if not p.exists():
        return None, None, f"model source {p} not found"
    return None, None, f"transformers cannot load {p.name} (not a .gguf file or a HF folder)"


class HFBaselines:
    """transformers' own generate() on the target's weights: greedy, assisted, prompt lookup."""

    def __init__(self, model_dir: Path, gguf_file: str | None, assistant_layers: int,
                 need_assistant: bool, lookup_tokens: int = 10):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.torch = torch
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          local_files_only=True, **kw).eval()
        self.load_s = time.perf_counter() - t0
        self.assistant = None
        self.assistant_layers = assistant_layers
        self.lookup_tokens = lookup_tokens
        if need_assistant:
            self.assistant = truncated_hf(self.model, assistant_layers)
        self._counts = {}
        self._hooks = []
        for tag, m in (("target", self.model), ("assistant", self.assistant)):
            if m is None:
                continue
            self._hooks.append(m.register_forward_pre_hook(self._pre(tag)))
            self._hooks.append(m.register_forward_hook(self._post(tag)))
        self._reset()

    def _reset(self):
        self._counts = {"target": [0, 0.0, None], "assistant": [0, 0.0, None]}

    def _pre(self, tag):
        def f(_m, _a):
            self._counts[tag][2] = time.perf_counter()
        return f

    def _post(self, tag):
        def f(_m, _a, _o):
            c = self._counts[tag]
            c[0] += 1
            c[1] += time.perf_counter() - c[2]
        return f

    def _gen(self, kind: str, ids, n: int, eos: list[int], temperature: float, seed: int):
        torch = self.torch
        kw: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=0,
                                  attention_mask=torch.ones_like(ids))
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        kw["eos_token_id"] = list(eos) if eos else None
        kw["pad_token_id"] = (eos[0] if eos else 0)
        if kind == "hf-assisted":
            kw["assistant_model"] = self.assistant
        elif kind == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = self.lookup_tokens
        torch.manual_seed(seed)
        self._reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, **kw)
        dt = time.perf_counter() - t0
        counts = {k: (v[0], v[1]) for k, v in self._counts.items()}
        return out[0, ids.shape[1]:].tolist(), dt, counts

    def run(self, kind: str, prompt: list[int], n: int, eos: list[int], temperature: float,
            seed: int) -> dict:
        ids = self.torch.tensor([prompt], dtype=self.torch.long)
        _, t1, c1 = self._gen(kind, ids, 1, eos, temperature, seed)
        toks, tn, cn = self._gen(kind, ids, n, eos, temperature, seed)
        if eos:  # generate() keeps the eos token, as our runtime does; drop any padding after it
            for i, t in enumerate(toks):
                if t in eos:
                    toks = toks[: i + 1]
                    break
        new = len(toks)
        decode_s = max(tn - t1, 1e-9)
        tcalls = cn["target"][0]
        verify_s = max(cn["target"][1] - c1["target"][1], 0.0)
        draft_s = max(cn["assistant"][1] - c1["assistant"][1], 0.0)
        other_s = max(decode_s - verify_s - draft_s, 0.0)
        stop = "eos" if eos and toks and toks[-1] in eos else "length"
        return {"new_tokens": new, "tokens_per_s": (new - 1) / decode_s if new > 1 else 0.0,
                "mean_accepted": new / tcalls if tcalls else None, "target_calls": tcalls,
                "draft_calls": cn["assistant"][0], "steps": tcalls, "tree_nodes": None,
                "decode_s": decode_s, "prefill_s": t1,
                "time_split": {"draft_s": draft_s, "verify_s": verify_s, "accept_kv_s": 0.0, "other_s": other_s},
                "draft_model_s": draft_s, "overhead_per_step_ms": None, "accepted_hist": {},
                "stop_reason": stop, "tokens": toks}


def truncated_hf(model, k: int):
    """An assistant for assisted generation: a copy of the HF model keeping its first K layers
    (embeddings, final norm and head shared in value with the target: same tokenizer)."""
    n = model.config.num_hidden_layers
    if not 1 <= k <= n:
        raise InputError(f"--hf-assistant-layers {k}: needs 1 <= K <= {n}")
    a = copy.deepcopy(model)
    a.model.layers = a.model.layers[:k]
    a.config.num_hidden_layers = k
    if getattr(a.config, "layer_types", None):
        a.config.layer_types = a.config.layer_types[:k]
    return a.eval()


# ---------------------------------------------------------------------------------- running
def _our_run(st, tokens: list[int], stop: str) -> dict:
    d = st.to_dict()
    return {"new_tokens": st.new_tokens, "tokens_per_s": st.tokens_per_s, "mean_accepted": st.mean_accepted,
            "target_calls": st.target_calls, "draft_calls": st.draft_calls, "steps": st.steps,
            "tree_nodes": st.tree_nodes, "decode_s": d["decode_s"], "prefill_s": st.prefill_s,
            "time_split": {k: d[k] for k in SPLIT_KEYS}, "draft_model_s": st.draft_model_s,
            "overhead_per_step_ms": st.overhead_per_step_ms,
            "accepted_hist": {str(k): v for k, v in sorted(st.accepted_hist.items())},
            "stop_reason": stop, "tokens": list(tokens)}


def make_decoders(models, configs: list[BenchConfig], temperature: float, candidates: str = "topk"):
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.sampling import SamplingParams

    sp = SamplingParams(temperature, 0, 1.0)
    decs = {}
    for c in configs:
        if c.kind != "ours":
            continue
        decs[c.name] = SpeculativeDecoder(models.target, models.draft if c.mode != "vanilla" else None,
                                          mode=c.mode, tree=c.tree or "full:3,2", candidates=candidates,
                                          sampling=sp, max_tree_nodes=models.limits.get("max_tree_nodes"))
    return decs


def run_bench(models, configs: list[BenchConfig], prompts: list[dict], *, max_new_tokens: int,
              temperature: float = 0.0, seed: int = 0, hf: HFBaselines | None = None,
              warmup: int = 1, progress: bool = True, log=None) -> tuple[list[dict], list[str]]:
    """Runs every config on every prompt -> (per_prompt list, warnings)."""
    from tqdm import tqdm

    log = log or (lambda s: print(s, file=sys.stderr))
    tok = models.tokenizer
    eos = list(tok.meta.get("eos_token_ids") or []) if tok is not None else []
    decs = make_decoders(models, configs, temperature)
    run_cfgs = [c for c in configs if c.kind == "ours" or hf is not None]
    if warmup and prompts:
        w = prompts[0]["ids"][-32:]
        for c in run_cfgs:
            for _ in range(warmup):
                if c.kind == "ours":
                    decs[c.name].generate(w, min(8, max_new_tokens), [], seed)
                else:
                    hf.run(c.name, w, min(4, max_new_tokens), [], temperature, seed)
    warnings: list[str] = []
    per_prompt = []
    bar = tqdm(total=len(prompts) * len(run_cfgs), desc="bench", unit="run", disable=not progress,
               dynamic_ncols=True)
    try:
        for p in prompts:
            runs: dict[str, dict] = {}
            for c in run_cfgs:
                bar.set_postfix_str(f"{p['id']} | {c.name}", refresh=False)
                if c.kind == "ours":
                    res = decs[c.name].generate(p["ids"], max_new_tokens, eos, seed)
                    runs[c.name] = _our_run(res.stats, res.tokens, res.stop_reason)
                else:
                    runs[c.name] = hf.run(c.name, p["ids"], max_new_tokens, eos, temperature, seed)
                bar.update(1)
            van = runs["vanilla"]
            hfg = runs.get("hf-greedy")
            for c in run_cfgs:
                r = runs[c.name]
                r["speedup_vs_vanilla"] = _ratio(r["tokens_per_s"], van["tokens_per_s"])
                r["speedup_vs_hf_greedy"] = _ratio(r["tokens_per_s"], hfg["tokens_per_s"]) if hfg else None
                if temperature > 0:
                    r["greedy_match"] = None
                    continue
                r["greedy_match"] = r["tokens"] == van["tokens"]
                if not r["greedy_match"]:
                    i = next((j for j, (a, b) in enumerate(zip(r["tokens"], van["tokens"])) if a != b),
                             min(len(r["tokens"]), len(van["tokens"])))
                    msg = (f"greedy mismatch: {c.name} differs from vanilla on prompt {p['id']!r} at new "
                           f"token {i}")
                    if c.kind == "ours":
                        msg = "WARNING " + msg + " (only an fp near-tie can cause this: check it)"
                        log(msg)
                    else:
                        msg = "note: " + msg + " (transformers reference; fp differences possible)"
                    warnings.append(msg)
            entry = {"id": p["id"], "category": p["category"], "prompt_tokens": len(p["ids"]), "runs": runs}
            if tok is not None:
                entry["text"] = tok.decode(van["tokens"], skip_special_tokens=True)
            per_prompt.append(entry)
    finally:
        bar.close()
    return per_prompt, warnings


def _ratio(a, b):
    return a / b if a and b else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(per_prompt: list[dict], configs: list[BenchConfig]) -> dict:
    names = [c.name for c in configs if per_prompt and c.name in per_prompt[0]["runs"]]
    out: dict[str, dict] = {}
    for name in names:
        runs = [p["runs"][name] for p in per_prompt]
        new = sum(r["new_tokens"] for r in runs)
        hf = name.startswith("hf-")
        # hf: the first token comes with the prefill, so (new - 1) tokens over the decode time
        dec_tokens = sum(max(r["new_tokens"] - 1, 0) for r in runs) if hf else new
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
        out[name] = {
            "prompts": len(runs), "new_tokens": new, "decode_s": dec_s,
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
        }
    van = out.get("vanilla", {}).get("tokens_per_s_total")
    hfg = out.get("hf-greedy", {}).get("tokens_per_s_total")
    for name, a in out.items():
        a["speedup_vs_vanilla_median"] = _median([p["runs"][name]["speedup_vs_vanilla"] for p in per_prompt])
        a["speedup_vs_vanilla_total"] = _ratio(a["tokens_per_s_total"], van)
        a["speedup_vs_hf_greedy_median"] = _median([p["runs"][name].get("speedup_vs_hf_greedy")
                                                    for p in per_prompt])
        a["speedup_vs_hf_greedy_total"] = _ratio(a["tokens_per_s_total"], hfg)
    ours = [c.name for c in configs if c.kind == "ours" and c.name in out]
    gms = [out[n]["greedy_match"] for n in ours]
    by_cat: dict[str, dict] = {}
    for cat in sorted({p["category"] for p in per_prompt}):
        ps = [p for p in per_prompt if p["category"] == cat]
        by_cat[cat] = {n: {"prompts": len(ps),
                           "tokens_per_s_median": _median([p["runs"][n]["tokens_per_s"] for p in ps]),
                           "speedup_vs_vanilla_median": _median([p["runs"][n]["speedup_vs_vanilla"] for p in ps]),
                           "mean_accepted": _median([p["runs"][n]["mean_accepted"] for p in ps])}
                       for n in names}
    return {"configs": out, "greedy_match": None if any(g is None for g in gms) else all(gms),
            "by_category": by_cat}


# ---------------------------------------------------------------------------------- reporting
def _f(x, fmt="{:.2f}", none="—"):
    return none if x is None else fmt.format(x)


def format_table(results: dict) -> str:
    """The aggregate as a markdown table (one row per configuration)."""
    agg = results["aggregate"]["configs"]
    cfgs = {c["name"]: c for c in results["configs"]}
    head = ("| config | nodes | tok/s median | tok/s total | speed-up vs vanilla (median / total) | "
            "vs hf-greedy (total) | accepted/call | target calls | ms/token draft / verify / accept+KV / other "
            "| overhead ms/step | greedy = vanilla |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, a in agg.items():
        c = cfgs.get(name, {})
        mpt = a["ms_per_token"]
        gm = a["greedy_match"]
        lines.append(
            f"| {name} | {_f(c.get('max_nodes'), '{}')} | {_f(a['tokens_per_s_median'], '{:.1f}')} | "
            f"{_f(a['tokens_per_s_total'], '{:.1f}')} | {_f(a['speedup_vs_vanilla_median'])}x / "
            f"{_f(a['speedup_vs_vanilla_total'])}x | {_f(a['speedup_vs_hf_greedy_total'])}x | "
            f"{_f(a['mean_accepted'])} | {a['target_calls']} | "
            + " / ".join(_f(mpt[k], '{:.1f}') for k in SPLIT_KEYS)
            + f" | {_f(a['overhead_per_step_ms'])} | {'—' if gm is None else ('yes' if gm else 'NO')} |")
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
            by_pol.setdefault(c["policy"], []).append((c["max_nodes"], agg[c["name"]]["speedup_vs_vanilla_total"] or 0,
                                                       c["name"]))
    for pol, pts in sorted(by_pol.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=pol)
        for x, y, n in pts:
            ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="our vanilla")
    for i, c in enumerate(c for c in cfgs if c["kind"] == "hf"):
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
        ax.bar([x + (i - (len(ours) - 1) / 2) * w for x in xs], [h.get(str(x), 0) / tot for x in xs], width=w,
               label=f"{c['name']} (mean {_f(agg[c['name']]['mean_accepted'])})")
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
    fig.suptitle(f"{m.get('model')} | draft {m.get('draft')} | {m.get('backend')} | "
                 f"{m['machine'].get('cpu_count')} CPUs, {m['machine'].get('torch_threads')} threads | "
                 f"T={m.get('temperature')} | {m.get('max_new_tokens')} new tokens", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("arborspec", "torch", "numpy", "transformers", "onnxruntime", "onnxruntime-gpu",
                "tensorrt-rtx", "tokenizers"):
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
    d = {"platform": platform.platform(), "processor": cpu, "cpu_count": os.cpu_count(),
         "torch_threads": torch.get_num_threads(), "device": device}
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
    out = [f"## {title or (str(m.get('model')) + ' | draft ' + str(m.get('draft')) + ' | ' + str(m.get('backend')))}", "",
           "```", m.get("command", ""), "```", "",
           f"- date: {m.get('date')}",
           f"- machine: {mc.get('processor')} | {mc.get('cpu_count')} CPUs | torch threads {mc.get('torch_threads')} | "
           f"{mc.get('platform')} | load average before/after: {mc.get('loadavg_before')} / {mc.get('loadavg_1_5_15')}",
           "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items()),
           f"- {len(results['per_prompt'])} prompts ({', '.join(sorted({p['category'] for p in results['per_prompt']}))}), "
           f"{m.get('max_new_tokens')} new tokens, temperature {m.get('temperature')}, "
           f"greedy_match (all our configs == vanilla): {agg.get('greedy_match')}", "",
           format_table(results), ""]
    cats = agg.get("by_category") or {}
    if cats:
        names = list(agg["configs"])
        out += ["Median speed-up vs our vanilla (and mean accepted tokens per target call) by category:", "",
                "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for cat, d in cats.items():
            out.append(f"| {cat} ({next(iter(d.values()))['prompts']}) | " + " | ".join(
                f"{_f(d[n]['speedup_vs_vanilla_median'])}x ({_f(d[n]['mean_accepted'])})" for n in names) + " |")
        out.append("")
    if m.get("notes"):
        out += ["Notes:", ""] + [f"- {n}" for n in m["notes"]] + [""]
    return "\n".join(out)
