"""`arborspec chat`: a conversation from stdin, one turn a line, each answer the one the
embedding API gives for the conversation so far (the chat template over every earlier turn),
/reset clearing it, the oldest turns dropped at the context's end, one-line errors."""

from __future__ import annotations

import io

import pytest
from conftest import tiny_text_export

from arborspec.runtime.generator import Generator
from arborspec.tools.commands.cli import main


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("chat") / "e", seed=9)


def chat(monkeypatch, capsys, export_dir, lines: str, *extra: str):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    rc = main(["chat", "--export-dir", str(export_dir), "--max-new-tokens", "8", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_each_answer_is_the_apis_for_the_conversation_so_far(monkeypatch, capsys, export_dir):
    rc, answers, err = chat(
        monkeypatch, capsys, export_dir, "hello\nthe hell\n\n/reset\nhello\n/exit\nignored\n", "--stats"
    )
    msgs, want = [], []
    with Generator.from_export(export_dir) as g:
        for q in ("hello", "the hell"):
            msgs.append({"role": "user", "content": q})
            want.append(g.chat(msgs, 8).text)
            msgs.append({"role": "assistant", "content": want[-1]})
    assert want[0] != want[1]  # the second answer saw the first turn
    # each answer ends with a newline; /reset: the first turn again; nothing after /exit
    assert rc == 0 and answers == "".join(a + "\n" for a in (want[0], want[1], want[0])), (answers, err)
    assert "conversation cleared" in err and err.count("tokens in") == 3  # --stats: one line per answer


def test_the_oldest_turns_are_dropped_at_the_end_of_the_context(monkeypatch, capsys, export_dir):
    # the tiny export's context is 512 tokens: ~200 tokens a message (2 a word), answers of 100
    long = "hello " * 100
    rc, answers, err = chat(monkeypatch, capsys, export_dir, f"{long}\n{long}\n", "--max-new-tokens", "100")
    assert rc == 0 and "dropped the 1 oldest turn(s)" in err, err
    rc, answers, err = chat(monkeypatch, capsys, export_dir, "hello " * 600 + "\nhello\n")
    assert rc == 0 and "longer than the context" in err and answers  # that line skipped, the next answered


def test_mistakes_are_one_line(monkeypatch, capsys, export_dir, tmp_path):
    for extra, msg in (
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--max-new-tokens", "600"], "leaves no room in the context of 512"),
        (["--tree", "banana"], "malformed tree spec"),
        (["--temperature", "-1"], "temperature"),
    ):
        rc, _, err = chat(monkeypatch, capsys, export_dir, "hi\n", *extra)
        assert rc == 2 and err.strip().count("\n") == 0 and msg in err, err
    no_tok = tiny_text_export(tmp_path / "plain", seed=1)
    (no_tok / "tokenizer_meta.json").write_text('{"bos_token_id": 1, "eos_token_ids": [2]}')
    rc, _, err = chat(monkeypatch, capsys, no_tok, "hi\n")
    assert rc == 2 and "no chat template" in err


def test_ctrl_c_stops_an_answer_not_the_conversation(monkeypatch, capsys, export_dir):
    """Ctrl-C while an answer streams ends that answer (its text so far kept in the
    conversation); the next line is answered; the program ends normally."""
    from arborspec.runtime.decode import SpeculativeDecoder

    real, calls = SpeculativeDecoder.stream, []

    class Interrupted:
        """The real stream (its `result` too), with Ctrl-C after its first chunk."""

        def __init__(self, stream):
            self.stream = stream

        @property
        def result(self):
            return self.stream.result

        def __iter__(self):
            yield next(self.stream)
            raise KeyboardInterrupt

        def close(self):
            self.stream.close()

    def interrupted_once(self, *a, **kw):
        calls.append(1)
        stream = real(self, *a, **kw)
        return Interrupted(stream) if len(calls) == 1 else stream

    monkeypatch.setattr(SpeculativeDecoder, "stream", interrupted_once)
    rc, out, err = chat(monkeypatch, capsys, export_dir, "hello\nthe hell\n", "--stats")
    assert rc == 0 and len(calls) == 2 and "Traceback" not in err
    assert "stop: interrupted" in err and err.count("tokens in") == 2
