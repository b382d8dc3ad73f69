"""The draft vocabulary chosen from the target's own answers per kind (vocab_choice, issue 67
item 2): responses found again in a shard's stream, counts per kind, the choice weighing each kind
the same, coverage per kind, the head written over the new vocabulary (kept rows bit for bit, new
rows from the target's tied rows through the kept rows' map), the CLI's help and one-line
errors, and training beside `featurise` (--featurised-prefix)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import random_model, tiny_config

from arborspec.models.eagle3 import default_aux_layers, load_eagle3
from arborspec.runtime.errors import InputError
from arborspec.tools.train import eagle3_train
from arborspec.tools.train import vocab_choice as vc

EOS = 2


def test_responses_are_found_after_their_prompts_up_to_eos_and_a_cut_tail():
    prompts = [[5, 6, 7], [8, 9], [5, 5, 5, 5]]
    stream = np.array([5, 6, 7, 10, 11, EOS, EOS, 8, 9, 12, EOS, 5, 5, 5, 5, 13, 14])  # row 2 cut by the windows
    rows = vc.response_rows(stream, prompts, {EOS})
    assert [(r, ids.tolist()) for r, ids in rows] == [(0, [10, 11]), (1, [12]), (2, [13, 14])]
    assert len(vc.response_rows(stream[:13], prompts, {EOS})) == 2  # the windows end inside prompt 2
    with pytest.raises(ValueError, match="row 1: the stream does not hold its prompt"):
        vc.response_rows(stream, [[5, 6, 7], [9, 9]], {EOS})


def test_a_shards_responses_carry_their_kind_and_whether_greedy(tmp_path):
    """Prompts too long for the graph were left out of the stream; the first half of a shard's
    prompts (before that) were answered greedily."""
    texts = ["a", "b", "long", "c"]
    ids = {"a": [5, 6], "b": [7], "long": [9] * 50, "c": [8, 8]}
    stream = [5, 6, 20, EOS, EOS, 7, 21, 22, EOS, 8, 8, 23, EOS, EOS, 0]
    d = tmp_path / "00000"
    d.mkdir()
    np.save(d / "tokens.npy", np.array(stream[:15], dtype=np.int32).reshape(3, 5))
    info = {"prompt_texts": texts, "prompt_kinds": ["qa", "math", "qa", "qa"]}
    (d / "shard.json").write_text(json.dumps(info))
    rows = vc.shard_responses(d, ids.get, 10, {EOS})
    assert [(k, g, r.tolist()) for k, g, r in rows] == [("qa", True, [20]), ("math", True, [21, 22]), ("qa", False, [23])]
    counts = vc.kind_counts(rows, 30)
    assert set(counts) == {"qa", "math"} and counts["qa"][20] == 1 and counts["qa"][23] == 0
    assert vc.kind_counts(rows, 30, greedy_only=False)["qa"][23] == 1
    del info["prompt_kinds"]
    (d / "shard.json").write_text(json.dumps(info))
    assert {k for k, _, _ in vc.shard_responses(d, ids.get, 10, {EOS})} == {vc.CHAT}


def test_each_kind_weighs_the_same_and_coverage_is_per_kind():
    chat = np.zeros(10, dtype=np.int64)
    chat[[3, 4, 5]] = [1000, 500, 10]
    tr = np.zeros(10, dtype=np.int64)
    tr[[6, 7]] = [3, 1]
    counts = {"chat": chat, "translation": tr}
    # shares: chat 3: .66, 4: .33, 5: .0066; translation 6: .75, 7: .25 -> mean over the kinds
    assert vc.choose_vocab(counts, 3).tolist() == [6, 3, 4]
    assert vc.choose_vocab(counts, 4).tolist() == [6, 3, 4, 7]  # the rare kind's token above chat's 10
    assert vc.choose_vocab(counts, 3, always=[EOS]).tolist() == [EOS, 6, 3]
    cov = vc.coverage(np.array([3, 6]), counts)
    assert cov == {"chat": round(1000 / 1510, 4), "translation": 0.75}
    table = vc.sizes_table(counts, [2, 5], current=np.array([3, 4, 5]))
    assert table["current-3"] == {"chat": 1.0, "translation": 0.0}
    assert table["kinds-5"] == {"chat": 1.0, "translation": 1.0}
    with pytest.raises(ValueError, match="no token counted"):
        vc.choose_vocab({"chat": np.zeros(4, dtype=np.int64)}, 2)


def _head(seed=0):
    cfg = tiny_config("llama", hidden=16, heads=2, kv=1)
    target = random_model(cfg, seed)
    vocab = np.random.default_rng(seed).permutation(cfg.vocab_size)[:60].astype(np.int64)
    head = eagle3_train.init_head(cfg, target, default_aux_layers(cfg.n_layers), vocab, seed).eval()
    return cfg, target, head


@torch.no_grad()
def test_the_written_head_keeps_old_rows_bit_for_bit_and_maps_new_ones_from_the_target(tmp_path):
    """Old rows as they were (fp16 on disk both times); a new token's row is its target row
    (the tied embedding) through the linear map that takes the kept tokens' target rows to their
    trained rows: exact here, where the trained rows are such a map of the target's."""
    cfg, target, head = _head()
    tied = target.lm_head.weight.detach().float()
    m = torch.randn(cfg.hidden_size, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    old = head.token_map().numpy()
    head.lm_head.weight.copy_((tied[torch.from_numpy(old)] @ m).half().float())  # "trained" rows
    fresh = np.setdiff1d(np.arange(cfg.vocab_size), old)[:20]
    vocab = np.concatenate([fresh[:10], old[:40], fresh[10:]])  # 40 kept (>= 2 x hidden), 20 new
    info = vc.write_head(SimpleNamespace(module=target), head, vocab, tmp_path / "h")
    assert info["new_tokens"] == 20 and info["draft_vocab"] == 60
    new = load_eagle3(tmp_path / "h", cfg).float()
    assert new.token_map().tolist() == vocab.tolist()
    w_old, w_new = head.lm_head.weight, new.lm_head.weight
    assert torch.equal(w_new[10:50], w_old[:40])  # bit for bit
    want = tied[torch.from_numpy(vocab[np.r_[0:10, 50:60]])] @ m
    torch.testing.assert_close(w_new[np.r_[0:10, 50:60]], want, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(w_new[:10], tied[torch.from_numpy(fresh[:10])], atol=1e-1)  # not the raw rows


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "arborspec.tools.train.vocab_choice", *args], capture_output=True, text=True
    )


def test_cli_help_and_one_line_errors(tmp_path):
    h = _cli("--help")
    assert h.returncode == 0 and "example:" in h.stdout and "--write-head" in h.stdout
    (tmp_path / "settings.json").write_text("{}")
    for args, msg in (
        (["--corpus", str(tmp_path / "none")], "not a corpus folder"),
        (["--corpus", str(tmp_path), "--sizes", "0"], "--sizes must be >= 1"),
        (["--corpus", str(tmp_path), "--size", "8"], "--write-head and --size go together"),
        (["--corpus", str(tmp_path), "--head", str(tmp_path)], "no model.safetensors there"),
    ):
        r = _cli("--model", "smollm2-135m", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("vocab_choice: error: "), r.stderr
        assert msg in lines[0]


def test_training_beside_featurise_reads_the_featurised_prefix(tmp_path):
    """--featurised-prefix: the shards up to the first without features (later ones join a later
    run at the end of the index); without it, an ids-only shard is one clear error."""
    from test_eagle3_train import _synthetic_corpus

    cfg, target, head = _head()
    _synthetic_corpus(tmp_path, cfg, target, head, n=12, shards=(4, 4, 4))
    for name in ("features", "top_ids", "top_lp", "top1"):
        (tmp_path / "shards" / "00001" / f"{name}.npy").unlink()
    (tmp_path / "shards" / "00001" / "shard.json").write_text("{}")
    assert len(eagle3_train.ShardData(tmp_path, prefix=True)) == 4
    with pytest.raises(InputError, match="holds token ids only"):
        eagle3_train.ShardData(tmp_path)
    (tmp_path / "w").mkdir()
    names = ("features", "top_ids", "top_lp", "top1")
    saved = {n: np.load(tmp_path / "shards" / "00002" / f"{n}.npy") for n in names}
    for n in names:
        (tmp_path / "shards" / "00002" / f"{n}.npy").unlink()  # shards 1 and 2: ids only
    run = eagle3_train._TrainingRun(
        head, torch.zeros(cfg.vocab_size, cfg.hidden_size), tmp_path, tmp_path / "w",
        eagle3_train.TrainConfig(steps=2, batch=2, progress=False, featurised_prefix=True),
    )
    assert len(run.data) == 4 and max(run.next_batch().max() for _ in range(2)) < 4  # epoch 0: shard 0
    run.next_batch()
    assert run.epoch == 1 and len(run.data) == 4
    kw = dict(steps=2, batch=2, minutes=1, progress=False, featurised_prefix=True, shards=range(1, 3))
    with pytest.raises(InputError, match=r"no featurised shard in those shards yet \(--featurised-prefix\)"):
        eagle3_train.train(head, torch.zeros(cfg.vocab_size, cfg.hidden_size), tmp_path, tmp_path / "w2", **kw)
    for d in ("00001", "00002"):  # `featurise` finishes shards 1 and 2
        for n in names:
            np.save(tmp_path / "shards" / d / f"{n}.npy", saved[n])
    seen = np.concatenate([run.next_batch() for _ in range(3)])
    assert run.epoch == 2 and len(run.data) == 12 and seen.max() >= 4  # they join at the next epoch


def test_revocab_by_kinds_reads_its_counts_cache_on_resume(tmp_path):
    counts = {"chat": np.array([0, 9, 1, 0, 5]), "qa": np.array([0, 0, 0, 2, 0])}
    vc.save_counts(tmp_path / "kind_counts.npz", counts)
    loaded = SimpleNamespace(tokenizer=SimpleNamespace(meta={"eos_token_ids": [0]}))
    got = vc.vocab_for(loaded, tmp_path / "no-corpus", 3, tmp_path / "kind_counts.npz")  # the corpus is not read
    assert got.tolist() == [0, 3, 1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--revocab-by", "kinds"], "--revocab-by chooses how --revocab counts: give --revocab N"),
        (["--init", "eagle3", "--revocab-by", "words"], "invalid choice"),
    ],
)
def test_train_draft_revocab_by_mistakes_are_one_line(tmp_path, capsys, extra, message):
    from arborspec.tools.commands.cli import main

    try:
        rc = main(["train-draft", "--model", "smollm2-135m", "--out", str(tmp_path / "o"), *extra])
    except SystemExit as e:  # argparse's own mistakes (one line, cli._Parser)
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("arborspec: error: ") and message in err[0], err


def test_train_draft_help_names_the_new_flags(capsys):
    from arborspec.tools.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train-draft", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--revocab-by {tokens,kinds}" in out and "--featurised-prefix" in out
