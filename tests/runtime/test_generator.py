"""The embedding API: arborspec.Generator (text in, text out) and open_export, on torch engines
and an ONNX Runtime export; thread safety; lifecycle; bad input as ArborspecError."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import random_model, tiny_config, truncated

import arborspec
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.errors import (
    ArborspecError,
    InputError,
    MissingFileError,
    TreeSpecError,
)
from arborspec.runtime.generator import Completion, Generator

PROMPT = [1, 5, 7, 9, 3, 11]


@pytest.fixture(scope="module")
def tok():
    from test_tokenizer import synthetic_meta

    from arborspec.models.tokenizer_build import text_tokenizer_from_gguf_meta

    return text_tokenizer_from_gguf_meta(synthetic_meta())


@pytest.fixture(scope="module")
def pair(tok):
    m = random_model(tiny_config("llama", vocab=tok.vocab_size), seed=3)
    return TorchEngine(m), TorchEngine(truncated(m, 1))


def test_top_level_names():
    assert arborspec.Generator is Generator
    assert arborspec.open_export is __import__("arborspec.runtime.export_dir", fromlist=["x"]).open_export
    assert issubclass(InputError, arborspec.ArborspecError)


def test_generate_stream_chat_match_the_decoder(pair, tok):
    target, draft = pair
    gen = Generator(target, draft, tok, tree="full:2,2")
    text = "hello the world"
    ids = tok.encode(text)
    ref = SpeculativeDecoder(target, mode="vanilla").generate(ids, 24, tok.eos_token_ids).tokens
    c = gen.generate(text, max_new_tokens=24)
    assert isinstance(c, Completion) and c.tokens == ref and c.prompt_tokens == len(ids)
    assert c.text == tok.decode(ref, skip_special_tokens=True)
    assert c.stats.steps < len(ref) or c.stop_reason == "eos"  # the draft was used
    assert 0 < c.stats.ttft_s <= c.stats.total_s and c.stats.prefill_s <= c.stats.ttft_s  # time to first token
    assert "".join(gen.stream(text, max_new_tokens=24)) == c.text
    assert sum(gen.stream(ids, max_new_tokens=24, ids=True), []) == ref
    msgs = [{"role": "user", "content": text}]
    assert gen.chat(msgs, max_new_tokens=24).tokens == gen.generate(tok.apply_chat(msgs), 24).tokens
    # sampling: reproducible per seed, and a different decoder per sampling configuration
    a = gen.generate(text, 16, temperature=0.9, top_p=0.9, seed=4)
    b = gen.generate(text, 16, temperature=0.9, top_p=0.9, seed=4)
    assert a.tokens == b.tokens


def test_bad_input_is_one_arborspec_error(pair, tok):
    target, draft = pair
    gen = Generator(target, draft, tok)
    for call in (
        lambda: gen.generate(""),
        lambda: gen.generate({"x": 1}),
        lambda: gen.generate([1, 2], 0),
        lambda: gen.generate([10**6]),
        lambda: gen.generate("hi", temperature=-1),
        lambda: gen.generate("hi", top_p=0.0),
        lambda: gen.chat([{"content": "no role"}]),
        lambda: gen.generate("hi", temperature=float("nan")),
        lambda: gen.generate("hi", seed="x"),  # was a bare ValueError from int()
        lambda: gen.generate("hi", seed=2**70),  # was torch's overflow ValueError
        lambda: gen.generate("hi", seed=1.5),
    ):
        with pytest.raises(ArborspecError):
            call()
    assert gen.generate([1, 2], 4, temperature=1.0, seed=2**64 - 1).tokens  # torch's whole range
    batched = Generator(target, draft, tok, max_batch=2)
    with pytest.raises(InputError, match="seed must lie in"):
        batched.generate([1, 2], 4, seed=-(2**63) - 1)
    batched.close()
    with pytest.raises(InputError, match="no tokenizer"):
        Generator(target, draft).generate("text")
    with pytest.raises(TreeSpecError, match="tree spec"):
        Generator(target, draft, tree="nonsense:1")
    with pytest.raises(InputError, match="needs a draft"):
        Generator(target, None, mode="tree")


def test_one_generator_from_several_threads(pair):
    """Calls from several threads are serialised: each result equals the sequential one."""
    target, draft = pair
    gen = Generator(target, draft, tree="full:3,2")
    prompts = [[1 + i, 5, 7 + i, 9] for i in range(6)]
    want = [gen.generate(p, 20, temperature=0.7, seed=i).tokens for i, p in enumerate(prompts)]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            got[i] = gen.generate(prompts[i], 20, temperature=0.7, seed=i).tokens
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and [got[i] for i in range(len(prompts))] == want


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from arborspec.export.export_folder import export_folder

    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=32), seed=7)
    d = tmp_path_factory.mktemp("gen") / "export"
    export_folder(
        SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"}),
        d,
        draft="layers:1",
        progress=False,
        verify=False,
    )
    return m, d


def test_from_export_every_draft_and_lifecycle(export_dir):
    m, d = export_dir
    ref = SpeculativeDecoder(TorchEngine(m), mode="vanilla").generate(PROMPT, 20).tokens
    for draft, tree in ((None, "full:2,2"), ("lookup", "beam:2,4"), ("none", None)):
        with Generator.from_export(d, draft=draft, tree=tree) as gen:
            assert gen.generate(PROMPT, 20).tokens == ref, draft
            engines = list(gen._owns[0].engines)
            assert gen.mode == ("vanilla" if draft == "none" else "tree")
        assert all(e.closed for e in engines) and gen.closed
        with pytest.raises(InputError, match="closed"):
            gen.generate(PROMPT, 4)
    with pytest.raises(MissingFileError, match="arborspec tune"):
        Generator.from_export(d, tree="auto")
    with pytest.raises(InputError, match="fixed at export time"):
        Generator.from_export(d, draft="layers:2")


def test_open_export_closes_what_it_opened(export_dir):
    _, d = export_dir
    from arborspec.runtime.drafts.model import ModelDraft
    from arborspec.runtime.export_dir import open_export

    with open_export(d) as ex:
        assert isinstance(ex.draft, ModelDraft) and ex.tokenizer is None
        assert ex.manifest.limits["max_tree_nodes"] >= 1
        engines = list(ex.engines)
    assert len(engines) == 2 and all(e.closed for e in engines)
    with pytest.raises(InputError, match="backend"):
        open_export(d, backend="torch")
    with pytest.raises(ArborspecError):
        engines[0].forward(
            torch.zeros(1, 1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, 1, 1, dtype=torch.bool),
            None,
        )


def test_a_streams_outcome_comes_back_with_it(llama_pair):
    """No per-thread side channel: stream() returns a Stream whose `result` (stats, stop reason)
    is None before the first chunk and final after the last, equal to generate()'s; closed early
    it keeps the stats so far; two threads' streams each keep their own."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import arborspec.runtime.generator as G

    target, draft = llama_pair
    gen = Generator(target, draft, tree="full:2,2")
    assert not any(isinstance(v, type) and issubclass(v, threading.local) for v in vars(G).values())
    assert not hasattr(gen, "last_stats") and not hasattr(gen, "last_stop_reason")
    ref = gen.generate([1, 5, 7, 9], 10)
    it = gen.stream([1, 5, 7, 9], 10, ids=True)
    assert it.result is None and it.stats is None
    chunks = list(it)
    assert sum(chunks, []) == it.tokens == ref.tokens == it.result.tokens
    assert it.stop_reason == ref.stop_reason and it.stats.new_tokens == ref.stats.new_tokens == len(ref.tokens)
    early = gen.stream([1, 5, 7, 9], 10, ids=True)
    next(early)
    early.close()
    assert 1 <= early.stats.new_tokens < 10
    assert gen.generate([1, 5, 7, 9], 10).tokens == ref.tokens  # the lock was released

    def run(n):
        s = gen.stream([1, 5, 7, 9], n, ids=True)
        return n, sum(s, []), s.stats.new_tokens

    with ThreadPoolExecutor(3) as pool:
        for n, toks, made in pool.map(run, [3, 6, 9]):
            assert toks == ref.tokens[:n] and made == n
