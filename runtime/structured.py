"""Structured output: a JSON object, or JSON that follows a schema, by masking the target's rows.

Role in one decoding step: step 4 (and step 1 for the draft), beside the penalties
(runtime/penalties.py). A request's `response_format` (OpenAI's: {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"schema": {...}}}) becomes a grammar that llguidance
(the Rust matcher vLLM, SGLang and llama.cpp use) compiles against the target's tokenizer. Each
sequence holds a matcher at its committed tokens; before the accept walk reads a verify row, the
matcher is advanced along that row's tree path, asked which tokens may come next, and rolled
back; every other token's logit becomes -inf. The walk then picks only tokens the grammar
allows, so greedy speculation is the constrained greedy decoding token for token and sampling is
lossless for the constrained distribution; the committed tokens advance the matcher (`extend`).
A drafted path the grammar refuses is a row with no allowed token: its node is never accepted.

llguidance is an optional dependency (`pip install 'arborspec[structured]'`): imported here
only when a request asks for structured output.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import torch

from .errors import InputError

MAX_GRAMMARS = 64  # compiled grammars a GrammarCompiler keeps (by schema)
NEEDS_LLGUIDANCE = "structured output (response_format) needs llguidance: pip install 'arborspec[structured]'"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InputError(NEEDS_LLGUIDANCE) from None
    return llguidance


KINDS = "text, json_object, json_schema, regex, choice or grammar"


def schema_of(response_format) -> tuple | None:
    """A `response_format` -> what it constrains the answer to, as (kind, value): OpenAI's
    json_object ("json", {"type": "object"}) and json_schema ("json", the schema), or this
    runtime's extensions (vLLM's guided_regex and guided_choice): {"type": "regex", "regex":
    PATTERN} -> ("regex", PATTERN), {"type": "choice", "choices": [TEXT, ...]} -> ("choice",
    [...]), {"type": "grammar", "grammar": TEXT} (Lark or GBNF; vLLM's guided_grammar, and tool
    calls: runtime/chat.py) -> ("grammar", TEXT); None for text. One InputError line for
    anything else."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InputError(f'response_format must be an object with a "type": {KINDS}')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InputError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return "json", schema
    if kind == "regex":
        if not isinstance(response_format.get("regex"), str) or not response_format["regex"]:
            raise InputError('response_format regex needs {"regex": PATTERN}')
        return "regex", response_format["regex"]
    if kind == "choice":
        choices = response_format.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InputError('response_format choice needs {"choices": [TEXT, ...]} (non-empty strings)')
        return "choice", choices
    if kind == "grammar":
        if not isinstance(response_format.get("grammar"), str) or not response_format["grammar"].strip():
            raise InputError('response_format grammar needs {"grammar": TEXT} (Lark, or GBNF as llama.cpp writes it)')
        return "grammar", response_format["grammar"]
    raise InputError(f"response_format type must be {KINDS}, got {kind!r}")


def grammar_text(lg, kind: str, value) -> str:
    """llguidance's grammar for schema_of's (kind, value)."""
    if kind == "grammar":  # GBNF (`root ::= ...`, llama.cpp's and vLLM's guided_grammar) becomes Lark
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return lg.LLMatcher.grammar_from_lark(any_to_lark(value))
        except Exception as e:  # noqa: BLE001 - its converter raises its own error types
            raise ValueError(
                f"the grammar does not parse: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
    if kind == "regex":
        return lg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":  # a Lark rule of JSON-quoted literals
        return lg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    return lg.LLMatcher.grammar_from_json_schema(value)


class Grammar:
    """A compiled grammar for one tokenizer (shared by the requests that ask for it; equal when
    the grammar text and the tokenizer are). `state()` makes one sequence's matcher."""

    def __init__(self, text: str, lltokenizer):
        self.text, self._tok = text, lltokenizer
        self.eos = frozenset(lltokenizer.eos_tokens)
        lg = _llguidance()
        is_error, messages = lg.LLMatcher.validate_grammar_with_warnings(text, lltokenizer)
        if is_error:
            raise InputError(f"response_format: the grammar does not compile: {messages[0] if messages else ''}")

    def __eq__(self, other) -> bool:
        return isinstance(other, Grammar) and other.text == self.text and other._tok is self._tok

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"Grammar({self.text[:60]!r})"

    def state(self, vocab_size: int) -> "GrammarState":
        return GrammarState(_llguidance().LLMatcher(self._tok, self.text, log_level=0), vocab_size, self.eos)


class GrammarCompiler:
    """A tokenizer's side of structured output: its llguidance tokenizer (built once: ~0.2 s for
    a 49k vocabulary) and the grammars compiled for it, by schema."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        if not eos_token_ids:
            raise InputError("structured output needs an end-of-sequence token (the tokenizer names none)")
        self._src, self.vocab_size, self.eos = tokenizer, int(vocab_size), [int(e) for e in eos_token_ids]
        self._tok = None
        self._grammars: dict[str, Grammar] = {}

    def grammar(self, response_format) -> Grammar | None:
        """The Grammar of an OpenAI `response_format` (None for text)."""
        target = schema_of(response_format)
        if target is None:
            return None
        key = json.dumps(target, sort_keys=True)
        g = self._grammars.get(key)
        if g is None:
            lg = _llguidance()
            if self._tok is None:
                self._tok = lg.LLTokenizer(self._src.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self.eos)
            try:
                text = grammar_text(lg, *target)
            except ValueError as e:
                raise InputError(f"response_format: {e}") from None
            g = self._grammars[key] = Grammar(text, self._tok)
            if len(self._grammars) > MAX_GRAMMARS:  # a server's clients send any schema: the oldest goes
                self._grammars.pop(next(iter(self._grammars)))
        return g


class GrammarState:
    """One sequence's matcher, at its committed tokens: `process` masks a row after a tree path,
    `extend` commits a step's tokens (the penalties' TokenHistory interface)."""

    def __init__(self, matcher, vocab_size: int, eos=frozenset()):
        self.m, self.vocab_size, self.eos = matcher, vocab_size, eos
        if matcher.is_error():
            raise InputError(f"response_format: {matcher.get_error()}")

    def allowed(self, path: Sequence[int]) -> np.ndarray | None:
        """Bool [V]: the tokens the grammar allows after the committed tokens and `path`; None
        when `path` itself leaves the grammar (a drafted path it refuses)."""
        m, path = self.m, [int(t) for t in path]
        n = m.try_consume_tokens(path) if path else 0
        try:
            if n < len(path):
                return None
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        finally:
            if n:
                m.rollback(n)

    def process(self, row: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        if any(int(t) in self.eos for t in path):  # a row past the end of sequence: cut away (step.truncate)
            return row
        ok = self.allowed(path)
        x = row.detach().float().clone()
        if ok is None:
            return x.fill_(float("-inf"))
        return x.masked_fill_(torch.from_numpy(~ok[: x.shape[-1]]), float("-inf"))

    def forced(self) -> list[int]:
        """The tokens the grammar forces after the committed ones (llguidance's fast-forward
        tokens: where the grammar allows one string only, its canonical tokens, short of any that
        the text after it could merge with); [] where the next token is a choice. The decoder
        verifies them as a chain in place of a drafted tree (runtime/decode.py)."""
        if self.m.is_stopped():
            return []
        return [int(t) for t in self.m.compute_ff_tokens()]

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self.m.is_stopped():  # complete: what follows is the end of sequence, not the grammar's
                return
            if not self.m.consume_token(int(t)):
                raise RuntimeError(f"structured output: the grammar refused a committed token ({self.m.get_error()})")
