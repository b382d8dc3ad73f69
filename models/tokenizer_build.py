"""Build a `tokenizers.Tokenizer` (and its generation metadata) from GGUF metadata.

Role: a GGUF carries its tokenizer as arrays (tokenizer.ggml.tokens / merges / token_type)
plus a pre-tokenizer name (tokenizer.ggml.pre). We rebuild a byte-level BPE from them so
the runtime never needs transformers: the result is saved as tokenizer.json next to the
model. Pre-tokenizers follow llama.cpp's names: "smollm" splits every digit on its own before
the GPT-2 regex (as SmolLM2's original tokenizer.json does); "llama-bpe" / "qwen2" use their
own regexes; anything else gets the GPT-2 regex. Control / user-defined tokens (token_type 3 /
4) become added tokens, so "<|im_start|>" in a prompt encodes to its single id.
"""

from __future__ import annotations

import warnings
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from arborspec.runtime.errors import InputError

from ..runtime.tokenizer import TextTokenizer

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PRES = ("gpt2", "default", "smollm", "llama-bpe", "llama3", "qwen2", None)

CONTROL, USER_DEFINED = 3, 4


def pre_tokenizer_for(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2"):
        regex = QWEN2_REGEX if pre == "qwen2" else LLAMA3_REGEX
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in GPT2_PRES:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} unknown to arborspec: using the GPT-2 regex")
    return byte_level


def tokenizer_from_gguf_meta(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """GGUF metadata -> (tokenizers.Tokenizer, {bos_token_id, eos_token_ids, chat_template, add_bos})."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2' is supported)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer_for(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    eos_ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    info = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": list(dict.fromkeys(int(e) for e in eos_ids if e is not None)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }
    if info["bos_token_id"] is not None:
        info["bos_token_id"] = int(info["bos_token_id"])
    return tok, info


def text_tokenizer_from_gguf_meta(meta: dict[str, Any]) -> TextTokenizer:
    tok, info = tokenizer_from_gguf_meta(meta)
    return TextTokenizer(tok, info)
