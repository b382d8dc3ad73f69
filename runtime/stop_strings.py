"""Stop strings: end a generation where its text first contains one of them (OpenAI's `stop`).

Role in one decode step: after step 5, on the text the step's committed tokens decode to (the
Generator feeds it one token's text at a time): text that can no longer start a stop string
is released, the tail that still might is held back, and the first complete stop string ends
the generation. The stop string itself and everything after it are left out of the text (kept with
`include=True`: vLLM's include_stop_str_in_output).

    stops = StopStrings(["\\n\\n", "User:"])
    stops.push("Hello\\n")   # -> "Hello" (the "\\n" is held: it may begin "\\n\\n")
    stops.push("\\nmore")    # -> "" and stops.hit is True
"""

from __future__ import annotations

from typing import Iterator, Sequence

from .errors import InputError


def parse_stop(stop) -> list[str]:
    """A stop argument (None, a string, or a sequence of strings) -> a list of non-empty
    strings; one InputError line for anything else."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if isinstance(items, (bytes, dict)) or not hasattr(items, "__iter__"):
        raise InputError(f"stop must be a string or a list of strings, not {type(stop).__name__}")
    items = list(items)
    if not all(isinstance(s, str) for s in items):
        raise InputError("stop must be a string or a list of strings")
    if any(s == "" for s in items):
        raise InputError("stop strings must not be empty")
    return items


class StopStrings:
    """Feed text with `push`; it returns the text that is final. `hit` turns True at the first
    stop string (the text before it, and with `include` the stop string too, has been returned
    by then); `finish()` returns what is still held back when the generation ends without one."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = parse_stop(stops)
        self.include = bool(include)
        self.held = ""
        self.hit = False

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        buf = self.held + text
        at = [(i, len(s)) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if at:
            self.hit, self.held = True, ""
            i, n = min(at, key=lambda a: a[0])  # the first to begin (the first listed among equals)
            return buf[: i + n] if self.include else buf[:i]
        keep = max((n for s in self.stops for n in range(1, len(s)) if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        rest, self.held = ("" if self.hit else self.held), ""
        return rest


def decode_until_stop(chunks, decoder, match: StopStrings, tokens: list) -> Iterator[str]:
    """Text pieces of a generation's token chunks (`chunks`: an iterator of id lists, closed
    here once a stop string ends it; `decoder`: the tokenizer's StreamDecoder), read one token
    at a time so the generation ends at the token that completes a stop string (`match.hit`
    then). `tokens` collects the ids read."""
    try:
        for chunk in chunks:
            for t in chunk:
                tokens.append(t)
                text = match.push(decoder.push(t))
                if text:
                    yield text
                if match.hit:
                    return
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # ends the decoding (a batched row is freed)
    text = match.push(decoder.finish())
    text += match.finish()
    if text:
        yield text
