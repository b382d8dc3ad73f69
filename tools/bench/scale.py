"""Where trees pay, by model size: export cost, vanilla speed beside llama.cpp, the verify cost
curve and the tree the tuner picks, for SmolLM2-135M and random 1B / 3B / 8B Llama shapes.

Role in one decode step: none; it prices the step's parts at sizes users deploy. The verify cost
curve c(T) is one target call over T new tokens after P cached ones; the tree is the one
tools/tune/tree_dp.choose_tree picks from that curve and the shipped SmolLM2 head's measured
acceptance profile (random weights accept nothing of their own: their text is noise). The head's
cost at a size is measured on a random EAGLE-3 head of that size's layout when one is given, else
the SmolLM2 head's measured cost scaled by the heads' weight bytes (said in the table).
Run by benchmarks/scale.py.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SIZES_T = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Measured:
    """One command's wall time and peak resident memory (`/usr/bin/time -v`)."""

    rc: int
    seconds: float
    peak_gb: float
    tail: str = ""


def timed(cmd: list[str], log: Path, env=None) -> Measured:
    """Run `cmd` under /usr/bin/time -v; its output to `log`."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(["/usr/bin/time", "-v", *map(str, cmd)], stdout=f, stderr=subprocess.STDOUT, env=env)
    text = log.read_text(errors="replace")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    peak = int(m.group(1)) / 1024**2 if m else float("nan")
    return Measured(p.returncode, time.perf_counter() - t0, peak, text[-400:] if p.returncode else "")


# -- llama.cpp's side ------------------------------------------------------------------------
def llama_gguf(hf_folder: Path, work: Path, tools, qtype: str = "Q4_0", log=print) -> Path:
    """The checkpoint as llama.cpp runs it: its converter to f16, its quantiser to `qtype` (cached)."""
    out = work / f"{hf_folder.name}-{qtype.lower()}.gguf"
    if out.is_file():
        return out
    f16 = work / f"{hf_folder.name}-f16.gguf"
    if not f16.is_file():
        log(f"llama.cpp converter: {hf_folder.name} -> f16 GGUF")
        env = {"PYTHONPATH": str(tools.root / "gguf-py"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
        import sys

        subprocess.run([sys.executable, str(tools.converter), str(hf_folder), "--outtype", "f16", "--outfile", str(f16)],
                       check=True, env=env, capture_output=True)  # fmt: skip
    log(f"llama-quantize: f16 -> {qtype}")
    subprocess.run([str(tools.quantize), str(f16), str(out), qtype], check=True, capture_output=True)
    f16.unlink()  # as large as the checkpoint
    return out


def llama_bench(
    tools,
    gguf: Path,
    prompt: int,
    gen: int,
    depth: int = 0,
    reps: int = 3,
    threads: int = 2,
    repack: bool | None = None,
) -> dict:
    """llama-bench's tokens/s (avg, and per repetition) for one test. repack None: weight repacking
    on, off where it dies (a build with AMX kernels on a VM that advertises AMX without granting it:
    tools/bench/llama_server.py); True / False: as asked (the faster of the two is the peer's best)."""
    base = [str(tools.bench), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
            "-t", str(threads), "-r", str(reps), "-o", "json"]  # fmt: skip
    for repack in ("1", "0") if repack is None else ("1" if repack else "0",):
        p = subprocess.run([*base, "--repack", repack], capture_output=True, text=True)
        if p.returncode == 0:
            row = json.loads(p.stdout)[0]
            return {"tokens_per_s": row["avg_ts"], "samples_ts": row.get("samples_ts"), "repack": repack == "1"}
    raise RuntimeError(f"llama-bench failed: {p.stderr.strip().splitlines()[-1:]}")


# -- our side ----------------------------------------------------------------------------------
def our_vanilla(export_dir: Path, prompt_len: int = 64, new_tokens: int = 32, reps: int = 3) -> dict:
    """Greedy vanilla decode tokens/s through the embedding API (prefill excluded), median of reps."""
    import arborspec

    arborspec.enable_shared_pool()
    rates, ttft = [], []
    with arborspec.Generator.from_export(str(export_dir), draft="none", mode="vanilla") as gen:
        ids = [(17 * i + 5) % 40000 + 100 for i in range(prompt_len)]
        for r in range(reps + 1):
            c = gen.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
            if r:  # the first call warms up
                rates.append(c.stats.tokens_per_s)
                ttft.append(c.stats.prefill_s)
    return {"tokens_per_s": statistics.median(rates), "samples": rates, "prefill_s": statistics.median(ttft)}


def verify_curve(export_dir: Path, past: int, sizes=SIZES_T, reps: int = 3) -> dict:
    """{T: ms} of one target call over T new tokens after `past` cached positions, the engine
    opened as the decoder opens it (open_export: the row-invariant layout where the export needs
    it) and timed beside the decoder's host threads (cost_curves.decoder_threads)."""
    from arborspec.runtime.export_dir import OpenOptions, open_export
    from arborspec.tools.tune.cost_curves import engine_cost_curve

    ex = open_export(export_dir, "onnxruntime", "cpu", OpenOptions(draft="none", load_tok=False))
    try:
        return engine_cost_curve(ex.target, list(sizes), past=past, reps=reps)
    finally:
        ex.close()


def tree_equals_vanilla(export_dir: Path, tree: str, new_tokens: int = 16, prompt_len: int = 32) -> dict:
    """Greedy decoding with the export's own draft on `tree` against vanilla: the same tokens?"""
    import arborspec

    arborspec.enable_shared_pool()
    ids = [(31 * i + 7) % 40000 + 100 for i in range(prompt_len)]
    out = {}
    for mode, kw in (("vanilla", {"draft": "none", "mode": "vanilla"}), ("tree", {"tree": tree, "mode": "tree"})):
        with arborspec.Generator.from_export(str(export_dir), **kw) as gen:
            c = gen.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
            out[mode] = {"tokens": list(c.tokens), "tokens_per_s": c.stats.tokens_per_s,
                         "mean_accepted": c.stats.mean_accepted}  # fmt: skip
    out["identical"] = out["vanilla"]["tokens"] == out["tree"]["tokens"]
    return out


# -- where trees pay --------------------------------------------------------------------------
def head_bytes(hidden: int, intermediate: int, heads: int, kv: int, head_dim: int, draft_vocab: int) -> int:
    """fp32 bytes of an EAGLE-3 head (one layer over [embedding, fc(features)], fc 3H -> H, head)."""
    qkv = (heads + 2 * kv) * head_dim * 2 * hidden
    layer = qkv + heads * head_dim * hidden + 3 * intermediate * hidden
    return 4 * (layer + 3 * hidden * hidden + draft_vocab * hidden)


def pick_tree(q, verify: dict, dcost: dict, max_nodes: int = 64, max_depth: int = 8) -> dict:
    """The tree tools/tune picks under acceptance profile q, and what it predicts."""
    from arborspec.tools.tune.tree_dp import choose_tree

    choice = choose_tree(q, verify, dcost, max_nodes, max_depth)
    best = choice["best"]
    chain = max((g for g in choice["grid"] if g["nodes"] == g["depth"]), key=lambda g: g["tokens_per_s"])
    return {
        "nodes": best["nodes"], "depth": best["depth"], "tokens_per_step": best["expected_tokens_per_step"],
        "step_ms": best["step_ms"], "speedup": best["tokens_per_s"] / choice["vanilla_tokens_per_s"],
        "best_chain_nodes": chain["nodes"], "best_chain_speedup": chain["tokens_per_s"] / choice["vanilla_tokens_per_s"],
    }  # fmt: skip


@dataclass
class SizeRow:
    """One row of the table (benchmarks/RESULTS.md "Model sizes")."""

    size: str
    params_b: float
    export: dict = field(default_factory=dict)  # kind -> Measured as dict
    ours: dict = field(default_factory=dict)
    llama: dict = field(default_factory=dict)
    curves: dict = field(default_factory=dict)  # str(P) -> {T: ms}
    tree: dict = field(default_factory=dict)  # str(P) -> pick_tree(...)

    def to_json(self) -> dict:
        return asdict(self)


def markdown_table(rows: list[SizeRow], machine: str) -> str:
    """The README's table: one line a size."""
    head = ("| model (weights) | export peak RSS int4 / fp16 | ours int4 vanilla | llama.cpp Q4_0 | "
            "c(16)/c(1), c(64)/c(1) at P=512 | tree tune picks (nodes, depth) | predicted tree speed-up |")  # fmt: skip
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        rss = " / ".join(f"{r.export[k]['peak_gb']:.2f} GB" if k in r.export else "-" for k in ("int4", "fp16"))
        c = r.curves.get("512", {})
        ratio = f"{c[16] / c[1]:.2f}, {c[64] / c[1]:.2f}" if c and 16 in c and 64 in c else "-"
        t = r.tree.get("512", {})
        tree = f"{t['nodes']}, {t['depth']}" if t else "-"
        sp = f"{t['speedup']:.2f}x (chain {t['best_chain_speedup']:.2f}x)" if t else "-"
        ours = f"{r.ours['tokens_per_s']:.1f} tok/s" if r.ours.get("tokens_per_s") else "-"
        ll = f"{r.llama['tokens_per_s']:.1f} tok/s" if r.llama.get("tokens_per_s") else "-"
        if r.llama.get("repack_off"):  # both settings measured: the kept one, and the other's median
            other = sorted(r.llama["repack_off" if r.llama["repack"] else "repack_on"])
            ll += f" (repacking {'on' if r.llama['repack'] else 'off'}; {other[len(other) // 2]:.1f} the other)"
        lines.append(f"| {r.size} ({r.params_b:.2f}B) | {rss} | {ours} | {ll} | {ratio} | {tree} | {sp} |")
    lines.append(f"\n{machine}")
    return "\n".join(lines)
