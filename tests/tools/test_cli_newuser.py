"""What a new user meets first (issue 27), as the user meets it: the `arborspec` command run as a
subprocess (exit status, the one `arborspec: error:` line, no traceback) on tiny random exports.
Fast help without torch, one vocabulary across commands, tune on an export's layers:K draft, a
prompt file that is not UTF-8, an output folder that cannot be made, a refused file, an export without a draft, a closed pipe, Ctrl-C, the server's
start-up / request / stop lines and its port check, loadtest's short-answer warning, and an
instruct model's empty answer."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import tiny_text_export

from arborspec.tools.commands.cli import COMMANDS, build_parser, main

CLI = [sys.executable, "-m", "arborspec.tools.commands.cli"]


def arborspec(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)


def one_error_line(r: subprocess.CompletedProcess, expect: str) -> str:
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("arborspec: error: "), r.stderr
    assert expect in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("newuser")
    e = tiny_text_export(root / "E", seed=3)
    n = tiny_text_export(root / "N", seed=3, draft="none")
    return e, n


# ----------------------------------------------------------------------------- help, vocabulary
def test_help_lists_every_command_without_importing_torch():
    probe = (
        "import sys; from arborspec.tools.commands.cli import build_parser; build_parser(); "
        "print([m for m in ('torch', 'numpy', 'onnxruntime') if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    r = arborspec("--help")
    assert r.returncode == 0
    for name in COMMANDS:
        assert f"    {name}" in r.stdout and name in r.stdout.split("\n\n")[1], name  # listed and described
    r = arborspec("--version")
    from arborspec import __version__

    assert r.returncode == 0 and r.stdout.strip() == f"arborspec {__version__}"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _action(parser, flag):
    return next((a for a in parser._actions if flag in a.option_strings), None)


def test_every_command_help_is_whole_and_speaks_one_vocabulary(capsys):
    subs = _subparsers()
    assert set(subs) == set(COMMANDS)
    for name, p in subs.items():
        assert p.description and p.description.rstrip().endswith((".", ")")), (name, p.description)
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f"arborspec {name}" in out
        # an example continued on the next line keeps its backslash there (a lone `\` in the
        # source joined the two lines into one with a run of spaces in it)
        assert not re.search(r"\S {4,}--", out.split("example")[-1]), (name, out)
    for name in ("generate", "bench", "serve"):  # every tree policy, everywhere a tree is taken
        h = _action(subs[name], "--tree").help
        for spec in ("chain:K", "full:D,W", "beam:", "dynamic:K,D,N[,P]", "static:FILE.json", "auto"):
            assert spec in h, (name, spec)
    for name in ("generate", "bench", "tune", "serve"):
        assert (
            "export+lookup" in _action(subs[name], "--draft").help
            and "lookup[:N]" in _action(subs[name], "--draft").help
        )
    assert "eagle3" in _action(subs["export"], "--draft").help
    for name in ("generate", "tune", "bench", "loadtest"):  # --json: JSON on stdout, a flag
        assert _action(subs[name], "--json").nargs == 0, name
    for name in ("bench", "loadtest"):
        assert _action(subs[name], "--json-out") is not None
    for name in ("bench", "tune"):
        assert _action(subs[name], "--limit-prompts") is not None
    for name in ("export", "compare", "bench", "tune", "train-draft", "serve"):  # less on stderr: one name
        assert _action(subs[name], "--quiet") is not None, name
    for name, p in subs.items():  # every option says what it takes
        assert all(a.help for a in p._actions if a.option_strings), name


# ----------------------------------------------------------------------------- tune
def test_tune_on_an_export_with_a_layers_draft(exports, tmp_path):
    e = shutil.copytree(exports[0], tmp_path / "E")
    r = arborspec(
        "tune", "--export-dir", e, "--max-nodes", 3, "--max-depth", 2, "--limit-prompts", 1,
        "--calib-tokens", 8, "--reps", 1, "--loop-candidates", 0, "--past", 16,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "tuned tree:" in r.stdout
    assert (e / "tree_auto.json").is_file()
    # stderr is a pipe here: no progress bar floods it
    assert "it/s" not in r.stderr and "%|" not in r.stderr, r.stderr[-500:]


def test_tune_says_so_when_no_tree_pays():
    from arborspec.runtime.errors import InputError
    from arborspec.tools.tune.tree_dp import choose_tree

    verify = {1: 10.0, 2: 11.0, 4: 12.0, 8: 15.0, 9: 16.0}
    dcost = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    with pytest.raises(InputError, match="no tree pays"):
        choose_tree([[0.0] * 8] * 4, verify, dcost, 8, 4)


# ----------------------------------------------------------------------------- generate
def test_prompt_file_not_utf8_is_one_line(exports, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9\n")
    r = arborspec("generate", "--export-dir", exports[0], "--mode", "vanilla", "--prompt-file", f)
    one_error_line(r, "not UTF-8")


def test_prompt_file_that_is_a_folder_is_one_line(tmp_path):
    from arborspec.runtime.errors import InputError
    from arborspec.runtime.fileio import read_text_file

    with pytest.raises(InputError, match="is a folder, not a file"):  # was "not found" for a folder that exists
        read_text_file(tmp_path, "prompt file")


def test_export_without_a_draft_decodes_like_serve(exports):
    _, n = exports
    r = arborspec("generate", "--export-dir", n, "--prompt", "hello", "--max-new-tokens", 4)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[vanilla]" in r.stderr
    line = one_error_line(arborspec("generate", "--export-dir", n), "give exactly one of --prompt")
    line = one_error_line(arborspec("generate", "--export-dir", n, "--mode", "tree", "--prompt", "hi"), "needs a draft")
    assert "lookup" in line and "bigram" not in line  # what an export folder can take
    # a tree asked for without a draft is not silently vanilla decoding
    line = one_error_line(
        arborspec("generate", "--export-dir", n, "--tree", "full:2,2", "--prompt", "hi"), "needs a draft"
    )
    assert line.startswith("arborspec: error: --tree full:2,2 needs a draft")


def test_closed_pipe_ends_quietly(exports):
    p = subprocess.Popen(
        [*CLI, "generate", "--export-dir", str(exports[0]), "--prompt", "hello", "--max-new-tokens", "32"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p.stdout.close()  # the reader is gone before the first token (as `| head` once it has enough)
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_ctrl_c_in_generate_claims_no_cleanup(exports, capsys, monkeypatch):
    from arborspec.tools.commands import generate

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "open_models", interrupted)
    assert main(["generate", "--export-dir", str(exports[0]), "--prompt", "hi"]) == 130
    assert capsys.readouterr().err == "arborspec: interrupted\n"


def test_output_where_no_folder_can_be_made_is_one_line(tmp_path, capsys):
    """`export --out` under a regular file (or /proc, or a read-only place): one line naming the
    path before any model is loaded, exit 2, nothing left behind."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["export", "--model", "smollm2-135m", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"arborspec: error: cannot write {blocker / 'sub'}: {blocker} is a file, not a folder"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_an_os_error_is_one_line_naming_the_file(exports, capsys, monkeypatch):
    """Whatever command meets a file the system refuses (permissions, a vanished disk) says so in
    one line with the file's name, exit 2; ARBORSPEC_DEBUG=1 shows the traceback instead."""
    from arborspec.tools.commands import generate

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied", "/models/x.onnx")

    monkeypatch.setattr(generate, "open_models", refused)
    assert main(["generate", "--export-dir", str(exports[0]), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == "arborspec: error: /models/x.onnx: Permission denied\n"
    monkeypatch.setenv("ARBORSPEC_DEBUG", "1")
    with pytest.raises(PermissionError):
        main(["generate", "--export-dir", str(exports[0]), "--prompt", "hi"])


def test_cuda_on_a_cpu_onnxruntime_is_one_line_before_loading(exports):
    """`--device cuda` with the CPU build of onnxruntime: one line before the model loads (not
    ONNX Runtime's own warning about a missing plugin first)."""
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA provider")
    r = arborspec("generate", "--export-dir", exports[0], "--prompt", "hi", "--device", "cuda")
    one_error_line(r, "CUDA was requested but this onnxruntime")


def test_tensorrt_without_a_gpu_says_so_first(exports):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here")
    r = arborspec("generate", "--export-dir", exports[0], "--backend", "tensorrt", "--prompt", "hi")
    assert "build" not in one_error_line(r, "NVIDIA GPU")


def test_instruct_model_empty_answer_is_explained(exports):
    from arborspec.runtime.errors import EmptyCompletionWarning
    from arborspec.runtime.generator import Generator

    with Generator.from_export(exports[1]) as g:
        first = g.generate("hello", 1).tokens[0]
        chat_first = g.generate("hello", 1, chat=True).tokens[0]
        assert g.tokenizer.chat_template
        # a model whose first answer to the raw prompt is EOS (an instruct model without its template)
        eos = Generator(g.target, None, g.tokenizer, eos_token_ids=[first])
        with pytest.warns(EmptyCompletionWarning, match="chat=True"):
            c = eos.generate("hello", 8)
        assert c.tokens == [first] and c.stop_reason == "eos"  # (a real EOS is special: its text is '')
        if chat_first != first:  # chat=True sends the template: another first token
            assert eos.generate("hello", 8, chat=True).tokens


# ----------------------------------------------------------------------------- serve, loadtest
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_port_in_use_is_one_line_before_loading(exports, tmp_path):
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    broken = shutil.copytree(exports[0], tmp_path / "E")
    (broken / "target.onnx").write_bytes(b"not a model")  # loading it would fail: the port check comes first
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = arborspec("serve", "--export-dir", broken, "--port", port)
    one_error_line(r, f"cannot listen on 127.0.0.1:{port}")


def _stderr_lines(proc) -> queue.Queue:
    """The process's stderr lines, read by a thread (a silent process cannot block the test)."""
    q: queue.Queue = queue.Queue()

    def read():
        for line in proc.stderr:
            q.put(line)
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _wait_for(q: queue.Queue, pattern: str, lines: list[str], timeout=180) -> str:
    end = time.time() + timeout
    while time.time() < end:
        try:
            line = q.get(timeout=max(0.1, end - time.time()))
        except queue.Empty:
            break
        if line is None:
            break
        lines.append(line)
        if pattern in line:
            return line
    raise AssertionError(f"no {pattern!r} in: {''.join(lines)[-3000:]}")


@pytest.mark.parametrize("quiet", [False, True], ids=["logged", "quiet"])
def test_serve_says_where_it_listens_logs_requests_and_stops(exports, tmp_path, quiet):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    e = shutil.copytree(exports[0], tmp_path / "E")
    man = json.loads((e / "manifest.json").read_text())
    man["source"] = {"model": "./tiny-llama"}
    (e / "manifest.json").write_text(json.dumps(man))
    port = _free_port()
    # quiet: on another loopback address, which is not "this machine only": it warns without a key
    host = "127.0.0.2" if quiet else "127.0.0.1"
    cmd = [*CLI, "serve", "--export-dir", str(e), "--port", str(port), "--max-batch", "2", "--host", host] + (
        ["--quiet"] if quiet else []
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    lines: list[str] = []
    q = _stderr_lines(proc)
    try:
        up = _wait_for(q, "serving", lines)
        assert f"http://{host}:{port}" in up and "tiny-llama" in up and "batch 2" in up and "tree" in up, up
        assert ("without --api-key" in "".join(lines)) == quiet
        base = f"http://{host}:{port}"
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "tiny-llama"
        r = httpx.post(
            base + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0}, timeout=60
        )
        n = r.json()["usage"]["completion_tokens"]
        proc.send_signal(signal.SIGINT)
        _wait_for(q, "stopped serving", lines)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(lines)
    assert "Traceback" not in err
    logged = [x for x in lines if "POST /v1/completions 200" in x]
    if quiet:
        assert not logged and "GET /v1/models" not in err
    else:
        assert len(logged) == 1 and f" {n} tokens " in logged[0] and logged[0].rstrip().endswith(" ms"), err
        assert "GET /v1/models 200" in err


def test_served_model_id_is_a_clean_name():
    from arborspec.tools.serve.app import served_model_name

    assert served_model_name({"source": {"model": "./tiny-llama"}}, "/x/out") == "tiny-llama"
    assert served_model_name({"source": {"model": "/m/SmolLM2.Q4_1.gguf"}}, "/x/out") == "SmolLM2.Q4_1"
    assert served_model_name({"source": {"model": "smollm2-135m"}}, "/x/out") == "smollm2-135m"
    assert served_model_name({"source": {"kind": "test"}}, "/x/out") == "out"


def test_loadtest_warns_when_completions_are_one_token(monkeypatch, capsys):
    from arborspec.tools.commands import loadtest

    res = {"ok": 4, "requests": 4, "errors": 0, "tokens": 4, "wall_s": 1.0, "tokens_per_s": 4.0}
    res.update({k: 0.1 for k in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s")})
    monkeypatch.setattr(loadtest, "loadtest", lambda *a, **k: dict(res))
    assert main(["loadtest", "--url", "http://127.0.0.1:1", "--max-tokens", "64", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == 4  # --json: the results on stdout
    assert "warning" in err and "--chat" in err
    assert main(["loadtest", "--url", "http://127.0.0.1:1", "--max-tokens", "64", "--chat"]) == 0
    assert "warning" not in capsys.readouterr().err  # chat answers are what a chat model gives


def test_loadtest_against_nothing_says_why(capsys):
    """A server that is not up: the failed count and the first request's error (connection
    refused), exit 1; not only "0/2 ok"."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["loadtest", "--url", f"http://127.0.0.1:{port}", "--requests", "2", "--timeout", "5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "2 of 2 requests failed" in err[-1] and "ConnectError" in err[-1], err


def test_a_tools_mistake_is_one_line_naming_the_tool(tmp_path, capsys):
    from arborspec.tools.train import head_history

    missing = tmp_path / "none.json"
    assert head_history.main(["--training-json", str(missing)]) == 2
    assert capsys.readouterr().err == f"head_history: error: no training.json at {missing}\n"


def test_reports_mistakes_prints_the_first_line_and_lets_bugs_through(capsys):
    from arborspec.runtime.errors import InputError, one_line
    from arborspec.tools.errors import reports_mistakes

    @reports_mistakes("tool")
    def main(exc):
        raise exc

    assert main(InputError("first line\nsecond line")) == 2
    assert capsys.readouterr().err == "tool: error: first line\n"
    assert main(InputError("")) == 2  # an empty message names its type (was an IndexError in the server)
    assert capsys.readouterr().err == "tool: error: InputError\n"
    with pytest.raises(KeyError):  # a bug keeps its traceback
        main(KeyError("bug"))
    assert one_line(ValueError("\n  padded\nrest")) == "padded"
