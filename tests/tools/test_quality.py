"""tools/bench/quality.py and `arborspec bench --quality`: perplexity of the packaged held-out text
through the runtime's ONNX Runtime engine, in chunks over the KV cache (equal to PyTorch's
full-sequence perplexity, whatever the chunk), equal for two identical exports, different but
close for a quantised export; greedy agreement with the fp32 export; the table."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from conftest import tiny_text_export  # noqa: E402

from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.export_dir import open_export  # noqa: E402
from arborspec.tools.bench import quality  # noqa: E402
from arborspec.tools.commands.cli import main  # noqa: E402

SCALE = 0.5  # a milder random model than the decoding tests' (perplexities in a readable range)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    d = tmp_path_factory.mktemp("quality")
    tiny_text_export(d / "fp32", scale=SCALE)
    shutil.copytree(d / "fp32", d / "fp32-copy")
    tiny_text_export(d / "int4", scale=SCALE, quantize="int4", qformat="qdq")
    return d


def test_heldout_text_is_packaged_and_not_a_prompt():
    text = quality.heldout_text()
    assert len(text) > 3000
    from arborspec.tools.prompts import default_prompts_path

    prompts = json.loads(default_prompts_path().read_text())
    entries = prompts["prompts"] if isinstance(prompts, dict) else prompts
    for e in entries:  # no sentence of the held-out text comes from the benchmark prompts
        t = e.get("text", "")
        assert not any(s.strip() and s.strip() in t for s in text.split(".") if len(s.strip()) > 30)


def test_chunked_perplexity_equals_pytorch_full_sequence(exports):
    from conftest import random_model, tiny_config

    with open_export(exports / "fp32", draft="none") as ex:
        ids = ex.tokenizer.encode(quality.heldout_text())[:300]
        a = quality.perplexity(ex.target, ids, window=128, chunk=64)
        b = quality.perplexity(ex.target, ids, window=128, chunk=7)
        assert a.windows == 3 and a.tokens == len(ids) - 3  # one context-only token per window
        assert math.isfinite(a.perplexity) and a.perplexity > 1
        assert abs(a.nll - b.nll) < 1e-4
        # PyTorch, one full-sequence forward per window, on the module the export was made from
        m = random_model(
            tiny_config("llama", vocab=ex.target.info.vocab_size, layers=2, hidden=64, heads=4, kv=2),
            seed=0,
            scale=SCALE,
        )
        nll, n = 0.0, 0
        for s in range(0, len(ids), 128):
            if s + 1 >= len(ids):
                break
            w = torch.tensor(ids[s : s + 128])
            logits = m(
                w[None],
                torch.arange(len(w))[None],
                torch.ones(len(w), len(w), dtype=torch.bool).tril()[None],
                *[torch.zeros(0, 1, 2, 16)] * 4,
            )[0][0]
            nll -= float(torch.log_softmax(logits[:-1].detach(), -1).gather(1, w[1:, None]).sum())
            n += len(w) - 1
        assert n == a.tokens and abs(nll / n - a.nll) < 1e-4
        t = quality.perplexity(TorchEngine(m), ids, window=128, chunk=50)
        assert abs(t.nll - a.nll) < 1e-4


def test_identical_exports_agree_and_quantised_differs_within_a_loose_bound(exports):
    prompts = [[5, 9, 2, 7], [11, 12, 13, 14], [40, 41, 42]]
    rows = quality.run_quality(exports / "fp32-copy", exports / "fp32", prompts, max_new_tokens=12)
    assert rows[0]["reference"] and rows[0]["perplexity"] == rows[1]["perplexity"]
    assert math.isfinite(rows[0]["perplexity"]) and rows[1]["delta_pct"] == 0.0
    assert rows[1]["agreement"]["rate"] == 1.0 and rows[1]["agreement"]["identical"] == 3
    q = quality.run_quality(exports / "int4", exports / "fp32", prompts, max_new_tokens=12)[1]
    assert q["weights"] == "int4 qdq (rtn-symmetric)"
    assert q["perplexity"] != rows[0]["perplexity"] and abs(q["delta_pct"]) < 25.0
    # the agreement, counted here independently: greedy tokens equal before the first divergence
    from arborspec.runtime.decode import SpeculativeDecoder

    agreed = total = same = 0
    with open_export(exports / "int4", draft="none") as a, open_export(exports / "fp32", draft="none") as b:
        for p in prompts:
            x = SpeculativeDecoder(a.target, mode="vanilla").generate(p, 12).tokens
            y = SpeculativeDecoder(b.target, mode="vanilla").generate(p, 12).tokens
            k = next((i for i, (u, w) in enumerate(zip(x, y)) if u != w), min(len(x), len(y)))
            agreed, total, same = agreed + k, total + len(y), same + (x == y)
    assert q["agreement"]["identical"] == same
    assert q["agreement"]["rate"] == pytest.approx(agreed / total)


def test_bench_quality_cli(exports, tmp_path, capsys):
    pf = tmp_path / "prompts.json"
    pf.write_text(
        json.dumps(
            {
                "prompts": [
                    {"id": "a", "category": "x", "text": "The ferry left at seven."},
                    {"id": "b", "category": "y", "text": "Bread rewards patience."},
                ]
            }
        )
    )
    out = tmp_path / "q.json"
    rc = main(
        [
            "bench",
            "--quality",
            "--export-dir",
            str(exports / "int4"),
            "--reference-export-dir",
            str(exports / "fp32"),
            "--prompts",
            str(pf),
            "--max-new-tokens",
            "8",
            "--no-progress",
            "--json-out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    head = text.splitlines()[0]
    for col in ("export", "weights", "perplexity", "delta vs fp32", "greedy agreement"):
        assert col in head
    assert "int4 qdq (rtn-symmetric)" in text and "reference" in text and "2 prompts x 8 new tokens" in text
    rows = json.loads(out.read_text())["quality"]
    assert [r["reference"] for r in rows] == [True, False] and rows[1]["agreement"]["prompts"] == 2
    for argv, msg in [
        (["--quality"], "--export-dir"),
        (
            ["--export-dir", str(exports / "int4"), "--reference-export-dir", str(exports / "fp32")],
            "--reference-export-dir is for --quality",
        ),
        (
            ["--quality", "--export-dir", str(exports / "int4"), "--quality-text", str(tmp_path / "no.txt")],
            "held-out text not found",
        ),
        (
            ["--quality", "--export-dir", str(exports / "int4"), "--baselines", "llama-cpp"],
            "--baselines llama-cpp",  # a random model has no GGUF source to run llama.cpp on
        ),
        (
            ["--quality", "--export-dir", str(exports / "int4"), "--baselines", "ort-genai"],
            "--quality takes --baselines llama-cpp only",
        ),
    ]:
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_agreement_counts_the_prefix_before_the_first_divergence():
    a = quality.agreement([[1, 2, 3], [4, 5], [7, 8]], [[1, 2, 9], [4, 5], [6, 8]])
    assert (a.agreed, a.total, a.identical, a.prompts) == (4, 7, 1, 3)
    assert a.per_prompt == [pytest.approx(2 / 3), 1.0, 0.0] and a.rate == pytest.approx(4 / 7)
    b = quality.agreement([[1, 2, 3]], [[1, 2]])  # a shorter output agrees up to its end only
    assert (b.agreed, b.identical) == (2, 0)
    with pytest.raises(Exception, match="one output per reference prompt"):
        quality.agreement([[1]], [])
