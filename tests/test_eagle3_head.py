"""EAGLE-3 head: loader + forward against a plain re-implementation of the published forward."""
import json

import pytest
import torch

from arborspec.models.eagle3 import Eagle3Config, Eagle3Head, load_eagle3, save_eagle3
from arborspec.runtime.errors import ArborspecError

H, HT, V, VD, NH, NKV, HD, I = 32, 24, 50, 20, 4, 2, 8, 48


def _ckpt(tmp_path, fmt="safetensors"):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    sd = {
        "fc.weight": r(H, 3 * HT),
        "midlayer.hidden_norm.weight": 1 + r(H), "midlayer.input_layernorm.weight": 1 + r(H),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(NKV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, NH * HD),
        "midlayer.mlp.gate_proj.weight": r(I, H), "midlayer.mlp.up_proj.weight": r(I, H),
        "midlayer.mlp.down_proj.weight": r(H, I),
        "norm.weight": 1 + r(H), "lm_head.weight": r(VD, H),
    }
    keep = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    sd["d2t"] = keep - torch.arange(VD)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    sd["t2d"] = t2d
    cfg = {"hidden_size": H, "target_hidden_size": HT, "vocab_size": V, "draft_vocab_size": VD,
           "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
           "intermediate_size": I, "rope_theta": 500.0, "rms_norm_eps": 1e-5,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, str(tmp_path / "model.safetensors"))
    else:
        torch.save(sd, str(tmp_path / "pytorch_model.bin"))
    return sd, keep


def _ref(sd, embed, ids, feats, pos):
    """Published EAGLE-3 forward, full causal attention over T tokens, no cache."""
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    hid = feats @ sd["fc.weight"].T
    x = torch.cat([rms(embed[ids], sd["midlayer.input_layernorm.weight"]),
                   rms(hid, sd["midlayer.hidden_norm.weight"])], -1)
    b, t, _ = x.shape
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(b, t, NH, HD).transpose(1, 2)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(b, t, NKV, HD).transpose(1, 2)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(b, t, NKV, HD).transpose(1, 2)
    inv = 1.0 / (500.0 ** (torch.arange(0, HD, 2).float() / HD))
    f = pos.float()[..., None] * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = lambda z: torch.cat([-z[..., HD // 2:], z[..., :HD // 2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = hid + att.transpose(1, 2).reshape(b, t, NH * HD) @ sd["midlayer.self_attn.o_proj.weight"].T
    y = rms(h, sd["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ sd["midlayer.mlp.gate_proj.weight"].T) * (y @ sd["midlayer.mlp.up_proj.weight"].T))
    h = h + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T, h


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_forward_matches_reference_with_cache(tmp_path, fmt):
    sd, keep = _ckpt(tmp_path, fmt)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    head = load_eagle3(tmp_path, embed, HT, V, target_layers=8)
    assert torch.equal(head.token_map(), keep)
    T, P = 7, 4
    ids = torch.randint(0, V, (1, T))
    feats = torch.randn(1, T, 3 * HT)
    pos = torch.arange(T)[None]
    ref_logits, ref_h = _ref(sd, embed, ids, feats, pos)
    hid = head.project(feats)
    with torch.no_grad():
        # prefill P tokens, then the rest against the cache
        m1 = torch.tril(torch.ones(P, P, dtype=torch.bool))[None]
        e = torch.zeros(0, 1, NKV, HD)
        l1, h1, k1, v1 = head(ids[:, :P], hid[:, :P], pos[:, :P], m1, e, e)
        m2 = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, P:]
        l2, h2, k2, v2 = head(ids[:, P:], hid[:, P:], pos[:, P:], m2, k1, v1)
    assert l1.dtype == torch.float32 and l1.shape == (1, P, VD) and k1.shape == (P, 1, NKV, HD)
    torch.testing.assert_close(torch.cat([l1, l2], 1), ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([h1, h2], 1), ref_h, atol=1e-4, rtol=1e-4)


def test_roundtrip_save(tmp_path):
    (tmp_path / "a").mkdir()
    _ckpt(tmp_path / "a")
    embed = torch.randn(V, H)
    head = load_eagle3(tmp_path / "a", embed, HT, V)
    save_eagle3(head, tmp_path / "b")
    head2 = load_eagle3(tmp_path / "b", embed, HT, V)
    for k, v in head.state_dict().items():
        assert torch.equal(v, head2.state_dict()[k]), k


def test_mismatch_and_corrupt_errors(tmp_path):
    _ckpt(tmp_path)
    embed = torch.randn(V, H)
    with pytest.raises(ArborspecError, match="hidden size"):
        load_eagle3(tmp_path, embed, HT + 1, V)
    with pytest.raises(ArborspecError, match="vocabulary"):
        load_eagle3(tmp_path, embed, HT, V + 1)
    with pytest.raises(ArborspecError, match="layer ids"):
        load_eagle3(tmp_path, embed, HT, V, target_layers=4)
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ArborspecError, match="could not be read"):
        load_eagle3(tmp_path, embed, HT, V)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ArborspecError, match="neither"):
        load_eagle3(tmp_path, embed, HT, V)
