"""Distillation script: a few steps on a tiny random target, loadable output, shared weights."""

from __future__ import annotations

import json

import torch
from conftest import random_model, tiny_config

from arborspec.models.registry import load_model
from arborspec.tools import prompts
from arborspec.tools.commands import distill as cli
from arborspec.tools.train import distill_draft as dd
from arborspec.tools.train import distill_eval as de


def _tiny_target(tmp_path):
    m = random_model(tiny_config("llama", vocab=96, layers=3, hidden=64))
    folder = dd.save_hf_folder(m, tmp_path / "target")
    return m, folder


def test_distill_runs_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    target, folder = _tiny_target(tmp_path)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"ids": [1, 2, 3]}, {"ids": [5, 6]}, {"ids": [7, 8, 9, 10]}]))
    out = tmp_path / "draft"
    corpus = tmp_path / "corpus.json"
    rc = cli.main(
        [
            "--model",
            str(folder),
            "--layers",
            "1",
            "--steps",
            "3",
            "--seq-len",
            "16",
            "--batch",
            "2",
            "--corpus-tokens",
            "64",
            "--gen-len",
            "16",
            "--topk",
            "8",
            "--prompts",
            str(prompts),
            "--corpus",
            str(corpus),
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    assert corpus.is_file() and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["num_hidden_layers"] == 1
    assert hf["arborspec"]["distilled"]["steps"] == 3
    lm = load_model(out)
    assert lm.config.n_layers == 1 and lm.config.vocab_size == 96
    tsd = target.state_dict()
    dsd = lm.module.state_dict()
    assert torch.equal(dsd["model.embed_tokens.weight"], tsd["model.embed_tokens.weight"])
    assert torch.equal(lm.module.lm_head.weight, target.lm_head.weight)
    # the layers did train (init from target layer 0, then 3 AdamW steps)
    assert not torch.equal(dsd["model.layers.0.mlp.up_proj.weight"], tsd["model.layers.0.mlp.up_proj.weight"])
    # second run reuses the cached corpus and is reproducible
    out2 = tmp_path / "draft2"
    rc = cli.main(
        [
            "--model",
            str(folder),
            "--layers",
            "1",
            "--steps",
            "3",
            "--seq-len",
            "16",
            "--batch",
            "2",
            "--corpus-tokens",
            "64",
            "--gen-len",
            "16",
            "--topk",
            "8",
            "--prompts",
            str(prompts),
            "--corpus",
            str(corpus),
            "--out",
            str(out2),
            "--quiet",
        ]
    )
    assert rc == 0
    d2 = load_model(out2).module.state_dict()
    assert all(torch.equal(dsd[k], d2[k]) for k in dsd)


def test_distilled_draft_exports(tmp_path, monkeypatch):
    """The folder is a valid `--draft` for export (ONNX, via the registry loader)."""
    import pytest

    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    target, folder = _tiny_target(tmp_path)
    draft = dd.make_draft(target, 1, "random", seed=1)
    dfolder = dd.save_hf_folder(draft, tmp_path / "d")
    from arborspec.export.export_folder import export_folder

    s = export_folder(str(folder), tmp_path / "exp", draft=str(dfolder))
    assert (s.out / "draft.onnx").is_file()


def test_split_prompts_holds_out_even_entries():
    entries = [{"text": f"p{i}"} for i in range(6)]
    train, held = prompts.split_prompts(entries, 8)
    assert [e["text"] for e in held] == ["p0", "p2", "p4"]
    assert [e["text"] for e in train] == ["p1", "p3", "p5"]
    _, held = prompts.split_prompts([], 3)
    assert len(held) == 3


def test_eval_mode_compares_drafts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    target, folder = _tiny_target(tmp_path)
    dfolder = dd.save_hf_folder(dd.make_draft(target, 1, "target"), tmp_path / "d")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"ids": [1, 2, 3]}, {"ids": [5, 6]}, {"ids": [7, 8, 9, 10]}]))
    rows_file = tmp_path / "rows.json"
    rc = cli.main(
        [
            "--model",
            str(folder),
            "--eval",
            "--drafts",
            f"layers:1,{dfolder}",
            "--trees",
            "vanilla;chain:2",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--json-out",
            str(rows_file),
            "--quiet",
        ]
    )
    assert rc == 0
    rows = json.loads(rows_file.read_text())
    assert len(rows) == 4 and all(r["tokens"] == 16 for r in rows)  # 2 held-out prompts x 8 tokens
    by = {(r["draft"], r["tree"]): r["mean_accepted"] for r in rows}
    assert by[("layers:1", "vanilla")] == 1.0
    # the target-initialised, untrained 1-layer draft is the layers:1 draft: same acceptance
    assert by[(str(dfolder), "chain:2")] == by[("layers:1", "chain:2")]
    assert "| draft |" in capsys.readouterr().out


def test_eval_simulate_matches_real_decoding(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    target, folder = _tiny_target(tmp_path)
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    trial = de.DraftTrial(str(folder), ["layers:1", "layers:2"], prompts, ["full:2,2", "chain:3"], 12, False)
    real, sim = de.evaluate_drafts(trial), de.simulate_drafts(trial)
    assert [(r["draft"], r["tree"], r["steps"]) for r in real] == [(r["draft"], r["tree"], r["steps"]) for r in sim]


def test_distillation_brings_the_draft_closer_to_the_target(tmp_path, monkeypatch):
    """What distillation is for, measured independently of its own loss: on a continuation the
    target writes for a prompt it never trained on, the distilled draft's next-token
    distribution is closer (KL) to the target's than the draft it started from."""
    from arborspec.tools.train.distill_corpus import causal_forward

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    target, folder = _tiny_target(tmp_path)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"ids": [i, i + 1, i + 2]} for i in range(1, 40, 3)]))
    out = tmp_path / "draft"
    args = ["--model", str(folder), "--layers", "1", "--steps", "40", "--seq-len", "16", "--batch", "4"]
    args += ["--corpus-tokens", "512", "--gen-len", "24", "--topk", "8", "--prompts", str(prompts)]
    assert cli.main(args + ["--corpus", str(tmp_path / "c.json"), "--out", str(out), "--quiet"]) == 0

    ids = torch.tensor([[90, 91, 92]])
    with torch.no_grad():
        for _ in range(29):  # the target's own greedy continuation of an unseen prompt
            ids = torch.cat([ids, causal_forward(target, ids)[:, -1:].argmax(-1)], 1)
        p_log = torch.log_softmax(causal_forward(target, ids), -1)

        def kl_to_target(module) -> float:
            q_log = torch.log_softmax(causal_forward(module, ids), -1)
            return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())

        before = kl_to_target(dd.make_draft(target, 1, "target").eval())
        after = kl_to_target(load_model(out).module.eval())
    assert after < 0.9 * before, (before, after)
