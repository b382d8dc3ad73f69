"""benchmarks/vs_llamacpp.py's sitting: the rounds are one bench (ids @2, @3, ...), llama.cpp's
faster repacking setting is kept per configuration, and the ratios are taken per round."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_llamacpp as vs  # noqa: E402


def _run(rate):
    return {"tokens_per_s": rate, "mean_accepted": 1.0, "ttft_s": 0.1}


def test_rounds_best_repacking_and_ratios():
    ps = vs.prompts(2)
    assert len(ps) == 48 and ps[0]["id"] == "conversation-1" and ps[24]["id"] == "conversation-1@2"
    assert [p["text"] for p in ps[:24]] == [p["text"] for p in ps[24:]]
    names = ["vanilla", "tree", "llama-server-repack-on", "llama-server-repack-off", "openvino"]
    rates = {  # round 1: ours 100 vs their best 80 (repacking off); round 2: 90 vs 120 (on)
        1: {"vanilla": 100, "tree": 95, "llama-server-repack-on": 70, "llama-server-repack-off": 80, "openvino": 50},
        2: {"vanilla": 90, "tree": 85, "llama-server-repack-on": 120, "llama-server-repack-off": 60, "openvino": 45},
    }
    per = [
        {
            "id": p["id"],
            "category": p["category"],
            "prompt_tokens": 500,
            "runs": {n: _run(rates[1 + i // 24][n]) for n in names},
        }
        for i, p in enumerate(ps)
    ]
    text = vs.summary({"configs": [{"name": n} for n in names], "per_prompt": per})
    assert "| llama-server | 95.0 | 70.0 | on |" in text  # medians over both rounds: on 95, off 70
    assert "| our vanilla / llama.cpp's best vanilla | 1.25x | 0.75x |" in text
    assert "| our best / OpenVINO's best | 2.00x | 2.00x |" in text
    assert "| vanilla | 100.0 | 90.0 |" in text
