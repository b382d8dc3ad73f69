"""The model-size benchmark's pieces (tools/bench/scale_shapes.py, tools/bench/scale.py) on tiny
shapes: the random checkpoints read back as the shape says, and the tree pick follows the cost
curve (a flat curve buys a tree, a steep one a short chain)."""

from __future__ import annotations

import json
import math

import pytest

from arborspec.tools.bench import scale
from arborspec.tools.bench.scale_shapes import SHAPES, Shape, _shard_plan, write_random_checkpoint


def test_the_shapes_are_the_public_models():
    s = SHAPES["llama-3.1-8b"]
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.tied) == (4096, 32, 32, 8, 14336, False)
    n = sum(math.prod(dims) for _, dims in s.tensors(128256))
    assert abs(n / 1e9 - 8.03) < 0.01  # Llama-3.1-8B with its own vocabulary: 8.03B parameters


def test_random_checkpoint_is_sharded_and_reads_back(tmp_path):
    pytest.importorskip("safetensors")
    from arborspec.export.weights import SafetensorsWeights

    tiny = Shape("tiny", 64, 2, 4, 2, 16, 128, False, 8.0)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    out = write_random_checkpoint(tiny, tmp_path / "ck", tok, vocab=96, shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2 and set(index) == {n for n, _ in tiny.tensors(96)}
    w = SafetensorsWeights(out)
    assert (w.config.n_layers, w.config.hidden_size, w.config.tie_embeddings) == (2, 64, False)
    assert w.config.rope_scaling["rope_type"] == "llama3"
    assert w.get("model.layers.1.mlp.down_proj.weight").shape == (64, 128)
    assert (w.get("model.norm.weight") == 1).all()


def test_shard_plan_respects_the_size():
    plan = _shard_plan([("a", (10,)), ("b", (10,)), ("c", (30,)), ("d", (5,))], shard_bytes=40)
    assert [[n for n, _ in s] for s in plan] == [["a", "b"], ["c"], ["d"]]


def test_the_tree_pick_follows_the_cost_curve():
    q = [[0.7, 0.15, 0.05, 0.03]] * 6  # an acceptance profile: rank 0 accepted 70 % at every depth
    flat = {t: 10.0 + 0.01 * t for t in (1, 2, 4, 8, 16, 32, 64)}  # a large model: T rows ~ one row
    steep = {t: 10.0 * t for t in (1, 2, 4, 8, 16, 32, 64)}  # every row costs a full call
    cheap_draft = {f: 0.2 for f in (1, 2, 4, 8, 16, 32, 64)}
    wide = scale.pick_tree(q, flat, cheap_draft)
    narrow = scale.pick_tree(q, steep, cheap_draft)
    assert wide["nodes"] > wide["depth"] and wide["speedup"] > wide["best_chain_speedup"] > 1
    assert narrow["speedup"] <= 1.05  # nothing pays when a verify row costs a call


def test_markdown_table_one_line_a_size():
    r = scale.SizeRow("8b", 7.5, export={"int4": {"peak_gb": 6.1}}, ours={"tokens_per_s": 2.0},
                      llama={"tokens_per_s": 2.5}, curves={"512": {1: 1.0, 16: 1.2, 64: 2.0}},
                      tree={"512": {"nodes": 12, "depth": 4, "speedup": 2.1, "best_chain_speedup": 1.8}})  # fmt: skip
    lines = scale.markdown_table([r], "a machine").splitlines()
    assert lines[2].startswith("| 8b (7.50B) | 6.10 GB / - | 2.0 tok/s | 2.5 tok/s | 1.20, 2.00 | 12, 4 | 2.10x")


def test_the_trt_rows_give_peak_time_engine_and_the_refusal_line():
    """benchmarks/scale.py's TensorRT table: a built size shows its peaks, times, engine and the
    build's peak over the engine; a refused build shows its one line."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
    spec = importlib.util.spec_from_file_location("scale_bench_script", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    built = scale.SizeRow("1b", 1.07, export={
        "portable-fp16": {"rc": 0, "seconds": 223.0, "peak_gb": 1.96, "tail": ""},
        "trt-build": {"rc": 0, "seconds": 174.0, "peak_gb": 4.24, "tail": "", "engine_bytes": 2 * 2**30},
    })  # fmt: skip
    refused = scale.SizeRow("8b", 7.5, export={
        "portable-fp16": {"rc": 0, "seconds": 900.0, "peak_gb": 6.0, "tail": ""},
        "trt-build": {"rc": 2, "seconds": 3.0, "peak_gb": 0.3, "engine_bytes": None,
                      "tail": "arborspec: error: building the engine of W/target.onnx needs about 30.5 GB"},
    })  # fmt: skip
    table = bench.trt_table([built, refused]).splitlines()
    assert table[2] == "| 1b | 1.96 GiB, 223 s | 4.24 GiB, 174 s | 2.00 GiB | 2.12x |"
    assert table[3].startswith("| 8b | 6.00 GiB, 900 s | refused: arborspec: error: building the engine")


def test_markdown_table_says_which_repacking_setting_was_kept():
    r = scale.SizeRow("1b", 1.2, ours={"tokens_per_s": 20.4},
                      llama={"tokens_per_s": 17.9, "repack": True, "repack_on": [17.5, 17.9, 18.0],
                             "repack_off": [16.0, 16.2, 16.4]})  # fmt: skip
    cell = scale.markdown_table([r], "m").splitlines()[2].split(" | ")[3]
    assert cell == "17.9 tok/s (repacking on; 16.2 the other)"
    r.llama.update(tokens_per_s=16.2, repack=False)
    assert "(repacking off; 17.9 the other)" in scale.markdown_table([r], "m").splitlines()[2]


def test_llama_bench_runs_the_repacking_setting_asked(monkeypatch, tmp_path):
    calls = []

    class P:
        returncode, stdout, stderr = 0, '[{"avg_ts": 12.5, "samples_ts": [12.5]}]', ""

    monkeypatch.setattr(scale.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or P())
    tools = type("T", (), {"bench": tmp_path / "llama-bench"})()
    off = scale.llama_bench(tools, tmp_path / "m.gguf", 0, 32, depth=64, repack=False)
    assert off == {"tokens_per_s": 12.5, "samples_ts": [12.5], "repack": False} and calls[-1][-2:] == ["--repack", "0"]
    assert scale.llama_bench(tools, tmp_path / "m.gguf", 0, 32, repack=True)["repack"] and calls[-1][-1] == "1"
    assert scale.llama_bench(tools, tmp_path / "m.gguf", 0, 32)["repack"] and len(calls) == 3  # on, where it runs


def test_verify_curve_opens_the_target_as_the_decoder_does(tmp_path, monkeypatch):
    """scale.verify_curve times the export's target through open_export (the engine the decoder
    runs: the row-invariant layout where the export needs it) beside the decoder's host threads."""
    from conftest import tiny_text_export

    from arborspec.runtime import export_dir

    e = tiny_text_export(tmp_path / "e", seed=3, draft="none")
    opened = []
    real = export_dir.open_export
    monkeypatch.setattr(export_dir, "open_export", lambda *a, **k: opened.append(a) or real(*a, **k))
    curve = scale.verify_curve(e, past=8, sizes=(1, 2), reps=1)
    assert set(curve) == {1, 2} and all(v > 0 for v in curve.values())
    assert opened and opened[0][:3] == (e, "onnxruntime", "cpu")
