"""`arborspec bench`: vanilla vs chain vs tree (and transformers', ONNX Runtime GenAI's and llama.cpp's alternatives) on the same prompts.

Role: opens the engines once (tools/engines.py), runs every configuration on every prompt in one
process (tools/bench/decoding.py), prints the aggregate table, and optionally writes the JSON results and
a figure. Tree specs contain commas, so `--tree` is given once per spec and/or as one
';'-separated list: `--tree full:3,2 --tree beam:4,8,8` == `--tree 'full:3,2;beam:4,8,8'`.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import atomic_write_json
from arborspec.tools.commands.cli import (
    TREE_HELP,
    add_format_args,
    response_format_from_args,
    with_response_format,
)
from arborspec.tools.commands.options import (
    add_json_output_args,
    add_quiet_progress_args,
    add_seed_arg,
    command_parser,
)
from arborspec.tools.engines import add_model_args, models_key, open_models, resolved_config

EXAMPLE = """examples:
  arborspec bench --model smollm2-135m --draft layers:4 --modes vanilla,chain,tree \\
      --chain chain:4 --tree 'full:3,2;beam:4,8,8;dynamic:4,4,16' --limit-prompts 8 \\
      --max-new-tokens 64 --baselines hf-greedy,hf-assisted,hf-lookup \\
      --json-out benchmarks/smollm2_cpu_torch.json --plot benchmarks/smollm2_cpu_torch.png
  arborspec bench --export-dir ~/.cache/arborspec/exports/smollm2 --backend onnxruntime \\
      --tree full:3,2 --tree dynamic:4,4,16 --limit-prompts 4
  arborspec bench --export-dir ~/.cache/arborspec/exports/smollm2 --backend onnxruntime --temperature 0.8 \\
      --chain chain:3 --tree 'full:2,2' --candidates topk,sample-unique --limit-prompts 8
  arborspec bench --export-dir ~/.cache/arborspec/exports/smollm2 --temperature 0.8 --top-p 0.95 \\
      --tree auto --mix-tree auto --limit-prompts 8     # a serving configuration's sampling
  arborspec bench --quality --export-dir out/int4 --reference-export-dir out/fp32 --limit-prompts 8 \\
      --baselines llama-cpp
  arborspec bench --export-dir ~/.cache/arborspec/exports/smollm2 --backend onnxruntime --modes vanilla \\
      --baselines ort-genai,ort-genai-int4,llama-cpp,llama-cpp-lookup --limit-prompts 8 --max-new-tokens 64
  arborspec bench --export-dir ~/.cache/arborspec/exports/smollm2-int4 --modes vanilla,tree --tree auto \\
      --baselines llama-server,llama-server-ngram-mod,llama-server-eagle3 --max-new-tokens 128
  arborspec bench --export-dir ~/.cache/arborspec/exports/smollm2-int4 --modes vanilla \\
      --baselines llama-server-repack-on,llama-server-repack-off,openvino,openvino-lookup
baselines: hf-greedy, hf-assisted, hf-lookup (transformers; pip install 'arborspec[bench]');
ort-genai, ort-genai-int4 (ONNX Runtime GenAI, a model its builder makes from the export's source,
cached in ~/.cache/arborspec/peers), ort-genai-ngram, ort-genai-int4-ngram (the same with GenAI's
n-gram speculation), llama-cpp, llama-cpp-lookup (llama-cpp-python on the source GGUF, plain and
with its prompt-lookup draft): pip install 'arborspec[peers]'. llama-server, llama-server-ngram-mod,
llama-server-ngram-simple, llama-server-ngram-map-k (llama.cpp's own server and n-gram speculation),
llama-server-eagle3, llama-server-eagle3-n2 (its draft-eagle3 with the export's head, converted by
llama.cpp's converter; 3 / 2 drafted tokens): built once from llama-cpp-python's sdist into
~/.cache/arborspec/llama.cpp (or $ARBORSPEC_LLAMA_CPP: a llama.cpp tree built into build/bin); each
also as NAME-repack-on / NAME-repack-off (weight repacking forced on / off, e.g.
llama-server-repack-off). openvino, openvino-lookup (OpenVINO GenAI on the same GGUF, plain and with
its prompt lookup; greedy): pip install 'arborspec[openvino]'.
At --temperature T > 0 llama.cpp and
transformers sample at T with the same --top-k / --top-p cut as ours (no min-p); GenAI runs greedy only. With --quality, --baselines llama-cpp
adds llama.cpp's perplexity and greedy agreement on the same GGUF and token ids. A baseline that is not installed
or cannot run is skipped with one line saying why (and its reason in the JSON's meta.skipped).
prompts file: {"prompts": [{"id", "category", "text" (+ "chat": true, "system") | "ids": [int]}]}
(default: the packaged arborspec/tools/data/prompts.json; --limit-prompts N takes N prompts
round-robin over the categories)."""


def register(sub) -> None:
    p = command_parser(
        sub, "bench", "benchmark vanilla / chain / tree decoding, HF, GenAI and llama.cpp baselines", __doc__, EXAMPLE
    )
    add_model_args(p)  # --draft default: layers:4 with --model; the export's with --export-dir
    g = p.add_argument_group("configurations")
    _add_configuration_args(g)
    r = p.add_argument_group("run")
    _add_run_args(r)
    qa = p.add_argument_group("quality (instead of speed)")
    _add_quality_args(qa)
    o = p.add_argument_group("output")
    add_json_output_args(o, " (the table then goes to stderr)")
    o.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="write the figure (PNG)")
    p.set_defaults(run=run)


def _add_configuration_args(g) -> None:
    """What runs: the modes, their trees, the lookup and mixed drafts, the baselines."""
    g.add_argument(
        "--modes",
        default="vanilla,chain,tree",
        help="comma-separated subset of vanilla,chain,tree (vanilla always runs: the reference)",
    )
    g.add_argument(
        "--tree",
        action="append",
        default=None,
        metavar="SPEC",
        help=TREE_HELP + "; repeat the flag or separate specs with ';' to run several",
    )
    g.add_argument("--chain", default="chain:4", help="chain mode spec (default chain:4)")
    g.add_argument(
        "--lookup-tree",
        action="append",
        default=None,
        metavar="SPEC",
        help="also run the n-gram lookup draft with this tree, in the same run (repeatable; e.g. to "
        "put an EAGLE-3 or model draft next to lookup; auto: the tree `tune --draft lookup` chose)",
    )
    g.add_argument(
        "--mix-tree",
        action="append",
        default=None,
        metavar="SPEC",
        help="also run the models' draft mixed with the lookup draft (as --draft BASE+lookup) with "
        "this tree, in the same run (repeatable)",
    )
    g.add_argument(
        "--suffix-tree",
        action="append",
        default=None,
        metavar="SPEC",
        help="also run the suffix draft alone (as --draft suffix) on this tree, which its own proposals "
        "widen, in the same run (repeatable)",
    )
    g.add_argument(
        "--suffix-mix-tree",
        action="append",
        default=None,
        metavar="SPEC",
        help="also run the models' draft mixed with the suffix draft (as --draft BASE+suffix) with this "
        "tree, in the same run (repeatable; auto: the models' draft's tuned tree)",
    )
    g.add_argument(
        "--governed",
        action="store_true",
        help="run each speculative configuration of ours twice, side by side: ungoverned, and governed "
        "as NAME~governed (the decoder holds its tree where it measures it not paying: "
        "ARBORSPEC_ADAPTIVE, docs/drafts-and-trees.md)",
    )
    g.add_argument(
        "--baselines",
        default="",
        help="comma-separated baselines on the same model file (torch backend, or an export whose "
        "manifest names the source): hf-greedy,hf-assisted,hf-lookup (transformers), "
        "ort-genai,ort-genai-int4,ort-genai-ngram,ort-genai-int4-ngram (ONNX Runtime GenAI), "
        "llama-cpp,llama-cpp-lookup (llama-cpp-python; needs a GGUF source), "
        "llama-server,llama-server-ngram-mod,llama-server-ngram-simple,llama-server-ngram-map-k,"
        "llama-server-eagle3,llama-server-eagle3-n2 (llama.cpp's own server; GGUF source; each also "
        "NAME-repack-on / NAME-repack-off), openvino,openvino-lookup (OpenVINO GenAI; GGUF source)",
    )
    g.add_argument(
        "--hf-assistant-layers",
        type=int,
        default=None,
        help="hf-assisted: assistant = the target's first K layers (default: K of --draft layers:K, else 4)",
    )
    g.add_argument(
        "--hf-lookup-tokens",
        type=int,
        default=10,
        help="draft length of the lookup baselines: hf-lookup's prompt_lookup_num_tokens, "
        "llama-cpp-lookup's num_pred_tokens, *-ngram's max_draft_tokens (at most 16) (10)",
    )


def _add_run_args(r) -> None:
    """How each configuration runs: prompts, tokens, sampling, structured output, threads, warm-up."""
    r.add_argument("--prompts", type=Path, default=None, help="prompts JSON file (default: the packaged set)")
    r.add_argument("--limit-prompts", type=int, default=None, help="use N prompts (round-robin over categories)")
    r.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; checks greedy_match)")
    r.add_argument("--top-k", type=int, default=0, help="with --temperature: sample from the K most likely (0: all)")
    r.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass (1.0: off)")
    add_seed_arg(r)
    add_format_args(r)  # structured output: ours and llama.cpp's own (its grammar of the schema)
    r.add_argument(
        "--candidates",
        default=None,
        metavar="MODE[,MODE]",
        help="how draft children are chosen when sampling: topk, sample, sample-unique; several run "
        "side by side, the first unnamed, the others as SPEC@MODE (dynamic and beam trees: topk only) "
        "(default: what `tune --temperature` chose for --tree auto, else topk)",
    )
    r.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    r.add_argument(
        "--peer-threads",
        type=int,
        default=None,
        metavar="N",
        help="threads of the GenAI / llama.cpp / llama-server baselines (default: the cores this process may use)",
    )
    r.add_argument("--warmup", type=int, default=1, help="warm-up generations per config before timing (1)")
    add_quiet_progress_args(r)


def _add_quality_args(qa) -> None:
    """--quality: perplexity and greedy agreement instead of speed."""
    qa.add_argument(
        "--quality",
        action="store_true",
        help="measure output quality instead of speed: perplexity of held-out text through the "
        "export's ONNX Runtime engine, and greedy token agreement with --reference-export-dir "
        "over the prompts (needs --export-dir); --baselines llama-cpp adds llama.cpp on the source GGUF",
    )
    qa.add_argument(
        "--reference-export-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="--quality: the fp32 export of the same model (perplexity delta and greedy agreement are against it)",
    )
    qa.add_argument(
        "--quality-text",
        type=Path,
        default=None,
        metavar="FILE",
        help="--quality: a UTF-8 text file (default: the packaged held-out text, arborspec/tools/data/heldout.txt)",
    )
    qa.add_argument(
        "--quality-window",
        type=int,
        default=256,
        metavar="N",
        help="--quality: perplexity windows of N tokens, each from an empty cache (default 256)",
    )
    qa.add_argument(
        "--quality-chunk",
        type=int,
        default=64,
        metavar="N",
        help="--quality: tokens per engine call inside a window (default 64)",
    )


def _command_line(args) -> str:
    parts = ["arborspec", "bench"]
    skip = {"run", "command", "no_progress"}
    for k, v in vars(args).items():
        if k in skip or v is None or v is False or v == "":
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            parts.append(flag)
        elif isinstance(v, list):
            for x in v:
                parts += [flag, str(x)]
        else:
            parts += [flag, str(v)]
    return shlex.join(parts)


def _check_args(args) -> None:
    """One line for a bad number or --plot path, before anything loads."""
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit_prompts is not None and args.limit_prompts < 1:
        raise InputError(f"--limit-prompts must be >= 1, got {args.limit_prompts}")
    if args.temperature < 0:
        raise InputError(f"--temperature must be >= 0, got {args.temperature}")
    if args.threads < 1:
        raise InputError(f"--threads must be >= 1, got {args.threads}")
    if args.peer_threads is not None and args.peer_threads < 1:
        raise InputError(f"--peer-threads must be >= 1, got {args.peer_threads}")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise InputError(f"--plot writes a PNG: give a .png path, got {args.plot}")


@dataclasses.dataclass
class BenchPlan:
    """What a speed bench's flags ask for, checked before the models load (`_plan`)."""

    modes: list[str]
    candidates: list  # None: each tree's own (what `tune --temperature` chose for --tree auto), else topk
    sampling: object  # SamplingParams (with the response format's grammar once the models are open)
    response_format: dict | None
    target: tuple | None  # schema_of(response_format): ("json", schema), ("grammar", text), ... or None
    gbnf: str | None  # a GBNF grammar llama.cpp reads, else None
    baselines: list[str]
    trees: list[str]
    lookup_trees: list[str]
    mix_trees: list[str]
    suffix_trees: tuple  # (suffix alone, the models' draft + suffix): tree specs
    entries: list
    prompts_path: str | None

    @property
    def need_draft(self) -> bool:
        return any(m != "vanilla" for m in self.modes) or bool(self.mix_trees) or bool(self.suffix_trees[1])


def _plan(args) -> BenchPlan:
    """The flags as a BenchPlan: one line for a bad mode, tree, sampling flag, schema or prompts
    file before the models load (`auto` trees stand for the tuned tree, resolved once they are)."""
    from arborspec.runtime.decoder_config import DEFAULT_TREE
    from arborspec.runtime.sampling import SamplingParams  # (torch: not at import, --help stays light)
    from arborspec.runtime.structured import schema_of
    from arborspec.tools import prompts as prompt_sets
    from arborspec.tools.bench import decoding as bench

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    candidates = [m.strip() for m in args.candidates.split(",") if m.strip()] if args.candidates else [None]
    if args.temperature == 0 and candidates not in (["topk"], [None]):
        raise InputError("--candidates needs --temperature > 0 (greedy decoding takes each draft's top candidates)")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)  # one error line for a bad value
    response_format = response_format_from_args(args)
    target = schema_of(response_format)  # ("json", schema) or None: a malformed one before the models load
    gbnf = target[1] if target is not None and target[0] == "grammar" and "::=" in target[1] else None
    if args.temperature == 0 and (args.top_k or args.top_p < 1.0):
        raise InputError("--top-k and --top-p need --temperature > 0 (greedy decoding takes the most likely token)")
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    trees = bench.split_tree_specs(args.tree)
    entries, prompts_path = prompt_sets.read_prompts_file(args.prompts)  # cheap checks before loading models
    lookup_trees = bench.split_tree_specs(args.lookup_tree)
    mix_trees = bench.split_tree_specs(args.mix_tree)
    suffix_trees = (bench.split_tree_specs(args.suffix_tree), bench.split_tree_specs(args.suffix_mix_tree))
    untuned = lambda specs: [(DEFAULT_TREE if t.lower() == "auto" else t) for t in specs]  # noqa: E731
    # the specs checked now (the export default tree is filled in once the models are open)
    bench.build_configs(
        modes,
        untuned(trees) or [DEFAULT_TREE],
        args.chain,
        baselines,
        untuned(lookup_trees),
        untuned(mix_trees),
        candidates,
        tuple(untuned(t) for t in suffix_trees),
    )
    return BenchPlan(
        modes,
        candidates,
        sampling,
        response_format,
        target,
        gbnf,
        baselines,
        trees,
        lookup_trees,
        mix_trees,
        suffix_trees,
        entries,
        prompts_path,
    )


def run(args) -> int:
    import torch

    from arborspec.tools.bench import decoding as bench
    from arborspec.tools.bench import report as bench_report

    _check_args(args)
    if args.quality:
        return _run_quality(args)
    if args.reference_export_dir is not None:
        raise InputError("--reference-export-dir is for --quality")
    plan = _plan(args)
    torch.set_num_threads(args.threads)
    if args.draft is None and args.export_dir is None:
        args.draft = "layers:4"
    models = open_models(args, need_draft=plan.need_draft)
    with models:  # closes the engines it opened
        if plan.need_draft and models.draft is None:
            raise InputError("modes chain/tree need a draft: give --draft layers:K|bigram|MODEL (or --modes vanilla)")
        configs = _configs(args, plan, models)
        notes: list[str] = []
        prompts = _fitting_prompts(args, plan.entries, models, notes)
        source = _source_of(args, models)
        skipped: dict[str, str] = {}
        if plan.target is not None:  # structured output: ours, and the peers that have their own
            configs = _without_structured_output(plan, models, configs, skipped)
        hf, configs = _open_hf_baselines(args, plan.baselines, source, configs, skipped, notes)
        peers, peer_info, configs = _open_peer_baselines(
            args, plan.baselines, source, models, prompts, configs, skipped
        )
        load_before = bench_report.machine(args.device).get("loadavg_1_5_15")
        try:
            per_prompt, warnings = bench.run_bench(
                models,
                configs,
                prompts,
                max_new_tokens=args.max_new_tokens,
                sampling=plan.sampling,
                seed=args.seed,
                hf=hf,
                peers=peers,
                skipped=skipped,
                warmup=args.warmup,
                progress=not args.no_progress,
                json_schema=plan.target[1] if plan.target is not None and plan.target[0] == "json" else None,
                gbnf=plan.gbnf,
            )
        finally:  # the peers' own processes (llama-server) stop here
            for r in peers.values():
                if hasattr(r, "close"):
                    r.close()
        configs = [c for c in configs if c.kind == "ours" or c.name not in skipped]  # peers that failed mid-run
        skip_notes = [f"{n} skipped: {why}" for n, why in skipped.items()]  # printed once, when it happened
        meta = _meta(args, plan, models, source, load_before)
        meta.update(notes=notes + skip_notes + warnings, peers=peer_info, skipped=skipped)
        results = {
            "schema_version": bench_report.SCHEMA_VERSION,
            "meta": meta,
            "configs": [c.to_dict() for c in configs],
            "per_prompt": per_prompt,
            "aggregate": bench_report.aggregate(per_prompt, configs),
        }
        _report(args, results, notes)
        return 0


def _configs(args, plan: BenchPlan, models) -> list:
    """The configurations to run, their `auto` trees resolved for these models (and no --tree:
    as generate and serve, the tree `tune` chose for them, else the export's)."""
    from arborspec.runtime.decoder_config import DecoderConfig
    from arborspec.tools.bench import decoding as bench

    def resolved(tree, key):  # above temperature 0: the trees tuned for sampling, where `tune --temperature` wrote them
        return resolved_config(models, args, DecoderConfig(mode="tree", tree=tree), key).tree

    key = models_key(args)
    trees = [resolved(t, key) for t in plan.trees] or [resolved(None, key)]
    # `auto` for the mixed draft: the tree tuned for it (tune --draft BASE+lookup)
    mix_key = dataclasses.replace(key, draft=f"{args.draft or 'export'}+lookup")
    mix_trees = [resolved(t, mix_key) for t in plan.mix_trees]
    lookup_trees = [resolved(t, dataclasses.replace(key, draft="lookup")) for t in plan.lookup_trees]
    # `auto` with the suffix draft: the tuned tree of what it is added to (runtime/tuned_tree.py)
    suffix_keys = (
        dataclasses.replace(key, draft="suffix"),
        dataclasses.replace(key, draft=f"{args.draft or 'export'}+suffix"),
    )
    suffix_trees = tuple([resolved(t, k) for t in specs] for k, specs in zip(suffix_keys, plan.suffix_trees))
    configs = bench.build_configs(
        plan.modes, trees, args.chain, plan.baselines, lookup_trees, mix_trees, plan.candidates, suffix_trees
    )
    return bench.with_governed(configs) if args.governed else configs


def _fitting_prompts(args, entries, models, notes: list[str]) -> list[dict]:
    """The selected prompts, encoded, that fit the context with --max-new-tokens (a note for each
    one that does not; one line when none does)."""
    from arborspec.tools import prompts as prompt_sets

    prompts = prompt_sets.encode_prompts(prompt_sets.select_prompts(entries, args.limit_prompts), models.tokenizer)
    limit = min(x for x in (models.limits.get("max_context"), models.target.info.max_position) if x)
    kept = [p for p in prompts if len(p["ids"]) + args.max_new_tokens <= limit]
    for p in prompts:
        if p not in kept:
            notes.append(
                f"prompt {p['id']} skipped: {len(p['ids'])} tokens + {args.max_new_tokens} new exceed "
                f"the context limit of {limit}"
            )
    if not kept:
        raise InputError(
            f"no prompt fits the context limit of {limit} tokens with --max-new-tokens {args.max_new_tokens}"
        )
    return kept


def _source_of(args, models) -> dict:
    """The model file the baselines run on: an export manifest's `source`, else the models' own."""
    source = dict(getattr(models, "source", None) or {})  # (an export folder's: read below)
    if args.export_dir is not None:
        try:
            from arborspec.runtime.export_dir import read_manifest

            source = dict(read_manifest(args.export_dir).data.get("source") or {})
        except (KeyError, ValueError, FileNotFoundError, TypeError):
            source = {}
    return source


def _skip(skipped: dict[str, str], name: str, why: str) -> None:
    skipped[name] = why
    print(f"arborspec bench: note: {name} skipped: {why}", file=sys.stderr)


def _without_structured_output(plan: BenchPlan, models, configs: list, skipped: dict[str, str]) -> list:
    """With a response format: the grammar in plan.sampling, and the baselines that have no
    structured output here (transformers', GenAI's; llama.cpp's for what it does not read)
    skipped, out of plan.baselines and the configurations returned."""
    from arborspec.tools.bench import baselines as bench_baselines

    plan.sampling = with_response_format(plan.sampling, plan.response_format, models)
    without = [b for b in plan.baselines if b in bench_baselines.BASELINES or b.startswith(("ort-genai", "openvino"))]
    for n in without:
        _skip(skipped, n, "no structured output in this baseline here (llama.cpp's runs with its own grammar)")
    if plan.target[0] not in ("json", "grammar") or (plan.target[0] == "grammar" and plan.gbnf is None):
        # llama.cpp takes JSON schemas and GBNF grammars; a regex, a choice or a Lark grammar
        # has no form it reads here
        for n in [b for b in plan.baselines if b.startswith("llama-cpp")]:
            _skip(skipped, n, "llama.cpp reads JSON schemas and GBNF grammars, not this grammar")
            without.append(n)
    plan.baselines = [b for b in plan.baselines if b not in without]
    return [c for c in configs if c.name not in without]


def _open_hf_baselines(args, baselines: list[str], source: dict, configs: list, skipped: dict, notes: list):
    """(the transformers baselines or None, the configurations left): skipped with one line when
    the source has no transformers model."""
    from arborspec.tools.bench import baselines as bench_baselines

    hf_names = [b for b in baselines if b in bench_baselines.BASELINES]
    if not hf_names:
        return None, configs
    mdir, gguf, why = bench_baselines.hf_source_path(source)
    if mdir is None:
        skipped.update({n: why for n in hf_names})
        print(f"arborspec bench: note: HF baselines skipped: {why}", file=sys.stderr)
        return None, [c for c in configs if c.kind != "hf"]
    k = args.hf_assistant_layers
    if k is None:
        from arborspec.runtime.drafts.spec import parse_draft_spec

        ds = parse_draft_spec(args.draft)
        k = ds.arg if ds.kind == "layers" else 4
    if not args.no_progress:
        print(f"loading the transformers baselines from {mdir / gguf if gguf else mdir} ...", file=sys.stderr)
    hf = bench_baselines.HFBaselines(mdir, gguf, k, "hf-assisted" in baselines, args.hf_lookup_tokens)
    notes.append(
        f"transformers model loaded in {hf.load_s:.1f} s"
        + (f"; hf-assisted assistant = its first {k} layers" if "hf-assisted" in baselines else "")
    )
    return hf, configs


def _open_peer_baselines(args, baselines: list[str], source: dict, models, prompts, configs: list, skipped: dict):
    """(the GenAI / llama.cpp runners, their info, the configurations left): one that cannot
    open is skipped with one line, and the bench goes on without it."""
    from arborspec.tools.bench import peers as bench_peers

    peer_names = [b for b in baselines if b in bench_peers.PEERS]
    if not peer_names:
        return {}, {}, configs
    eos = list(models.tokenizer.meta.get("eos_token_ids") or []) if models.tokenizer is not None else []
    n_ctx = max(len(p["ids"]) for p in prompts) + args.max_new_tokens + 16
    peers, peer_info, peer_skips = bench_peers.open_peers(
        peer_names,
        source,
        eos=eos,
        n_ctx=n_ctx,
        lookup_tokens=args.hf_lookup_tokens,
        temperature=args.temperature,
        head_dir=_eagle3_head_dir(args, source),
        threads=args.peer_threads,
    )
    for n, why in peer_skips.items():  # one line each, and the bench goes on without it
        _skip(skipped, n, why)
    return peers, peer_info, [c for c in configs if c.kind != "peer" or c.name in peers]


def _meta(args, plan: BenchPlan, models, source: dict, load_before) -> dict:
    """The results' `meta` up to its notes: machine, models, versions, the command and its sampling."""
    from arborspec.tools.bench import report as bench_report

    return {
        "machine": bench_report.machine(args.device) | {"loadavg_before": load_before},
        "backend": args.backend or ("torch" if args.model else "onnxruntime"),
        "model": str(args.model or args.export_dir),
        "draft": _draft_name(args, models),
        "describe": models.describe,
        # ONNX Runtime threads: "shared" (one pool for every session), "session" (a pool each)
        "ort_thread_pool": getattr(models.target, "thread_pool", None),
        "exact_speculation": getattr(models, "exact_speculation", True),
        "source": {k: v for k, v in source.items() if k != "files"},
        "versions": bench_report.versions(),
        "command": _command_line(args),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("run",)},
        "date": bench_report.now_iso(),
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "response_format": plan.response_format,
        "prompts_file": plan.prompts_path,
    }


def _report(args, results: dict, notes: list[str]) -> None:
    """The table (stderr with --json), the greedy-mismatch warning, the notes, the JSON and the figure."""
    from arborspec.tools.bench import report as bench_report

    print(bench_report.format_table(results), file=sys.stderr if args.json else sys.stdout)
    if results["aggregate"]["greedy_match"] is False:
        print(
            "WARNING: greedy_match is FALSE: some configuration's tokens differ from vanilla's "
            "(see the warnings above)",
            file=sys.stderr,
        )
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    _write_json(args, results)
    if args.plot is not None:
        bench_report.plot(results, args.plot)


def _write_json(args, results: dict) -> None:
    """--json: the results on stdout; --json-out FILE: written there (atomically)."""
    if args.json:
        print(json.dumps(results))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json_out, results, indent=1)


def _eagle3_head_dir(args, source: dict) -> Path | None:
    """The draft's EAGLE-3 checkpoint folder (llama-server-eagle3 converts it), else None."""
    from arborspec.models.eagle3 import eagle3_folder

    spec = args.draft
    if args.export_dir is not None:
        try:
            from arborspec.runtime.export_dir import read_manifest

            d = read_manifest(args.export_dir).draft or {}
        except Exception:  # noqa: BLE001 - no head: llama-server-eagle3 is skipped with its line
            return None
        spec = (d.get("spec") or "eagle3") if d.get("kind") == "eagle3" else None
    if not spec or not str(spec).startswith("eagle3") or "+" in str(spec):
        return None
    try:
        return eagle3_folder(str(spec), source.get("name") or source.get("model") or args.model)
    except InputError:
        return None


def _draft_name(args, models) -> str | None:
    if args.export_dir is not None:
        try:
            from arborspec.runtime.export_dir import read_manifest

            d = read_manifest(args.export_dir).draft
            return d.get("spec") or d.get("kind")
        except Exception:  # noqa: BLE001 - informational only
            return "export"
    return args.draft


def _run_quality(args) -> int:
    """`bench --quality`: perplexity + greedy agreement table (tools/bench/quality.py)."""
    import torch

    from arborspec.runtime.export_dir import load_tokenizer, read_manifest
    from arborspec.tools import prompts as prompt_sets
    from arborspec.tools.bench import peers as bench_peers
    from arborspec.tools.bench import quality

    if args.export_dir is None:
        raise InputError(
            "--quality measures an export: give --export-dir DIR (and --reference-export-dir for the fp32 export)"
        )
    if args.model is not None:
        raise InputError("--quality reads export folders through ONNX Runtime: use --export-dir, not --model")
    if args.backend not in (None, "onnxruntime"):
        raise InputError(f"--quality runs on the onnxruntime backend, not {args.backend}")
    if args.quality_window < 2 or args.quality_chunk < 1:
        raise InputError("--quality-window must be >= 2 and --quality-chunk >= 1")
    text = quality.heldout_text(args.quality_text)
    torch.set_num_threads(args.threads)
    prompts = None
    if args.reference_export_dir is not None:
        man = read_manifest(args.export_dir)
        tok = load_tokenizer(man)
        if tok is None:
            raise InputError(f"{args.export_dir}: the export has no tokenizer (needed for the text)")
        entries, _ = prompt_sets.read_prompts_file(args.prompts)
        enc = prompt_sets.encode_prompts(prompt_sets.select_prompts(entries, args.limit_prompts), tok)
        limit = int(man.limits.get("max_context") or 0) or None
        prompts = [p["ids"] for p in enc if limit is None or len(p["ids"]) + args.max_new_tokens <= limit]
        if not prompts:
            raise InputError(
                f"no prompt fits the context limit of {limit} tokens with --max-new-tokens {args.max_new_tokens}"
            )
    gguf = _quality_gguf(args)
    try:
        rows = quality.run_quality(
            args.export_dir,
            args.reference_export_dir,
            prompts,
            text=text,
            window=args.quality_window,
            chunk=args.quality_chunk,
            max_new_tokens=args.max_new_tokens,
            llama_cpp_gguf=gguf,
        )
    except bench_peers.PeerUnavailable as e:
        raise InputError(f"--quality --baselines llama-cpp: {e}") from None
    out = sys.stderr if args.json else sys.stdout
    print(quality.quality_table(rows), file=out)
    n = rows[-1]["tokens"]
    print(
        f"perplexity over {n} tokens of {'the packaged held-out text' if args.quality_text is None else args.quality_text}"
        f" (windows of {args.quality_window}, calls of {args.quality_chunk} tokens)"
        + (
            f"; greedy agreement: tokens equal to the reference's before the first divergence, "
            f"{len(prompts)} prompts x {args.max_new_tokens} new tokens"
            if prompts
            else ""
        ),
        file=out,
    )
    if gguf is not None:
        ours = next(r for r in rows if not r["reference"] and not r["export"].startswith("llama.cpp"))
        lc = rows[-1]
        print(
            f"perplexity of {ours['export']} vs llama.cpp on {gguf.name}: "
            f"{100.0 * (ours['perplexity'] - lc['perplexity']) / lc['perplexity']:+.2f} %",
            file=out,
        )
    _write_json(args, {"quality": rows, "command": _command_line(args)})
    return 0


def _quality_gguf(args):
    """`bench --quality --baselines llama-cpp`: the GGUF the export was made from (else None)."""
    from arborspec.runtime.export_dir import read_manifest
    from arborspec.tools.bench import baselines as bench_baselines

    wanted = [b.strip() for b in (args.baselines or "").split(",") if b.strip()]
    if not wanted:
        return None
    if wanted != ["llama-cpp"]:
        raise InputError(
            "--quality takes --baselines llama-cpp only (perplexity and agreement of llama.cpp on the GGUF)"
        )
    source = dict(read_manifest(args.export_dir).data.get("source") or {})
    mdir, gguf, why = bench_baselines.hf_source_path(source)
    if mdir is None:
        raise InputError(f"--baselines llama-cpp: {why}")
    if not gguf:
        raise InputError(f"--baselines llama-cpp needs a GGUF source; this export came from {mdir}")
    return mdir / gguf
