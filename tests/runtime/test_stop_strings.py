"""Stop strings (OpenAI's `stop`): the matcher against an independent reference (the text cut at
the first occurrence of any stop string, fed in random pieces), then through the embedding API
(generate, stream, chat, batched), the CLI (`generate --stop`) and their one-line mistakes. The
server's `stop` is tested in tests/tools/test_serve.py."""

from __future__ import annotations

import json
import random

import pytest
from conftest import tiny_text_export

from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.stop_strings import StopStrings, parse_stop


def reference_cut(text: str, stops: list[str], ends=None, include: bool = False) -> tuple[str, bool]:
    """The text cut before the earliest stop string present at the first of `ends` (where the
    pieces it arrived in end; default every character) whose prefix holds one (after it with
    `include`: the first listed of those that begin there); (text, False) when none does."""
    for e in sorted(set(ends or range(1, len(text) + 1))):
        at = [(text[:e].find(s), s) for s in stops if s in text[:e]]
        if at:
            i = min(a for a, _ in at)
            first = next(s for a, s in at if a == i)
            return text[: i + (len(first) if include else 0)], True
    return text, False


def test_matcher_equals_the_reference_on_random_pieces():
    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        text = "".join(rng.choice("ab\nc") for _ in range(rng.randint(0, 24)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5  # vLLM's include_stop_str_in_output
        m = StopStrings(stops, include)
        out, ends, i = [], [], 0
        while i < len(text) and not m.hit:
            j = min(i + rng.randint(0, 4), len(text))  # pieces of 0-4 characters, as tokens decode
            out.append(m.push(text[i:j]))
            ends.append(j)
            i = j
        out.append(m.finish())
        want, hit = reference_cut(text, stops, ends + [len(text)], include)
        assert ("".join(out), m.hit) == (want, hit), (text, stops)
        hits += hit
    assert 500 < hits < 2900  # both outcomes were exercised


def test_matcher_holds_back_only_a_possible_start():
    m = StopStrings(["\n\n", "User:"])
    assert m.push("Hello\n") == "Hello"  # "\n" may begin "\n\n"
    assert m.push("Us") == "\n"  # "\nUs" cannot begin "\n\n"; "Us" may begin "User:"
    assert m.push("ually") == "Usually" and not m.hit
    assert m.push(" User:") == " " and m.hit
    assert m.push("more") == "" and m.finish() == ""


@pytest.mark.parametrize("bad", ["", [""], ["a", 3], 3, {"a": 1}, b"x"])
def test_bad_stop_is_one_input_error(bad):
    with pytest.raises(InputError):
        parse_stop(bad)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    # scale 0.5: greedy text from "hello" is "hellohello...", so a stop string can span two tokens
    return tiny_text_export(tmp_path_factory.mktemp("stop") / "E", seed=9, scale=0.5)


@pytest.mark.parametrize("max_batch", [1, 2], ids=["alone", "batched"])
def test_generate_and_stream_end_before_the_stop_string(export_dir, max_batch):
    with Generator.from_export(export_dir, tree="full:2,2", max_batch=max_batch) as g:
        full = g.generate("hello", 24)
        assert full.stop_reason == "length" and full.text.count("hello") >= 3
        for stop in ("oh", ["zz", "ll"], "lohe"):
            want, _ = reference_cut(full.text, parse_stop(stop))
            c = g.generate("hello", 24, stop=stop)
            assert (c.text, c.stop_reason) == (want, "stop"), stop
            assert c.tokens == full.tokens[: len(c.tokens)]  # the same decoding, cut short
            # the tokens end with the one that completed the stop string
            read = g.tokenizer.decode(c.tokens, skip_special_tokens=True)
            before = g.tokenizer.decode(c.tokens[:-1], skip_special_tokens=True)
            assert any(read.startswith(want + s) for s in parse_stop(stop))
            assert not any(s in before for s in parse_stop(stop))
            it = g.stream("hello", 24, stop=stop)
            assert "".join(it) == want and it.result.stop_reason == "stop" and it.tokens == c.tokens
            kept, _ = reference_cut(full.text, parse_stop(stop), include=True)  # the stop string kept
            assert kept != want and g.generate("hello", 24, stop=stop, include_stop_str_in_output=True).text == kept
            kw = {"stop": stop, "include_stop_str_in_output": True}
            assert "".join(g.stream("hello", 24, **kw)) == kept
        none = g.generate("hello", 24, stop="xyz")  # never met: the whole text, its own reason
        assert (none.text, none.tokens, none.stop_reason) == (full.text, full.tokens, "length")
        c = g.chat([{"role": "user", "content": "hello"}], 16, stop=["\n"])
        assert "\n" not in c.text
        with pytest.raises(InputError, match="stop strings need text output"):
            list(g.stream("hello", 8, stop="h", ids=True))
        with pytest.raises(InputError):
            g.generate("hello", 8, stop=[""])
        assert g.generate("hello", 24).tokens == full.tokens  # nothing left behind by the stopped calls


def test_cli_generate_stop(export_dir, capsys):
    from arborspec.tools.commands.cli import main

    base = ["generate", "--export-dir", str(export_dir), "--prompt", "hello", "--max-new-tokens", "24", "--json"]
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*base, "--stop", "oh", "--stop", "zz"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == full["text"][: full["text"].find("oh")] and cut["stats"]["stop_reason"] == "stop"
    assert cut["tokens"] == full["tokens"][: len(cut["tokens"])]
    assert main(base[:-1] + ["--stop", "oh"]) == 0  # streamed to the terminal
    out = capsys.readouterr()
    assert out.out == cut["text"] + "\n" and "stop: stop" in out.err
    assert main(["generate", "--export-dir", str(export_dir), "--prompt-ids", "1,2", "--stop", "x"]) == 2
    assert capsys.readouterr().err.startswith("arborspec: error: --stop matches text")
    assert main([*base, "--stop", ""]) == 2
    assert capsys.readouterr().err == "arborspec: error: stop strings must not be empty\n"
    assert main([*base, "--stop", "oh", "--include-stop"]) == 0  # the stop string kept
    kept = json.loads(capsys.readouterr().out)
    assert kept["text"] == cut["text"] + "oh" and kept["tokens"] == cut["tokens"]
    assert main([*base, "--include-stop"]) == 2
    assert capsys.readouterr().err.startswith("arborspec: error: --include-stop keeps the stop string")
