"""The prompts of the kinds users send (tools/train/kinds.py) and the per-kind held-out report:
deterministic streams, held out by source (no held-out prompt, or 6-word run of one, in the
training stream), a corpus shard of the kinds stream, and the agreement per kind."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from arborspec.tools.train import eagle3_heldout as eh
from arborspec.tools.train import kinds

N_TRAIN = 400  # training prompts the checks draw (each ~10 ms)


@pytest.fixture(scope="module")
def train_stream():
    return [kinds.train_prompt(i, 0) for i in range(N_TRAIN)]


def test_the_streams_are_functions_of_index_and_seed(train_stream):
    assert [kinds.train_prompt(i, 0) for i in (0, 7, 123)] == [train_stream[i] for i in (0, 7, 123)]
    assert [kinds.train_prompt(i, 1)["text"] for i in range(20)] != [p["text"] for p in train_stream[:20]]
    assert kinds.heldout_set(3, 0) == kinds.heldout_set(3, 0)
    assert kinds.heldout_set(3, 0) != kinds.benchmark_prompts(3)
    counts = {k: sum(p["kind"] == k for p in train_stream) for k in kinds.KINDS}
    assert all(c > 0.1 * N_TRAIN for c in counts.values()), counts  # every kind, near its share
    assert len({p["text"] for p in train_stream}) > 0.95 * N_TRAIN  # varied, not a few templates


def test_each_kind_asks_what_it_says(train_stream):
    by = {k: [p for p in train_stream if p["kind"] == k] for k in kinds.KINDS}
    assert all(any(lang in p["text"] for lang in kinds.LANGUAGES + ["English"]) for p in by["translation"])
    assert all(p["text"].endswith((".", "?", "!", '"')) and len(p["text"]) < 200 for p in by["qa"])
    assert all(any(ch.isdigit() for ch in p["text"]) for p in by["math"])
    assert all(len(p["text"]) >= 1500 and p["content"] in p["text"] for p in by["long_summary"])
    for p in by["retrieval"]:  # the passages are in the request, and the question's term in one of them
        assert p["content"].split("\n\n")[0] in p["text"]


def test_heldout_prompts_come_from_heldout_sources_only_and_train_prompts_never(train_stream):
    held = kinds.heldout_set() + kinds.benchmark_prompts()
    assert {p["kind"] for p in held} == set(kinds.KINDS)
    assert all(kinds.split_of(p["source"]) == "heldout" for p in held)
    assert all(kinds.split_of(p["source"]) == "train" for p in train_stream)
    assert all(p["source"].startswith("stdlib:") for p in held if p["kind"] in ("long_summary", "retrieval"))
    texts = {p["text"] for p in held}
    assert not texts & {p["text"] for p in train_stream}
    apart = set().union(*(kinds.shingles(p["content"]) for p in held))
    assert apart <= kinds.kept_apart()
    for p in train_stream:
        assert not kinds.shingles(p["text"]) & kinds.kept_apart(), p["text"][:80]
    # the check sees an overlap where there is one: a held-out document's text in a request
    doc = next(p for p in held if p["kind"] == "long_summary")
    assert kinds.shingles("Summarise this:\n\n" + doc["content"]) & kinds.kept_apart()


def test_the_chat_heldout_set_and_benchmark_prompts_are_kept_apart_too():
    from arborspec.tools.prompts import heldout_prompts_path, read_prompts_file

    for path in (heldout_prompts_path(), None):
        for e in read_prompts_file(path)[0]:
            assert kinds.shingles(e.get("text", "")) <= kinds.kept_apart()


def test_split_is_stable_and_holds_out_about_one_in_six():
    ids = [f"item-{i}" for i in range(3000)]
    share = sum(kinds.split_of(i) == "heldout" for i in ids) / len(ids)
    assert abs(share - 1 / kinds.HELDOUT_SHARE) < 0.03
    assert kinds.split_of("stdlib:json") == kinds.split_of("stdlib:json")


def test_excerpt_keeps_whole_paragraphs_within_the_bounds():
    text = "\n\n".join(f"Paragraph {i} " + "word " * 60 for i in range(40))
    rnd = random.Random(0)
    for _ in range(20):
        e = kinds.excerpt(text, rnd, 1500, 2500)
        assert 1500 <= len(e) <= 2500 + 400 and all(p in text.split("\n\n") for p in e.split("\n\n"))


def test_kinds_cli_writes_a_prompts_file_and_refuses_bad_numbers(tmp_path, capsys):
    out = tmp_path / "h.json"
    assert kinds.main(["heldout", "--per-kind", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["chat"] is True and len(doc["prompts"]) == 2 * len(kinds.KINDS)
    assert kinds.main(["train", "-n", "0"]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_kinds_shard_asks_the_stream_and_records_each_prompts_kind(tmp_path):
    from test_eagle3_train import _tiny_loaded

    from arborspec.models.eagle3 import default_aux_layers
    from arborspec.tools.train import eagle3_corpus as ec

    lm = _tiny_loaded(3)
    aux = default_aux_layers(lm.config.n_layers)
    kw = dict(shard_prompts=6, gen_len=4, batch=3, window=32, draft_vocab=32, topk=4, seed=0)
    c = ec.grow_corpus(
        lm, aux, root=tmp_path / "c", total_tokens=1, minutes=5, prompt_source="kinds", first_prompt=40, **kw
    )
    shard = json.loads((ec.shard_dirs(c)[0] / "shard.json").read_text())
    want = [kinds.train_prompt(i, 0) for i in range(40, 46)]
    assert shard["prompt_source"] == "kinds" and shard["prompts"] == [40, 46]
    assert shard["prompt_texts"] == [p["text"] for p in want]
    assert shard["prompt_kinds"] == [p["kind"] for p in want]
    # the tiny target's 512 positions hold the short kinds, not the long documents
    fits = [
        p
        for p in want
        if len(ec.chat_ids(lm.tokenizer, p["text"])) + 4 <= ec.graph_context(lm.config, ec.corpus_settings(c))
    ]
    assert shard["prompts_too_long"] == len(want) - len(fits)
    asked = {p["kind"] for p in fits}
    assert set(shard["kind_tokens"]) == asked  # each asked kind's prompt + response + separator
    prompt_tokens = sum(len(ec.chat_ids(lm.tokenizer, p["text"])) + 1 for p in fits)  # + its separator
    assert sum(shard["kind_tokens"].values()) == prompt_tokens + shard["generated_tokens"]
    tokens = np.load(ec.shard_dirs(c)[0] / "tokens.npy").reshape(-1).tolist()
    first = ec.chat_ids(lm.tokenizer, fits[0]["text"])
    assert any(tokens[i : i + len(first)] == first for i in range(len(tokens)))


def _rows(ranks_by_row):
    """depth_ranks-shaped rows: each [steps][W] ranks, response span (2, W)."""
    return [(r, 2, len(r[0])) for r in ranks_by_row]


def test_the_per_kind_breakdown_measures_each_kinds_rows_alone():
    rng = np.random.default_rng(0)
    rows = _rows([rng.integers(0, 3, size=(4, 30)).tolist() for _ in range(6)])
    kinds_of = ["math", "qa", "math", "qa", "qa", "retrieval"]
    per = eh.kind_breakdown(rows, kinds_of, 4)
    assert sorted(per) == ["math", "qa", "retrieval"]
    for kind in per:
        alone = eh.chain_measure([r for r, k in zip(rows, kinds_of) if k == kind], 4)
        assert per[kind] == alone
    # an all-hit kind drafts the whole chain, an all-miss kind nothing
    hit, miss = [[0] * 20 for _ in range(4)], [[5] * 20 for _ in range(4)]
    per = eh.kind_breakdown(_rows([hit, miss]), ["a", "b"], 4)
    assert per["a"]["top1_agreement_per_depth"] == [1.0] * 4 and per["a"]["expected_accepted_chain"] == 5.0
    assert per["a"]["tokens_per_step"][eh.SINGLE] == pytest.approx(2.0, abs=0.1)
    assert per["b"]["top1_agreement_per_depth"] == [0.0] * 4 and per["b"]["tokens_per_step"][eh.SINGLE] == 1.0
    table = eh.report_table({"h": per})
    assert "| h | a |" in table and "1.000 / 1.000 / 1.000 / 1.000" in table


def test_a_heldout_set_with_kinds_reports_each_kind(tmp_path):
    """evaluate_heldout on a set whose rows carry the new kinds: `per_kind` holds one measure per
    kind, equal to the measure of that kind's rows alone (depth_ranks), and `top1_per_kind` its
    agreement."""
    import torch
    from test_eagle3_train import _tiny_loaded

    from arborspec.models.eagle3 import default_aux_layers
    from arborspec.tools.train import eagle3_train
    from arborspec.tools.train.eagle3_corpus import target_graph

    lm = _tiny_loaded(5)
    aux = default_aux_layers(lm.config.n_layers)
    short = [p for p in kinds.heldout_set(3) if p["kind"] in ("qa", "math")]
    graph = target_graph(lm.module, lm.config, 400, aux, tmp_path / "t.onnx")
    folder = eh.build_heldout(lm, aux, graph, tmp_path / "h", gen_len=16, prompts=short)
    torch.manual_seed(0)
    vocab = np.arange(lm.config.vocab_size, dtype=np.int64)[:64]
    head = eagle3_train.init_head(lm.config, lm.module, aux, vocab, 0).eval()
    embed = lm.module.model.embed_tokens.weight.detach().float()
    res = eh.evaluate_heldout(head, embed, folder, 4)
    assert sorted(res["per_kind"]) == ["math", "qa"]
    rows = eh.depth_ranks(head, embed, folder, 4)
    kinds_of = [p["kind"] for p in short]
    for kind in ("math", "qa"):
        assert res["per_kind"][kind] == eh.chain_measure([r for r, k in zip(rows, kinds_of) if k == kind], 4)
        assert res["top1_per_kind"][kind] == res["per_kind"][kind]["top1_agreement_per_depth"]
    assert sum(m["positions"] for m in res["per_kind"].values()) == res["positions"]


def test_the_kinds_report_measures_every_head_on_each_kind_that_fits(tmp_path, monkeypatch, capsys):
    """kinds_report over a tiny target: the chat set's kinds and "all", and each new kind whose
    prompts fit its 512 positions (the long documents do not: left out); the CLI prints the table,
    writes the JSON, and a head folder that is not one is one error line."""
    from test_eagle3_train import _tiny_loaded

    from arborspec.models.eagle3 import default_aux_layers
    from arborspec.tools.train import eagle3_train

    lm = _tiny_loaded(6)
    aux = default_aux_layers(lm.config.n_layers)
    few = [p for p in kinds.heldout_set(2) if p["kind"] in ("qa", "math", "long_summary")]
    monkeypatch.setattr(kinds, "heldout_set", lambda per_kind=10, seed=0: few)
    monkeypatch.setattr(
        eh, "heldout_prompts", lambda path=None: eh.json.loads(eh.PROMPTS_PATH.read_text())["prompts"][:3]
    )
    vocab = np.arange(64, dtype=np.int64)
    heads = {f"h{s}": eagle3_train.init_head(lm.config, lm.module, aux, vocab, s).eval() for s in (0, 1)}
    rep = eh.kinds_report(lm, heads, per_kind=2, root=tmp_path / "h")
    assert list(rep) == ["h0", "h1"]
    for row in rep.values():
        assert {"all", "qa", "math"} <= set(row) and "long_summary" not in row
        assert row["qa"]["positions"] > 0 and len(row["qa"]["top1_agreement_per_depth"]) == 4
    folders = eh.kinds_heldout(lm, aux, None, tmp_path / "h", per_kind=2)  # cached: built by the report
    embed = lm.module.model.embed_tokens.weight.detach().float()
    for name, head in heads.items():  # each head measured on its own
        got = dict(rep[name]["math"])
        assert 0.0 <= got.pop("greedy_in_vocab") <= 1.0
        assert got == eh.chain_measure(eh.depth_ranks(head, embed, folders["math"]), 4)
    # the vocabulary ceiling: a draft vocabulary of every token holds every greedy token, none holds none
    every = np.arange(lm.config.vocab_size)
    assert eh.in_vocab_by_kind(folders["qa"], every) == {"qa": 1.0}
    assert eh.in_vocab_by_kind(folders["qa"], np.array([-1])) == {"qa": 0.0}
    chat = eh.in_vocab_by_kind(eh.build_heldout(lm, aux, None, tmp_path / "h"), vocab)
    assert set(chat) == {p["kind"] for p in eh.heldout_prompts()} and rep["h0"]["all"]["greedy_in_vocab"] <= 1.0
    assert eh.main(["--model", "smollm2-135m", "--heads", str(tmp_path)]) == 2
    assert "no model.safetensors there" in capsys.readouterr().err


def test_corpus_stats_count_each_source_and_kind(tmp_path, capsys):
    from arborspec.tools.train import corpus_ids

    records = [
        {"prompts": [0, 4], "prompt_source": "self", "tokens": 100},
        {"prompts": [4, 7], "prompt_source": "kinds", "tokens": 64, "prompt_kinds": ["qa", "math", "qa"],
         "kind_tokens": {"qa": 40, "math": 30}},
        {"prompts": [7, 9], "prompt_source": "kinds", "tokens": 32, "prompt_kinds": ["math", "retrieval"],
         "kind_tokens": {"math": 20}},
    ]  # fmt: skip
    for i, r in enumerate(records):
        d = tmp_path / "shards" / f"{i:05d}"
        d.mkdir(parents=True)
        (d / "shard.json").write_text(json.dumps(r))
    got = corpus_ids.corpus_stats(tmp_path)
    assert got["sources"]["self"] == {"shards": 1, "prompts": 4, "tokens": 100, "featurised": 0}
    assert got["sources"]["kinds"] == {"shards": 2, "prompts": 5, "tokens": 96, "featurised": 0}
    assert got["kinds"] == {
        "math": {"prompts": 2, "tokens": 50},
        "qa": {"prompts": 2, "tokens": 40},
        "retrieval": {"prompts": 1, "tokens": 0},
    }
    assert list(corpus_ids.corpus_stats(tmp_path, range(2, 3))["sources"]) == ["kinds"]
    assert corpus_ids.main(["stats", "--corpus", str(tmp_path)]) == 2  # no settings.json: one line
    assert "not a train-draft corpus" in capsys.readouterr().err


def test_prose_drops_markup_paragraphs():
    text = (
        "A library for parsing things, with a small and friendly interface.\n\n"
        '<div align="center"><img src="x.svg"></div>\n\n'
        "|PyPi|_ |Conda|_\n\n"
        "![badge](https://example.org/b.svg)\n\n"
        "Install it with pip and import it in your program to get started."
    )
    assert kinds.prose(text).split("\n\n") == [
        "A library for parsing things, with a small and friendly interface.",
        "Install it with pip and import it in your program to get started.",
    ]
