"""Reference decoders vs transformers: prefill and one tree step, loaded through our HF loader.

Small random configs (Llama with GQA tied/untied, Qwen2 with attention bias, GPT-2) are saved
with save_pretrained(safe_serialization=True), loaded with arborspec's loader, and compared to
transformers within 1e-4: once for a prefill of P tokens, then for a T-token tree (non-causal
ancestor mask, siblings share a position) on top of that cache, with transformers given a 4-D
additive mask, position_ids and its own past_key_values.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from arborspec.models.hf_loader import load_hf_folder  # noqa: E402

TOL = 1e-4


def random_tree(t: int, gen: torch.Generator) -> torch.Tensor:
    """Parent index per node (-1 = child of the cache's last token); node i's parent < i."""
    parents = [-1]
    for i in range(1, t):
        parents.append(int(torch.randint(-1, i, (1,), generator=gen)))
    return torch.tensor(parents)


def tree_mask_and_depth(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self mask bool [T, T] and depth [T] from parent indices (tests only)."""
    t = len(parents)
    anc = torch.eye(t, dtype=torch.bool)
    depth = torch.zeros(t, dtype=torch.long)
    for i in range(t):
        p = int(parents[i])
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    return anc, depth


def hf_cache_to_ours(cache, n_layers: int) -> list[torch.Tensor]:
    """A transformers cache ([B,Hkv,P,D] per layer) -> our flat [P,B,Hkv,D] list."""
    out = []
    for i in range(n_layers):
        layer = cache.layers[i]
        out += [layer.keys.permute(2, 0, 1, 3).contiguous(), layer.values.permute(2, 0, 1, 3).contiguous()]
    return out


@torch.no_grad()
def compare_with_hf(hf_model, ours, cfg, b: int = 2, p: int = 7, t: int = 6, seed: int = 0, tol: float = TOL):
    """Prefill p tokens then a t-node tree; assert ours == HF logits and new K/V within tol."""
    gen = torch.Generator().manual_seed(seed)
    v = cfg.vocab_size
    ids = torch.randint(0, v, (b, p), generator=gen)
    pos = torch.arange(p).expand(b, p)
    causal = torch.tril(torch.ones(p, p, dtype=torch.bool)).expand(b, p, p)
    empty = [torch.zeros(0, b, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers)
    ours_out = ours(ids, pos, causal, *empty)
    hf_out = hf_model(input_ids=ids, position_ids=pos, use_cache=True)
    assert (ours_out[0] - hf_out.logits).abs().max() < tol
    hf_past = hf_cache_to_ours(hf_out.past_key_values, cfg.n_layers)
    for mine, theirs in zip(ours_out[1:], hf_past):
        assert (mine - theirs).abs().max() < tol

    parents = random_tree(t, gen)
    anc, depth = tree_mask_and_depth(parents)
    tids = torch.randint(0, v, (b, t), generator=gen)
    tpos = (p + depth).expand(b, t)
    mask = torch.cat([torch.ones(t, p, dtype=torch.bool), anc], dim=1).expand(b, t, p + t)
    tree_out = ours(tids, tpos, mask, *ours_out[1:])
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)[:, None]
    hf_tree = hf_model(
        input_ids=tids,
        position_ids=tpos,
        attention_mask=additive,
        past_key_values=hf_out.past_key_values,
        use_cache=True,
    )
    assert (tree_out[0] - hf_tree.logits).abs().max() < tol
    # siblings really share a position and do not see each other: the tree is non-causal
    assert not torch.equal(anc, torch.tril(torch.ones(t, t, dtype=torch.bool))) or t < 3
    return tree_out


def save_hf(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return path


def tiny_llama(tmp_path, tie: bool, kind: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    if kind == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common, rope_theta=50000.0)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    elif kind == "mistral":
        hf_cfg = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(hf_cfg)
    model = model.eval()
    return model, save_hf(model, tmp_path / kind)


def tiny_gpt2(tmp_path, seed: int = 0):
    torch.manual_seed(seed)
    hf_cfg = transformers.GPT2Config(
        vocab_size=101, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(hf_cfg).eval()
    return model, save_hf(model, tmp_path / "gpt2")


@pytest.mark.parametrize("tie", [False, True])
def test_llama_gqa_matches_transformers(tmp_path, tie):
    hf_model, path = tiny_llama(tmp_path, tie)
    ours, cfg = load_hf_folder(path)
    assert (cfg.family, cfg.n_kv_heads, cfg.tie_embeddings) == ("llama", 2, tie)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2, 3]
    compare_with_hf(hf_model, ours, cfg)


def test_qwen2_attention_bias_matches_transformers(tmp_path):
    hf_model, path = tiny_llama(tmp_path, tie=False, kind="qwen2")
    with torch.no_grad():  # random init leaves biases at zero: make them count
        for layer in hf_model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    hf_model.save_pretrained(path, safe_serialization=True)
    ours, cfg = load_hf_folder(path)
    assert cfg.attention_bias and cfg.rope_theta == 50000.0
    compare_with_hf(hf_model, ours, cfg, seed=1)


def test_mistral_loads_as_llama(tmp_path):
    hf_model, path = tiny_llama(tmp_path, tie=False, kind="mistral")
    ours, cfg = load_hf_folder(path)
    assert cfg.family == "llama"
    compare_with_hf(hf_model, ours, cfg, b=1, seed=2)


def test_gpt2_matches_transformers(tmp_path):
    hf_model, path = tiny_gpt2(tmp_path)
    ours, cfg = load_hf_folder(path)
    assert cfg.family == "gpt2" and cfg.tie_embeddings
    compare_with_hf(hf_model, ours, cfg, seed=3)


def test_fully_masked_row_stays_finite(tmp_path):
    hf_model, path = tiny_llama(tmp_path, tie=True)
    ours, cfg = load_hf_folder(path)
    b, t = 1, 3
    mask = torch.zeros(b, t, t, dtype=torch.bool)
    mask[0, 0, 0] = True  # rows 1, 2 see nothing at all
    empty = [torch.zeros(0, b, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers)
    with torch.no_grad():
        out = ours(torch.tensor([[5, 6, 7]]), torch.arange(t)[None], mask, *empty)
    assert all(torch.isfinite(o).all() for o in out)
