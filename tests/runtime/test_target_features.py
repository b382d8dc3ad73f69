"""Target features for EAGLE-3: hidden states entering layers (2, L//2, L-3), via TorchEngine."""

import torch
from conftest import random_model, tiny_config

from arborspec.models.eagle3 import default_aux_layers as feature_layer_ids
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.kvcache import KVCache


def _mask(p, t):
    return torch.tril(torch.ones(p + t, p + t, dtype=torch.bool))[None, p:]


def test_features_are_layer_inputs_and_logits_unchanged():
    cfg = tiny_config("llama", layers=8)
    m = random_model(cfg, seed=3)
    plain = TorchEngine(m)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    pos = torch.arange(9)[None]
    c0 = KVCache(plain.info.cache, 32)
    ref_logits = plain.forward(ids, pos, _mask(0, 9), c0).clone()
    assert plain.info.n_features == 0
    seen = {}
    hooks = [
        layer.register_forward_pre_hook(lambda mod, a, i=i: seen.__setitem__(i, a[0].clone()))
        for i, layer in enumerate(m.model.layers)
    ]
    m.feature_layers = feature_layer_ids(8)
    assert m.feature_layers == [2, 4, 5]
    eng = TorchEngine(m)
    assert eng.info.n_features == 3 * cfg.hidden_size
    c = KVCache(eng.info.cache, 32)
    logits, feats = eng.forward_features(ids, pos, _mask(0, 9), c)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(feats, torch.cat([seen[2], seen[4], seen[5]], -1))
    # incremental (with cache) == one shot
    c2 = KVCache(eng.info.cache, 32)
    _, f1 = eng.forward_features(ids[:, :5], pos[:, :5], _mask(0, 5), c2)
    c2.commit(None, 5)
    _, f2 = eng.forward_features(ids[:, 5:], pos[:, 5:], _mask(5, 4), c2)
    torch.testing.assert_close(torch.cat([f1, f2], 1), feats, atol=1e-4, rtol=1e-4)
    m.feature_layers = None


def test_feature_layer_ids():
    assert feature_layer_ids(32) == [2, 16, 29]
