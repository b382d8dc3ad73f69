"""The model families users deploy, each against transformers itself on a tiny random checkpoint
that transformers writes here (config + save_pretrained, no hub), loaded by our HF loader:

* logits: a prompt longer than the sliding window / past original_max_position_embeddings
  (one forward) within fp32 tolerance; then a random tree on top of our cache, each node's
  logits against transformers' forward of prompt + that node's path (no cache, no custom mask:
  transformers builds its own causal / sliding-window mask);
* greedy: our vanilla decoding on torch == transformers' `generate`, token for token;
* ONNX: the GroupQueryAttention graph and the portable graph, tree decoding with a 1-layer
  self-draft == those same tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import truncated  # noqa: E402
from test_models import random_tree, tree_mask_and_depth  # noqa: E402

from arborspec.models.hf_loader import config_from_hf, load_hf_folder  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402

TOL = 1e-4
COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,  # peaked distributions: greedy far from ties
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)


def _hf_model(kind: str):
    T = transformers
    if kind == "llama3":
        return T.LlamaForCausalLM(T.LlamaConfig(**COMMON, rope_parameters=LLAMA3))
    if kind == "llama-linear":
        return T.LlamaForCausalLM(
            T.LlamaConfig(**COMMON, rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=3.0))
        )
    if kind == "llama-yarn":
        return T.LlamaForCausalLM(T.LlamaConfig(**COMMON, rope_parameters=YARN))
    if kind == "qwen2.5":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=1e6)))
    if kind == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=32, rope_parameters=YARN))
    if kind == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=8))
    if kind == "qwen2-sliding":  # Qwen's use_sliding_window: layers from max_window_layers on slide
        return T.Qwen2ForCausalLM(
            T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1)
        )
    if kind.startswith(("phi3", "phi4")):  # fused projections, longrope; Phi-4-mini: partial rotary, tied
        rot = 16  # of 16 (phi4-mini: 48 of 64, 0.75 as Phi-4-mini's 96 of 128)
        long = [1.5 + 0.7 * i for i in range(rot // 2)]
        rope = dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=long if kind == "phi3-long" else [1.0 + 0.1 * i for i in range(rot // 2)],
            long_factor=long,
            partial_rotary_factor=1.0,
        )
        c = {**COMMON, "tie_word_embeddings": False, "pad_token_id": 0}
        if kind == "phi4-mini":
            c.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
            rot = 48
            rope.update(
                short_factor=[1.0 + 0.05 * i for i in range(rot // 2)],
                long_factor=[1.5 + 0.2 * i for i in range(rot // 2)],
                partial_rotary_factor=0.75,
            )
        return T.Phi3ForCausalLM(
            T.Phi3Config(**c, rope_parameters=rope, original_max_position_embeddings=32, sliding_window=12)
        )
    raise KeyError(kind)


# prompt length (past the sliding window, 8 or 12, or the original context, 32), new tokens.
# longrope (phi3, phi4-mini) stays below the original context: once a sequence passes it,
# transformers' Phi-3 `generate` drops the cache and re-rotates every earlier token with the long
# factors, where we rotate each position by its own factor set (models/rope.py); phi3-long has
# short == long factors, so both rules agree and the long set is checked past 32.
FAMILIES = {
    "llama3": (44, 24),
    "llama-linear": (20, 24),
    "llama-yarn": (44, 24),
    "qwen2.5": (20, 24),
    "qwen3": (44, 24),
    "mistral": (20, 24),
    "qwen2-sliding": (20, 24),
    "phi3": (20, 12),
    "phi4-mini": (20, 12),
    "phi3-long": (44, 24),
}


def make_family(kind: str, tmp_path):
    torch.manual_seed(0)
    hf = _hf_model(kind).eval()
    with torch.no_grad():  # random init leaves biases at zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    path = tmp_path / kind
    hf.save_pretrained(path, safe_serialization=True)
    ours, cfg = load_hf_folder(path)
    return hf, ours, cfg


@torch.no_grad()
def check_logits(hf, ours, cfg, length: int, t: int = 7, seed: int = 0):
    """One long prefill, then a tree whose every node is checked against its own path."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (1, length), generator=g)
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None]
    empty = [torch.zeros(0, 1, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers)
    out = ours(ids, torch.arange(length)[None], mask, *empty)
    ref = hf(input_ids=ids).logits
    assert (out[0] - ref).abs().max() < TOL
    parents = random_tree(t, g)
    anc, depth = tree_mask_and_depth(parents)
    tids = torch.randint(3, cfg.vocab_size, (1, t), generator=g)
    tmask = torch.cat([torch.ones(t, length, dtype=torch.bool), anc], 1)[None]
    tree = ours(tids, (length + depth)[None], tmask, *out[1:])[0]
    for i in range(t):
        path = tids[0, anc[i]]  # the node's ancestors and itself, in depth order
        seq = torch.cat([ids[0], path])[None]
        assert (tree[0, i] - hf(input_ids=seq).logits[0, -1]).abs().max() < TOL, f"tree node {i}"


def greedy_tokens(hf, ours, n: int = 24, prompt_len: int = 20):
    prompt = [int(x) for x in torch.randint(3, ours.config.vocab_size, (prompt_len,), generator=torch.Generator())]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, prompt_len:].tolist()
    mine = SpeculativeDecoder(TorchEngine(ours), mode="vanilla").generate(prompt, n).tokens
    return prompt, mine, theirs


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_family_matches_transformers(kind, tmp_path):
    hf, ours, cfg = make_family(kind, tmp_path)
    prompt_len, n_new = FAMILIES[kind]
    check_logits(hf, ours, cfg, prompt_len)
    prompt, mine, theirs = greedy_tokens(hf, ours, n_new, prompt_len)
    assert mine == theirs


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "mistral", "qwen2-sliding", "phi3", "phi4-mini"])
def test_family_onnx_tree_equals_vanilla(kind, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from arborspec.export.onnx_export import export_contract_onnx, export_gqa_onnx
    from arborspec.runtime.backends.onnxruntime import OrtEngine

    hf, ours, cfg = make_family(kind, tmp_path)
    prompt_len = FAMILIES[kind][0]
    prompt = [int(x) for x in torch.randint(3, cfg.vocab_size, (prompt_len,), generator=torch.Generator())]
    ref = SpeculativeDecoder(TorchEngine(ours), mode="vanilla").generate(prompt, 20).tokens
    draft = TorchEngine(truncated(ours, 1))
    export_gqa_onnx(ours, tmp_path / "gqa.onnx", max_context=128)
    export_contract_onnx(ours, tmp_path / "portable.onnx", max_context=128)
    for graph in ("gqa.onnx", "portable.onnx"):
        engine = OrtEngine(tmp_path / graph)
        for spec in ("full:2,3", "dynamic:3,3,8"):
            assert SpeculativeDecoder(engine, draft, tree=spec).generate(prompt, 20).tokens == ref, (graph, spec)
        engine.close()


def test_rope_and_family_config_errors():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    with pytest.raises(ValueError, match="'dynamic'"):
        config_from_hf({**base, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="model_type 'mixtral'.*mixture-of-experts"):
        config_from_hf({**base, "model_type": "mixtral"})
    cfg = config_from_hf({**base, "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    cfg = config_from_hf({**base, "model_type": "qwen3", "use_sliding_window": False, "sliding_window": 4})
    assert cfg.qk_norm and cfg.sliding_window == 0
    trunc = dataclasses.replace(cfg, sliding_window=4, layer_types=["full_attention"]).truncated(1)
    assert not trunc.is_sliding(0)
