"""Text in, token ids out (and back), for the runtime: no transformers, no ONNX, no models.

Role in one decoding step: before the first step the prompt (often a chat rendered through
the model's Jinja chat template) becomes ids; after each step's commit the accepted ids are
turned into new text for streaming by `StreamDecoder`, which holds back bytes until they
form whole UTF-8 characters (a byte-level BPE token can end mid-character).

On disk, next to an export: `tokenizer.json` (a `tokenizers` file) and `tokenizer_meta.json`
{bos_token_id, eos_token_ids, chat_template, add_bos}; and, for tools built on transformers
(`AutoTokenizer.from_pretrained(EXPORT_DIR)`, lm-evaluation-harness's `tokenizer=EXPORT_DIR`), a
`tokenizer_config.json` saying the same in its terms (written, never read here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .errors import InputError
from .fileio import atomic_write_text

META_FILE = "tokenizer_meta.json"
TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
META_KEYS = ("bos_token_id", "eos_token_ids", "chat_template", "add_bos")


def _raise_exception(message: str):
    raise InputError(f"chat template error: {message}")


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: bos/eos ids, add_bos, chat template."""

    def __init__(self, tokenizer: Tokenizer, meta: dict[str, Any] | None = None):
        meta = dict(meta or {})
        self.tokenizer = tokenizer
        self.bos_token_id: int | None = meta.get("bos_token_id")
        eos = meta.get("eos_token_ids", [])
        self.eos_token_ids: list[int] = [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        self.chat_template: str | None = meta.get("chat_template")
        self.add_bos: bool = bool(meta.get("add_bos", False))
        self._template = None

    # -- files ---------------------------------------------------------------------------
    @classmethod
    def from_files(
        cls, tokenizer_json_path: str | Path, meta: dict[str, Any] | str | Path | None = None
    ) -> "TextTokenizer":
        """tokenizer.json + a meta dict (or the path of a tokenizer_meta.json)."""
        if isinstance(meta, (str, Path)):
            meta = json.loads(Path(meta).read_text())
        return cls(Tokenizer.from_file(str(tokenizer_json_path)), meta)

    @classmethod
    def load(cls, folder: str | Path) -> "TextTokenizer":
        """A folder written by save()."""
        folder = Path(folder)
        meta_path = folder / META_FILE
        return cls.from_files(folder / TOKENIZER_FILE, meta_path if meta_path.exists() else None)

    @property
    def meta(self) -> dict[str, Any]:
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
        }

    @property
    def hf_config(self) -> dict[str, Any]:
        """transformers' tokenizer_config.json for tokenizer.json: the same special tokens, BOS
        rule and chat template (a fast tokenizer; nothing here reads it back)."""
        name = lambda i: None if i is None else self.id_to_token(int(i))  # noqa: E731
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_token_id)}
        cfg |= {"eos_token": name(eos), "add_bos_token": self.add_bos, "add_eos_token": False}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg

    def _file_text(self) -> str:
        """tokenizer.json's text. With add_bos it carries a post-processor that puts BOS first,
        which only `add_special_tokens=True` encoders (transformers') apply: this runtime encodes
        without it and adds BOS itself (`encode`), so both read the same ids."""
        tok = self.tokenizer
        if self.add_bos and self.bos_token_id is not None and tok.post_processor is None:
            from tokenizers.processors import TemplateProcessing

            tok = Tokenizer.from_str(tok.to_str())
            bos = (self.id_to_token(self.bos_token_id), int(self.bos_token_id))
            tok.post_processor = TemplateProcessing(
                single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
            )
        return tok.to_str()

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json, tokenizer_meta.json and tokenizer_config.json (each atomically)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        files = (TOKENIZER_FILE, self._file_text()), (META_FILE, json.dumps(self.meta, indent=1))
        for name, text in files + ((HF_CONFIG_FILE, json.dumps(self.hf_config, indent=1)),):
            atomic_write_text(folder / name, text)

    # -- ids <-> text --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> ids; special tokens written in the text (<|im_start|>) become their ids."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def is_eos(self, token_id: int) -> bool:
        return int(token_id) in self.eos_token_ids

    # -- chat ----------------------------------------------------------------------------
    def _compiled_template(self):
        if self._template is None:
            if not self.chat_template:
                raise InputError("this tokenizer has no chat template")
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template

    def _token_text(self, i: int | None) -> str:
        return "" if i is None else (self.tokenizer.id_to_token(int(i)) or "")

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render messages [{role, content}, ...] with the model's chat template."""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return self._compiled_template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(eos),
            **extra,
        )

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: push(ids) returns only the text that became final.

    Decodes a small window (the last already-emitted tokens + the new ones) and emits the
    difference; ids whose text ends in U+FFFD (an incomplete UTF-8 sequence) are held back
    until the next push completes the character. finish() flushes whatever is left.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = False):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # ids before this were emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids) -> str:
        if isinstance(ids, int):
            ids = [ids]
        self.ids.extend(int(i) for i in ids)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        # the longest run of the new ids that ends on a whole character (usually all of them)
        for end in range(len(self.ids), self.read, -1):
            text = self._decode(self.ids[self.prefix : end])
            if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
                self.prefix, self.read = self.read, end
                return text[len(prefix_text) :]
        return ""

    def finish(self) -> str:
        """The rest of the text, incomplete characters included (as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text) :]
