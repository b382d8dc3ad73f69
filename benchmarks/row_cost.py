"""Where a row's time goes (issue 66, item 1): one target call at T = 1, 2, 4, 8, 16, 64 new tokens
after P = 512 cached, timed as the decoder makes it (tune's cost curve: the engine's own session
options) and per operator (ONNX Runtime's profiler, whose per-node cost flattens its ratios), beside the int8 arithmetic floor of
the same shapes (benchmarks/int8_floor.py) and llama.cpp's own batch cost on the same weights
(`llama-bench -p T -n 0 -d 512 -t 2`, repacking on and off; T = 1 from `-p 0 -n 16 -d 512`).

    python benchmarks/row_cost.py --export-dir EXPORT --gguf MODEL.gguf --shape smollm2-135m --out OUT.json
    python benchmarks/row_cost.py --export-dir W/1b-int4-gguf --gguf W/llama-3.2-1b-q4_0.gguf \
        --shape llama-3.2-1b --out W/row_cost_1b.json

Rounds are interleaved (ours, llama.cpp repacking on, repacking off, the floor; then again), and
each figure is the median over rounds of each round's median (ours profiled, llama.cpp) or fastest
(ours as the decoder calls it: tune's cost curve, the least-disturbed call; the floor). Writes OUT (every figure, the load average of each round) and OUT.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import int8_floor  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 64)


def ours(export_dir: Path, tokens, past: int, reps: int) -> dict:
    """{T: {"ms": median, "ops": [(op, share, ms per call)]}} from ONNX Runtime's profiler."""
    from arborspec.tools.bench.profile_ort import profile

    out = {}
    for t in tokens:
        r = profile(str(export_dir / "target.onnx"), tokens=t, past=past, reps=reps, threads=2)
        out[t] = {"ms": r["median_ms"], "min_ms": r["min_ms"], "ops": r["ops"][:12]}
    return out


def llama(tools, gguf: Path, tokens, past: int, repack: bool, reps: int = 3) -> dict:
    """{T: ms} of one llama.cpp call of T tokens after `past` cached: T / (llama-bench's t/s)."""
    base = [str(tools.bench), "-m", str(gguf), "-d", str(past), "-t", "2", "-r", str(reps), "-o", "json",
            "--repack", "1" if repack else "0"]  # fmt: skip
    batch = [t for t in tokens if t > 1]
    out = {}
    runs = [(["-p", ",".join(map(str, batch)), "-n", "0"], None)] + (
        [(["-p", "0", "-n", "16"], 1)] if 1 in tokens else []
    )
    for args, fixed_t in runs:
        p = subprocess.run([*base, *args], capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"llama-bench failed: {p.stderr.strip().splitlines()[-1:]}")
        for row in json.loads(p.stdout):
            t = fixed_t or int(row["n_prompt"])
            out[t] = 1e3 * (1 if fixed_t else t) / float(row["avg_ts"])
    return out


def _median_of(rounds: list[dict], t: int) -> float:
    return statistics.median(r[t] for r in rounds)


def table(doc: dict) -> str:
    """Markdown: c(T) in ms and c(T)/c(1) per engine, then ours per operator."""
    ts = doc["tokens"]
    rows = [("ours (ONNX Runtime, as the decoder calls it)", doc["ours_plain_ms"]),
            ("ours (ONNX Runtime, profiled call)", doc["ours_ms"]), ("llama.cpp, repacking on", doc["llama_repack_ms"]),
            ("llama.cpp, repacking off", doc["llama_norepack_ms"]), ("int8 GEMM floor (same matrices)", doc["floor_ms"])]  # fmt: skip
    head = "| c(T) ms, P = 512 | " + " | ".join(f"T={t}" for t in ts) + " |"
    lines = [head, "|---" * (len(ts) + 1) + "|"]
    for name, c in rows:
        lines.append(f"| {name} | " + " | ".join(f"{c[str(t)]:.1f}" for t in ts) + " |")
    lines += ["", head.replace("c(T) ms", "c(T)/c(1)"), "|---" * (len(ts) + 1) + "|"]
    for name, c in rows:
        lines.append(f"| {name} | " + " | ".join(f"{c[str(t)] / c[str(ts[0])]:.2f}" for t in ts) + " |")
    ops = sorted({op for t in ts for op, _s, _ms in doc["ours_ops"][str(t)][:6]})
    lines += [
        "",
        "| ours, ms per call by operator | " + " | ".join(f"T={t}" for t in ts) + " |",
        "|---" * (len(ts) + 1) + "|",
    ]
    for op in ops:
        cells = []
        for t in ts:
            ms = {o: m for o, _s, m in doc["ours_ops"][str(t)]}.get(op)
            cells.append("-" if ms is None else f"{ms:.2f}")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export-dir", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, required=True, help="the GGUF the export was made from (llama.cpp runs it)")
    ap.add_argument("--shape", required=True, choices=sorted(int8_floor.SHAPES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8, help="timed calls of ours per T per round")
    ap.add_argument("--llama-reps", type=int, default=3, help="llama-bench -r (each repetition refills the 512 cached)")
    ap.add_argument("--llama-bench", type=Path, default=None, help="this llama-bench binary (default: bench's build)")
    a = ap.parse_args(argv)
    from arborspec.tools.bench.llama_server import llama_cpp_tools
    from arborspec.tools.bench.scale import verify_curve

    if a.llama_bench is not None:
        from types import SimpleNamespace

        tools = SimpleNamespace(bench=a.llama_bench, version="given", flavour=str(a.llama_bench))
    else:
        tools = llama_cpp_tools(build=False)
    tokens = [int(t) for t in a.tokens.split(",")]
    r_ours, r_plain, r_on, r_off, r_floor, loads = [], [], [], [], [], []
    for k in range(a.rounds):
        loads.append(os.getloadavg()[0])
        print(f"round {k + 1}: load {loads[-1]:.1f}", file=sys.stderr, flush=True)
        # as the decoder calls it (the engine's own session options, no profiler: the profiler's
        # per-node cost is the same at every T and flattens the profiled c(T)/c(1))
        r_plain.append(verify_curve(a.export_dir, a.past, tokens, a.reps))
        r_ours.append(ours(a.export_dir, tokens, a.past, a.reps))
        r_on.append(llama(tools, a.gguf, tokens, a.past, True, a.llama_reps))
        r_off.append(llama(tools, a.gguf, tokens, a.past, False, a.llama_reps))
        r_floor.append(int8_floor.floor_curve(a.shape, tokens, reps=5))
    doc = {
        "shape": a.shape, "export": str(a.export_dir), "gguf": str(a.gguf), "past": a.past, "tokens": tokens,
        "llama.cpp": {"version": tools.version, "build": tools.flavour, "binary": str(tools.bench)},
        "load_avg_1min_per_round": loads, "gop_per_row": int8_floor.gop_per_row(a.shape),
        "ours_plain_ms": {str(t): _median_of(r_plain, t) for t in tokens},
        "ours_ms": {str(t): statistics.median(r[t]["ms"] for r in r_ours) for t in tokens},
        "ours_ops": {str(t): r_ours[-1][t]["ops"] for t in tokens},
        "llama_repack_ms": {str(t): _median_of(r_on, t) for t in tokens},
        "llama_norepack_ms": {str(t): _median_of(r_off, t) for t in tokens},
        "floor_ms": {str(t): min(r[t] for r in r_floor) for t in tokens},
        "rounds": {"ours": [{t: r[t]["ms"] for t in tokens} for r in r_ours], "ours_plain": r_plain, "llama_repack": r_on,
                   "llama_norepack": r_off, "floor": r_floor},
    }  # fmt: skip
    a.out.write_text(json.dumps(doc, indent=1))
    md = table(doc)
    a.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
