"""Shared fixtures: small random contract models (no hub, no downloads)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/<package>/ mirror the package (tests/runtime/test_trees.py tests runtime/trees.py); the shared
# helpers here (this file's fixtures, lossless_util) and the helpers one test file takes from another
# are imported by module name from any of those folders
_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS, *(_TESTS / name for name in ("runtime", "export", "models", "tools"))):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
import os

import torch

from arborspec.models import ModelConfig, build_model
from arborspec.runtime.backends.torch_backend import TorchEngine

# every step drafts its tree in the suite (counts of draft calls and accepted tokens are asserted);
# the governor's own tests (tests/runtime/test_governor.py) turn it on where they need it
os.environ.setdefault("ARBORSPEC_ADAPTIVE", "0")


def tiny_config(family="llama", vocab=96, layers=3, hidden=64, heads=4, kv=2, max_position=512):
    if family == "gpt2":
        kv = heads
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden,
        max_position=max_position,
        name=f"tiny-{family}",
    )


def random_model(cfg: ModelConfig, seed=0, scale=3.0):
    """A random model whose weights are scaled up so its distributions are peaked (like a
    trained model's), which gives drafts something to accept."""
    torch.manual_seed(seed)
    m = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name and "ln_" not in name:
                p.mul_(scale)
    return m


def truncated(module, k: int):
    """layers:K self-draft: the first K layers + final norm + head of `module`."""
    cfg = module.config.truncated(k)
    d = build_model(cfg).eval()
    d.load_state_dict(module.state_dict(), strict=False)
    return d


def varied_model(family: str, seed: int = 0, scale: float = 2.0, **cfg_kw):
    """A random model whose greedy output is varied, not one repeated token: its untied head
    is a random one plus the token embeddings under a random permutation (so the next token
    leans towards perm(current token), bent by the context through attention). Greedy
    decoding from [1, 5, 7, 9, 3, 11] gives >= 30 distinct tokens in 48 (llama and gpt2)."""
    import dataclasses

    cfg = dataclasses.replace(tiny_config(family, **cfg_kw), tie_embeddings=False)
    m = random_model(cfg, seed=seed, scale=scale)
    emb = m.model.embed_tokens.weight if family == "llama" else m.transformer.wte.weight
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        w = m.lm_head.weight
        w.add_(emb[perm] / emb[perm].norm(dim=-1, keepdim=True) * w.norm(dim=-1).mean())
    return m


@pytest.fixture(scope="session")
def varied_llama_pair():
    m = varied_model("llama")
    return TorchEngine(m), TorchEngine(truncated(m, 1))


@pytest.fixture(scope="session")
def varied_gpt2_pair():
    m = varied_model("gpt2")
    return TorchEngine(m), TorchEngine(truncated(m, 1))


@pytest.fixture(scope="session")
def llama_pair():
    m = random_model(tiny_config("llama"))
    return TorchEngine(m), TorchEngine(truncated(m, 1))


@pytest.fixture(scope="session")
def gpt2_pair():
    m = random_model(tiny_config("gpt2"), seed=1)
    return TorchEngine(m), TorchEngine(truncated(m, 1))


def externalize_target(d):
    """Rewrite an export folder's target.onnx with its weights in target.onnx.data and record
    that in the manifest (the layout of a > 2 GB export)."""
    import json

    import onnx

    m = onnx.load(str(d / "target.onnx"))
    onnx.save(
        m,
        str(d / "target.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="target.onnx.data",
        size_threshold=1024,
    )
    man = json.loads((d / "manifest.json").read_text())
    man["target"]["external_data"] = ["target.onnx.data"]
    man["target"]["bytes"] = (d / "target.onnx").stat().st_size
    (d / "manifest.json").write_text(json.dumps(man))


def tiny_text_export(
    folder, seed: int = 0, scale: float = 3.0, draft: str = "layers:1", max_position: int = 512, **export_kw
):
    """An export folder (target + a layers:1 draft (or `draft`) + a real byte-level BPE
    tokenizer) of a tiny random Llama: what the CLI, server and embedding-API tests run text through."""
    from types import SimpleNamespace

    from test_tokenizer import synthetic_meta

    from arborspec.export.export_folder import export_folder
    from arborspec.models.tokenizer_build import text_tokenizer_from_gguf_meta

    tok = text_tokenizer_from_gguf_meta(synthetic_meta())
    m = random_model(
        tiny_config("llama", vocab=tok.vocab_size, layers=2, hidden=64, heads=4, kv=2, max_position=max_position),
        seed=seed,
        scale=scale,
    )
    export_folder(
        SimpleNamespace(module=m, config=m.config, tokenizer=tok, source={"kind": "test"}),
        folder,
        draft=draft,
        progress=False,
        verify=False,
        **export_kw,
    )
    return folder
