"""Benchmarks: vanilla vs chain vs tree decoding, and the alternatives a user would pick, side by side.

Role: none inside a decoding step; this measures steps. Every configuration (our vanilla, our
chain, each tree policy, and optionally transformers' greedy / assisted / prompt-lookup
generation, ONNX Runtime GenAI and llama.cpp) runs on every prompt in one process, on the same engines and machine, one prompt at
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
- peers (tools/bench/peers.py: ort-genai*, llama-cpp*): the same prompt ids, greedy; prefill =
  until their first new token, decode = the rest, tokens/s = (new tokens - 1) / decode time.
- aggregate per configuration: the median over prompts AND the total (sum of tokens / sum of
  decode time); speed-up vs our vanilla (median of per-prompt ratios, and ratio of totals)
  and vs hf-greedy.
- greedy check (temperature 0): every one of our configurations must produce vanilla's tokens
  exactly (`greedy_match`); a mismatch is printed as a WARNING (only fp near-ties can cause
  one). For hf-* baselines the same comparison is recorded (`greedy_match`) for information:
  transformers is a different implementation, fp differences there are not our bug. Every
  run also records `agree_prefix` (leading tokens equal to vanilla's): the table shows, for a
  baseline, prompts identical to vanilla / prompts (share of vanilla's tokens in agreeing
  prefixes), so a faster peer that decodes other tokens (int4, 8-bit activations) is visible.

This module runs the measurements; tools/bench/baselines.py holds the transformers
baselines, tools/bench/peers.py ONNX Runtime GenAI and llama.cpp, tools/bench/report.py the JSON schema (`SCHEMA`), aggregation, table and plot,
tools/prompts.py the prompt sets, tools/commands/bench.py the command line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from arborspec.runtime.errors import InputError
from arborspec.tools.bench.baselines import BASELINES, HFBaselines
from arborspec.tools.bench.peers import PEERS
from arborspec.tools.bench.report import SPLIT_KEYS, _ratio


# ---------------------------------------------------------------------------------- configs
@dataclass
class BenchConfig:
    name: str
    kind: str  # "ours" | "hf" (transformers) | "peer" (ONNX Runtime GenAI, llama.cpp)
    mode: str
    tree: str | None = None
    policy: str = "vanilla"
    max_nodes: int | None = 0
    draft: str | None = None  # None: the models' draft; "lookup": an n-gram lookup draft of its own
    candidates: str = "topk"  # how draft children are chosen when sampling (runtime/drafts/tree_builder.py)
    adaptive: bool | None = None  # governed steps (runtime/governor.py); None: ARBORSPEC_ADAPTIVE decides

    def to_dict(self) -> dict:
        return {
            "adaptive": self.adaptive,
            "draft": self.draft,
            "candidates": self.candidates,
            "name": self.name,
            "kind": self.kind,
            "mode": self.mode,
            "tree": self.tree,
            "policy": self.policy,
            "max_nodes": self.max_nodes,
        }


def split_tree_specs(values: list[str] | None) -> list[str]:
    """--tree given repeatedly and/or as one ';'-separated list -> specs (commas stay inside)."""
    out: list[str] = []
    for v in values or []:
        out += [s.strip() for s in str(v).split(";") if s.strip()]
    return out


def build_configs(
    modes: list[str],
    trees: list[str],
    chain: str,
    baselines: list[str],
    lookup_trees: list[str] = (),
    mix_trees: list[str] = (),
    candidates: list[str | None] = ("topk",),
    suffix_trees: tuple[list[str], list[str]] = ((), ()),
) -> list[BenchConfig]:
    """The configurations in run order. Each speculative one runs once per candidate mode
    (`candidates`, the first unnamed, the others named `SPEC@MODE`; None: the tree's own, a
    tuned file's `candidates`, else topk); a data-dependent tree (dynamic, beam) ranks
    candidates by score, so it runs with top-k candidates only."""
    import dataclasses

    from arborspec.runtime.drafts.tree_builder import CANDIDATE_MODES
    from arborspec.runtime.trees import ChainTree, parse_tree_spec

    bad = [m for m in modes if m not in ("vanilla", "chain", "tree")]
    if bad:
        raise InputError(f"unknown mode {bad[0]!r} in --modes (expected vanilla, chain, tree)")
    badb = [b for b in baselines if b not in BASELINES + PEERS]
    if badb:
        raise InputError(f"unknown baseline {badb[0]!r} in --baselines (expected {', '.join(BASELINES + PEERS)})")
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
    for spec in lookup_trees:  # the lookup draft next to the models' draft, in the same run
        pol = parse_tree_spec(spec)
        cfgs.append(BenchConfig(f"lookup+{pol.spec}", "ours", "tree", pol.spec, pol.kind, pol.max_nodes, "lookup"))
    for spec in mix_trees:  # the models' draft mixed with lookup (runtime/drafts/mixed.py)
        pol = parse_tree_spec(spec)
        cfgs.append(BenchConfig(f"mix+{pol.spec}", "ours", "tree", pol.spec, pol.kind, pol.max_nodes, "mix"))
    # the suffix draft alone and mixed with the models' draft (runtime/drafts/suffix.py): it widens
    # the tree with its own proposal, so `pol` is the base the proposal is added to
    for (name, draft), specs in zip((("suffix", "suffix"), ("suffix-mix", "suffix-mix")), suffix_trees):
        for spec in specs:
            pol = parse_tree_spec(spec)
            cfgs.append(BenchConfig(f"{name}+{pol.spec}", "ours", "tree", pol.spec, pol.kind, pol.max_nodes, draft))
    badc = [m for m in candidates if m not in CANDIDATE_MODES + (None,)]
    if badc or not candidates:
        raise InputError(f"unknown candidate mode {(badc or [''])[0]!r} (expected {', '.join(CANDIDATE_MODES)})")
    spec_cfgs, out = cfgs[1:], cfgs[:1]
    for i, mode in enumerate(dict.fromkeys(candidates)):
        for c in spec_cfgs:
            pol = parse_tree_spec(c.tree)
            ranked = pol.data_dependent
            if i == 0:
                own = mode or pol.candidates or "topk"
                out.append(dataclasses.replace(c, candidates="topk" if ranked else own))
            elif mode == "topk" or not ranked:
                out.append(dataclasses.replace(c, name=f"{c.name}@{mode}", candidates=mode))
    cfgs = out
    for b in dict.fromkeys(baselines):
        kind = "hf" if b in BASELINES else "peer"
        cfgs.append(BenchConfig(b, kind, b, None, kind, None))
    return cfgs


def with_governed(configs: list[BenchConfig]) -> list[BenchConfig]:
    """`bench --governed`: each speculative configuration of ours twice, ungoverned as named and
    governed (runtime/governor.py) as NAME~governed, so both run side by side on every request."""
    import dataclasses

    out = []
    for c in configs:
        speculative = c.kind == "ours" and c.mode != "vanilla"
        out.append(dataclasses.replace(c, adaptive=False) if speculative else c)
        if speculative:
            out.append(dataclasses.replace(c, name=f"{c.name}~governed", adaptive=True))
    return out


# ---------------------------------------------------------------------------------- running
def _our_run(st, tokens: list[int], stop: str) -> dict:
    d = st.to_dict()
    return {
        "new_tokens": st.new_tokens,
        "tokens_per_s": st.tokens_per_s,
        "mean_accepted": st.mean_accepted,
        "target_calls": st.target_calls,
        "draft_calls": st.draft_calls,
        "steps": st.steps,
        "held_steps": st.held_steps,  # steps the governor ran without a tree (bench --governed)
        "tree_nodes": st.tree_nodes,
        "decode_s": d["decode_s"],
        "prefill_s": st.prefill_s,
        "ttft_s": st.ttft_s,
        "time_split": {k: d[k] for k in SPLIT_KEYS},
        "draft_model_s": st.draft_model_s,
        "overhead_per_step_ms": st.overhead_per_step_ms,
        "accepted_hist": {str(k): v for k, v in sorted(st.accepted_hist.items())},
        "stop_reason": stop,
        "tokens": list(tokens),
    }


def mismatch_message(c: BenchConfig, prompt_id: str, at: int, exact: bool = True) -> str:
    """The line for a greedy run that left vanilla's tokens at new token `at`: a warning for our
    own configs on an exact export (only a float near-tie can do it), a note where it is expected
    (an int8-activation target, `OpenedExport.exact_speculation` False) or for another
    implementation."""
    msg = f"greedy mismatch: {c.name} differs from vanilla on prompt {prompt_id!r} at new token {at}"
    if c.kind == "ours" and exact:
        return "WARNING " + msg + " (only an fp near-tie can cause this: check it)"
    if c.kind == "ours":
        return "note: " + msg + " (expected here: the target's int8 activations verify inexactly)"
    who = "transformers" if c.kind == "hf" else "another implementation"
    return "note: " + msg + f" ({who}; fp differences possible)"


def make_decoders(models, configs: list[BenchConfig], sp):
    """Our configurations' decoders, every one sampling with `sp` (a SamplingParams)."""
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.decoder_config import DEFAULT_TREE
    from arborspec.runtime.drafts.tables import table_draft
    from arborspec.tools.engines import mixed_with_lookup

    decs = {}
    vocab = models.target.info.vocab_size
    mixed = None  # one mixed draft over the models' draft, shared by the --mix-tree configs
    for c in configs:
        if c.kind != "ours":
            continue
        draft = models.draft if c.mode != "vanilla" else None
        if c.draft == "lookup":
            from arborspec.runtime.drafts.lookup import LookupDraft

            draft = LookupDraft(vocab)
        elif c.draft == "mix":
            if mixed is None:
                mixed = mixed_with_lookup(models.draft, vocab, what="--mix-tree")
            draft = mixed
        elif c.draft == "suffix":
            draft = table_draft("suffix", None, vocab)
        elif c.draft == "suffix-mix":  # a suffix draft of its own per configuration
            draft = mixed_with_lookup(models.draft, vocab, None, what="--suffix-mix-tree", table="suffix")
        decs[c.name] = SpeculativeDecoder(
            models.target,
            draft,
            mode=c.mode,
            tree=c.tree or DEFAULT_TREE,
            candidates=c.candidates,
            sampling=sp,
            max_tree_nodes=models.limits.get("max_tree_nodes"),
            prefix_cache=False,  # cold requests: every run prefills its whole prompt, the draft reads it all again
            adaptive=c.adaptive,
        )
    return decs


def run_bench(
    models,
    configs: list[BenchConfig],
    prompts: list[dict],
    *,
    max_new_tokens: int,
    sampling=None,
    seed: int = 0,
    hf: HFBaselines | None = None,
    peers: dict | None = None,
    skipped: dict | None = None,
    warmup: int = 1,
    progress: bool = True,
    log=None,
    json_schema: dict | None = None,
    gbnf: str | None = None,
) -> tuple[list[dict], list[str]]:
    """Runs every config on every prompt -> (per_prompt list, warnings). `sampling`: a
    SamplingParams for ours, the baselines and the peers alike (None: greedy).

    `peers`: {config name: runner} for the ONNX Runtime GenAI / llama.cpp baselines
    (tools/bench/peers.py). A peer that fails while running is dropped with a one-line note
    (its reason goes into `skipped`), and the others go on."""
    from tqdm import tqdm

    from arborspec.runtime.sampling import SamplingParams

    sp = sampling or SamplingParams()
    # structured output (`bench --json-schema`): llama.cpp's own, the GBNF grammar it makes of the schema
    grammar = {"json_schema": json_schema} if json_schema is not None else {"gbnf": gbnf} if gbnf is not None else {}
    peers = dict(peers or {})
    runner = {c.name: (hf if c.kind == "hf" else peers.get(c.name)) for c in configs if c.kind != "ours"}
    bench = _BenchRun(
        decs=make_decoders(models, configs, sp),
        runner=runner,
        run_cfgs=[c for c in configs if c.kind == "ours" or runner.get(c.name) is not None],
        sp=sp,
        seed=seed,
        # the baselines and peers sample with the same cut
        peer_kw={"top_k": sp.top_k, "top_p": sp.top_p, **grammar},
        skipped=skipped if skipped is not None else {},
        log=log or (lambda s: print(s, file=sys.stderr)),
        exact=getattr(models, "exact_speculation", True),  # False: int8-activation target
    )
    if warmup and prompts:
        bench.warm_up(prompts[0]["ids"][-32:], warmup, max_new_tokens)
    tok = models.tokenizer
    eos = list(tok.meta.get("eos_token_ids") or []) if tok is not None else []
    warnings: list[str] = []
    per_prompt = []
    bar = tqdm(
        total=len(prompts) * len(bench.run_cfgs),
        desc="bench",
        unit="run",
        disable=None if progress else True,
        dynamic_ncols=True,
    )
    try:
        for p in prompts:
            runs = bench.run_prompt(p, max_new_tokens, eos, per_prompt, bar)
            warnings += bench.score(p, runs)
            entry = {"id": p["id"], "category": p["category"], "prompt_tokens": len(p["ids"]), "runs": runs}
            if tok is not None:
                entry["text"] = tok.decode(runs["vanilla"]["tokens"], skip_special_tokens=True)
            per_prompt.append(entry)
    finally:
        bar.close()
    return per_prompt, warnings


@dataclass
class _BenchRun:
    """One run_bench call: our decoders, the baselines' and peers' runners, the configs still
    running (a peer that fails leaves them), and how every run samples."""

    decs: dict  # config name -> our decoder
    runner: dict  # config name -> a baseline's or peer's runner
    run_cfgs: list  # the configs still running
    sp: Any  # SamplingParams
    seed: int
    peer_kw: dict  # what a baseline or peer runs with besides the sampling (top-k/p cut, grammar)
    skipped: dict  # config name -> why it left
    log: Callable
    exact: bool  # speculation reproduces vanilla (False: an int8-activation target)

    def _peer_failed(self, c, e) -> None:
        from arborspec.tools.bench.peers import _one_line

        reason = f"failed while running ({_one_line(e)})"
        self.skipped[c.name] = reason
        self.log(f"arborspec bench: note: {c.name} skipped: {reason}")
        self.run_cfgs.remove(c)

    def _run_other(self, c, ids, max_new_tokens: int, eos) -> dict | None:
        """A baseline's or peer's run; None where a peer failed (and left the bench)."""
        try:
            return self.runner[c.name].run(
                c.name, ids, max_new_tokens, eos, self.sp.temperature, self.seed, **self.peer_kw
            )
        except Exception as e:  # noqa: BLE001 - a peer's failure must not stop the bench
            if c.kind != "peer":
                raise
            self._peer_failed(c, e)
            return None

    def warm_up(self, w: list[int], times: int, max_new_tokens: int) -> None:
        for c in list(self.run_cfgs):
            for _ in range(times):
                if c.kind == "ours":
                    self.decs[c.name].generate(w, min(8, max_new_tokens), [], self.seed)
                elif self._run_other(c, w, min(4, max_new_tokens), []) is None:
                    break

    def run_prompt(self, p: dict, max_new_tokens: int, eos, per_prompt: list, bar) -> dict[str, dict]:
        """Every running config on prompt `p`: {config name: run}. A peer that fails here is
        dropped from the earlier prompts' runs too."""
        runs: dict[str, dict] = {}
        for c in list(self.run_cfgs):
            bar.set_postfix_str(f"{p['id']} | {c.name}", refresh=False)
            if c.kind == "ours":
                res = self.decs[c.name].generate(p["ids"], max_new_tokens, eos, self.seed)
                runs[c.name] = _our_run(res.stats, res.tokens, res.stop_reason)
            else:
                r = self._run_other(c, p["ids"], max_new_tokens, eos)
                if r is None:
                    for done in per_prompt:
                        done["runs"].pop(c.name, None)
                else:
                    runs[c.name] = r
            bar.update(1)
        return runs

    def score(self, p: dict, runs: dict[str, dict]) -> list[str]:
        """Speed-ups against vanilla and HF greedy; greedy: agreement with our vanilla's tokens
        (a mismatch is a warning, logged for ours)."""
        warnings = []
        van = runs["vanilla"]
        hfg = runs.get("hf-greedy")
        for c in self.run_cfgs:
            r = runs[c.name]
            r["speedup_vs_vanilla"] = _ratio(r["tokens_per_s"], van["tokens_per_s"])
            r["speedup_vs_hf_greedy"] = _ratio(r["tokens_per_s"], hfg["tokens_per_s"]) if hfg else None
            if self.sp.temperature > 0:
                r["greedy_match"] = None
                r["agree_prefix"] = None
                continue
            r["greedy_match"] = r["tokens"] == van["tokens"]
            # output quality: how many leading tokens equal our vanilla's
            r["agree_prefix"] = next(
                (j for j, (a, b) in enumerate(zip(r["tokens"], van["tokens"])) if a != b),
                min(len(r["tokens"]), len(van["tokens"])),
            )
            if not r["greedy_match"]:
                msg = mismatch_message(c, p["id"], r["agree_prefix"], self.exact)
                if c.kind == "ours":
                    self.log(msg)
                warnings.append(msg)
        return warnings
