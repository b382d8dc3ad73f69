"""Where trees pay, by model size (issue: models at the sizes users deploy).

For SmolLM2-135M (real weights) and random checkpoints with the exact shapes of Llama-3.2-1B,
Llama-3.2-3B and Llama-3.1-8B (SmolLM2's vocabulary; tools/bench/scale_shapes.py): the peak memory
of `arborspec export` (int4 and fp16, /usr/bin/time -v), our int4 vanilla decode beside llama.cpp's
on the same 4-bit weights (its converter and quantiser: Q4_0; our export carries those blocks),
the verify cost curve c(T) at P = 512 and 2048, and the tree the tuner picks from the shipped
SmolLM2 head's measured acceptance. Random weights give random text: acceptance comes from
SmolLM2's head and the cost from the large shape. The `trt` step: the portable fp16 export
(TensorRT's graph, streamed) and `arborspec build` of it for SM 8.9, peak memory, time and engine.

    python benchmarks/scale.py --work /work/cache/scale --sizes 135m,1b,3b,8b
    python benchmarks/scale.py --work W --sizes 1b --steps export,decode   # a part
    python benchmarks/scale.py --work W --sizes 1b,3b,8b --steps trt       # TensorRT: export + build
    python benchmarks/scale.py --work W --sizes 1b --steps gguf,decode,curve  # no export-memory runs

Steps: export (the GGUF, our export of it, and the peak memory of int4 / fp16 exports from the
Hugging Face folder), gguf (the GGUF and our export of it only), decode (ours vs llama-bench with
repacking on and off, 3 interleaved rounds; the faster setting is kept, both reported), curve,
tree, head, trt (the portable export and its TensorRT-RTX build).

Writes W/scale.json (every figure) and W/scale.md (the README's table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from arborspec.tools.bench import scale
from arborspec.tools.bench.scale_shapes import SHAPES, write_random_checkpoint

SIZES = {"135m": None, "1b": "llama-3.2-1b", "3b": "llama-3.2-3b", "8b": "llama-3.1-8b"}
STEPS = ("export", "gguf", "decode", "curve", "tree", "head", "trt")
ARB = [sys.executable, "-m", "arborspec.tools.commands.cli"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files (the GGUF's, through the model cache)."""
    from arborspec.models.registry import load_model

    return Path(load_model("smollm2-135m").source["cache"])


def params_b(size: str) -> float:
    if SIZES[size] is None:
        return 0.135
    from arborspec.models.config import weight_counts

    s = SHAPES[SIZES[size]]
    layer, heads = weight_counts(s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, 49152, s.tied)
    return (s.layers * layer + heads) / 1e9


def export_cmd(model, out: Path, *flags, draft: str = "none") -> list:
    return [*ARB, "export", "--model", str(model), "--draft", draft, "--max-context", "4096", "-q",
            "--force", "--out", str(out), *flags]  # fmt: skip


def step_export(size: str, work: Path, tools, row: scale.SizeRow, hf_exports: bool = True) -> Path:
    """The GGUF llama.cpp runs, our export of it (decoded below), and (hf_exports) the peak memory
    of the exports from the Hugging Face folder (int4 round-to-nearest and fp16)."""
    if SIZES[size] is None:
        from arborspec.models.registry import smollm2_path

        gguf = smollm2_path()
    else:
        hf = work / SIZES[size]
        if not (hf / "model.safetensors.index.json").is_file():
            log(f"{size}: writing the random checkpoint")
            write_random_checkpoint(SHAPES[SIZES[size]], hf, smollm2_tokenizer_dir(), 49152)
        gguf = scale.llama_gguf(hf, work, tools, "Q4_0", log)
        for kind, flags in (("int4", ["--quantize", "int4"]), ("fp16", ["--dtype", "fp16", "--attention", "gqa"]))[
            : 2 if hf_exports else 0
        ]:
            log(f"{size}: export {kind} from the checkpoint")
            out = work / f"{size}-{kind}-hf"
            m = scale.timed(export_cmd(hf, out, *flags), work / f"{size}-{kind}-export.log")
            row.export[kind] = m.__dict__
            shutil.rmtree(out, ignore_errors=True)  # measured; the decode uses the GGUF's export
    out = work / f"{size}-int4-gguf"
    log(f"{size}: export int4 from {gguf.name}")
    m = scale.timed(export_cmd(gguf, out, "--quantize", "int4"), work / f"{size}-gguf-export.log")
    row.export["int4-gguf"] = m.__dict__
    if m.rc:
        raise SystemExit(f"{size}: export failed: {m.tail}")
    row.llama["gguf"] = str(gguf)
    return out


def step_decode(size: str, work: Path, tools, row: scale.SizeRow) -> None:
    out = work / f"{size}-int4-gguf"
    log(f"{size}: vanilla decode, ours and llama.cpp's repacking on / off (interleaved, 3 rounds)")
    ours, theirs, loads = [], {True: [], False: []}, []
    for _ in range(3):
        loads.append(os.getloadavg()[0])
        ours.append(scale.our_vanilla(out, 64, 32, reps=1)["tokens_per_s"])
        for repack in (True, False):
            lb = scale.llama_bench(tools, Path(row.llama["gguf"]), 0, 32, depth=64, reps=1, repack=repack)
            theirs[repack].append(lb["tokens_per_s"])
    best = max((True, False), key=lambda r: sorted(theirs[r])[1])
    row.ours = {"tokens_per_s": sorted(ours)[1], "samples": ours, "load_avg": loads}
    row.llama.update({"tokens_per_s": sorted(theirs[best])[1], "samples": theirs[best], "repack": best,
                      "build": tools.flavour, "repack_on": theirs[True], "repack_off": theirs[False]})  # fmt: skip


def step_curve(size: str, work: Path, row: scale.SizeRow) -> None:
    out = work / f"{size}-int4-gguf"
    for past in (512, 2048):
        log(f"{size}: verify cost c(T) at P = {past}")
        row.curves[str(past)] = scale.verify_curve(out, past)


def step_tree(size: str, work: Path, row: scale.SizeRow, profile: dict) -> None:
    """The tuner's tree at this size: the shipped head's acceptance q, this size's c(T), the head's
    cost scaled from SmolLM2's head by weight bytes."""
    ratio = 1.0
    if SIZES[size] is not None:
        s = SHAPES[SIZES[size]]
        ratio = (
            scale.head_bytes(s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim, 32000) / profile["head_bytes"]
        )
    dcost = {int(k): v * ratio for k, v in profile["draft_cost_ms"].items()}
    for past, curve in row.curves.items():
        row.tree[past] = {
            **scale.pick_tree(profile["q"], {int(k): v for k, v in curve.items()}, dcost),
            "head_cost_ratio": ratio,
        }


def step_head(size: str, work: Path, row: scale.SizeRow) -> None:
    """A random EAGLE-3 head with the public head's layout for this shape (yuhuili/EAGLE3-LLaMA3.1-
    Instruct-8B for the 8B) exported with the target (streamed; peak memory measured), then greedy
    tree decoding against vanilla on the same export: the same tokens."""
    from arborspec.tools.bench.scale_shapes import write_random_eagle3_head

    head = work / f"eagle3-{size}-layout"
    if not (head / "model.safetensors").is_file():
        write_random_eagle3_head(SHAPES[SIZES[size]], head, 49152)
    out = work / f"{size}-int4-eagle3"
    log(f"{size}: export int4 + EAGLE-3 head (int8)")
    flags = ("--quantize", "int4", "--draft-quantize", "int8")
    cmd = export_cmd(row.llama["gguf"], out, *flags, draft=f"eagle3:{head}")
    m = scale.timed(cmd, work / f"{size}-eagle3-export.log")
    row.export["int4+eagle3"] = m.__dict__
    if m.rc:
        raise SystemExit(f"{size}: export with the head failed: {m.tail}")
    log(f"{size}: greedy tree vs vanilla with the head")
    row.tree["head_exact"] = scale.tree_equals_vanilla(out, "full:2,2", new_tokens=16)


def step_trt(size: str, work: Path, row: scale.SizeRow) -> None:
    """The TensorRT path: the portable fp16 graph (`--attention onnx`, streamed from the checkpoint)
    and `arborspec build` of it for SM 8.9 (TensorRT-RTX, ahead of time on the CPU): peak memory,
    time and engine size, or the refusal line where this machine cannot hold it."""
    model = work / SIZES[size] if SIZES[size] else "smollm2-135m"
    if SIZES[size] and not (model / "model.safetensors.index.json").is_file():
        write_random_checkpoint(SHAPES[SIZES[size]], model, smollm2_tokenizer_dir(), 49152)
    out = work / f"{size}-fp16-portable"
    log(f"{size}: portable fp16 export (TensorRT's graph)")
    m = scale.timed(export_cmd(model, out, "--dtype", "fp16", "--attention", "onnx"), work / f"{size}-portable-export.log")
    row.export["portable-fp16"] = {**m.__dict__, "tail": m.tail[-300:]}
    if m.rc:
        return
    onnx_bytes = sum(f.stat().st_size for f in out.glob("target.onnx*"))
    log(f"{size}: arborspec build --compute-capability 8.9 --max-context 4096")
    cmd = [*ARB, "build", "--export-dir", str(out), "--compute-capability", "8.9", "--max-context", "4096"]
    b = scale.timed(cmd, work / f"{size}-trt-build.log")
    engine = out / "engines" / "target.engine"
    size_b = engine.stat().st_size if engine.is_file() else None
    row.export["trt-build"] = {**b.__dict__, "tail": b.tail[-300:], "engine_bytes": size_b, "onnx_bytes": onnx_bytes}
    shutil.rmtree(out, ignore_errors=True)


def trt_table(rows: list) -> str:
    """The README's TensorRT rows: portable export and engine build, peak memory and time."""
    lines = ["| model | portable fp16 export: peak, time | `build` SM 8.9: peak, time | engine | build peak / engine |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        e, b = r.export.get("portable-fp16"), r.export.get("trt-build")
        if not e:
            continue
        exp = f"{e['peak_gb']:.2f} GiB, {e['seconds']:.0f} s" if not e["rc"] else "refused: " + e["tail"].strip().splitlines()[-1]
        if not b:
            lines.append(f"| {r.size} | {exp} | - | - | - |")
            continue
        eng = b.get("engine_bytes")
        built = f"{b['peak_gb']:.2f} GiB, {b['seconds']:.0f} s" if not b["rc"] else "refused: " + b["tail"].strip().splitlines()[-1]
        ratio = f"{b['peak_gb'] * 2**30 / eng:.2f}x" if eng and not b["rc"] else "-"
        lines.append(f"| {r.size} | {exp} | {built} | {eng / 2**30:.2f} GiB | {ratio} |" if eng else f"| {r.size} | {exp} | {built} | - | - |")
    return "\n".join(lines)


def head_profile(work: Path) -> dict:
    """The shipped head's acceptance profile and cost, from `arborspec tune` on the SmolLM2 int4 export."""
    doc = work / "smollm2-tune.json"
    if not doc.is_file():
        raise SystemExit(
            f"{doc}: run `arborspec tune --export-dir {work}/135m-int4-gguf --draft export --out {doc}` first"
        )
    d = json.loads(doc.read_text())
    hb = scale.head_bytes(576, 1536, 9, 3, 64, 49152)  # SmolLM2's head: its vocabulary is the target's
    return {"q": d["acceptance"]["q"], "draft_cost_ms": d["draft_cost_ms"], "head_bytes": hb}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="folder for checkpoints, GGUFs, exports and results")
    ap.add_argument("--sizes", default="135m,1b,3b,8b", help="comma list of " + ", ".join(SIZES))
    ap.add_argument("--steps", default=",".join(STEPS), help="comma list of " + ", ".join(STEPS))
    a = ap.parse_args(argv)
    sizes, steps = a.sizes.split(","), a.steps.split(",")
    if bad := [s for s in sizes if s not in SIZES] + [s for s in steps if s not in STEPS]:
        ap.error(f"unknown size or step: {', '.join(bad)}")
    from arborspec.tools.bench.llama_server import llama_cpp_tools

    a.work.mkdir(parents=True, exist_ok=True)
    tools = llama_cpp_tools(build=True) if set(steps) & {"export", "gguf", "decode", "head"} else None
    results = a.work / "scale.json"
    doc = json.loads(results.read_text()) if results.is_file() else {}
    for size in sizes:
        row = scale.SizeRow(**doc[size]) if size in doc else scale.SizeRow(size, params_b(size))
        if "export" in steps or "gguf" in steps:
            step_export(size, a.work, tools, row, hf_exports="export" in steps)
        if "decode" in steps:
            step_decode(size, a.work, tools, row)
        if "curve" in steps:
            step_curve(size, a.work, row)
        if "tree" in steps:
            step_tree(size, a.work, row, head_profile(a.work))
        if "head" in steps and SIZES[size] is not None:
            step_head(size, a.work, row)
        if "trt" in steps:
            step_trt(size, a.work, row)
        doc[size] = row.to_json()
        results.write_text(json.dumps(doc, indent=1))
    machine = f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}"
    rows = [scale.SizeRow(**doc[s]) for s in SIZES if s in doc]
    for r in rows:
        r.curves = {p: {int(k): v for k, v in c.items()} for p, c in r.curves.items()}
    (a.work / "scale.md").write_text(scale.markdown_table(rows, machine) + "\n\n" + trt_table(rows) + "\n")
    print((a.work / "scale.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
