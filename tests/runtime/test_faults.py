"""Faults and what they get (docs/faults.md): an export killed with SIGTERM
cleans up and exits 143 with one line; one killed with SIGKILL leaves a partial folder that the
next run removes; a write past a file-size limit is one line and leaves nothing; truncated,
bit-flipped and mismatched files are one line naming the file; property-based runs of the CLI
and the embedding API either work or fail with one line, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import random_model, tiny_config, tiny_text_export
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arborspec.runtime.errors import ArborspecError
from arborspec.tools.commands.cli import main

ARBOR = [sys.executable, "-m", "arborspec.tools.commands.cli"]


def _hf_folder(path: Path, hidden=64, layers=2, vocab=64) -> Path:
    from arborspec.tools.train.distill_draft import save_hf_folder

    save_hf_folder(random_model(tiny_config("llama", vocab=vocab, layers=layers, hidden=hidden, heads=4, kv=2)), path)
    return path


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory):
    """Big enough that its export takes seconds (something to interrupt), small enough for CI."""
    return _hf_folder(tmp_path_factory.mktemp("hf") / "m", hidden=256, layers=8, vocab=2048)


def _partials(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.partial-*"))


def _start_export(model: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ARBOR + ["export", "--model", str(model), "--draft", "layers:2", "--out", str(out), "-q"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_partial(proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    t0 = time.time()
    while not _partials(out):
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() - t0 < timeout
        time.sleep(0.05)
    time.sleep(0.5)  # well inside the export


def test_sigterm_removes_the_partial_export(big_hf, tmp_path):
    out = tmp_path / "e"
    proc = _start_export(big_hf, out)
    _wait_for_partial(proc, out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.strip().count("\n") == 0 and "terminated" in err and "Traceback" not in err
    assert not out.exists() and not _partials(out)


def test_a_signal_that_other_code_wrapped_still_ends_as_that_signal(monkeypatch, capsys):
    """SIGTERM inside a class body's __set_name__ (torch's lazy import of torch._dynamo, during an
    export) reaches the CLI as a RuntimeError caused by Terminated: it ended with that traceback and
    exit 1 (seen once in CI); it is the signal's exit and one line. A plain bug keeps its traceback."""
    from arborspec.tools.commands import cli, generate

    def wrapped(signal):
        def run(args):
            try:
                raise signal
            except KeyboardInterrupt as e:
                raise RuntimeError("Error calling __set_name__ on 'cached_property' instance") from e

        return run

    argv = ["generate", "--prompt", "x", "--model", "m"]
    monkeypatch.setattr(generate, "run", wrapped(cli.Terminated()))
    assert cli.main(argv) == 143
    assert capsys.readouterr().err == "arborspec: terminated (SIGTERM)\n"
    monkeypatch.setattr(generate, "run", wrapped(KeyboardInterrupt()))
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == "arborspec: interrupted\n"
    monkeypatch.setattr(generate, "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(argv)


def test_sigkill_partial_is_removed_by_the_next_run(big_hf, tmp_path):
    out = tmp_path / "e"
    proc = _start_export(big_hf, out)
    _wait_for_partial(proc, out)
    proc.kill()
    proc.wait(timeout=60)
    left = _partials(out)
    assert left and not out.exists()  # what a killed process leaves
    r = subprocess.run(
        ARBOR + ["export", "--model", str(big_hf), "--draft", "none", "--out", str(out), "-q", "--no-verify"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "partial export left by a run that was killed" in r.stderr and str(left[0].name) in r.stderr
    assert (out / "manifest.json").is_file() and not _partials(out)


def test_file_size_limit_is_one_line_and_leaves_nothing(big_hf, tmp_path):
    out = tmp_path / "e"
    cmd = " ".join(
        ARBOR + ["export", "--model", str(big_hf), "--draft", "none", "--out", str(out), "-q", "--no-verify"]
    )
    r = subprocess.run(["bash", "-c", f"ulimit -f 1024; exec {cmd}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("arborspec: error:") and "file too large" in err[-1] and "Traceback" not in r.stderr
    assert not out.exists() and not _partials(out)


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("faults") / "export", seed=2)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _generate(d: Path, capsys, *extra) -> tuple[int, str]:
    rc = main(["generate", "--export-dir", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json", *extra])
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_truncated_model_file(small_export, tmp_path, capsys):
    d = _copy(small_export, tmp_path / "t")
    f = d / "target.onnx"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _one_line(*_generate(d, capsys), "target.onnx")


def test_bit_flipped_model_file_caught_by_verify(small_export, tmp_path, capsys):
    d = _copy(small_export, tmp_path / "b")
    f = d / "draft.onnx"
    data = bytearray(f.read_bytes())
    data[len(data) - 100] ^= 0x40  # inside the weights: same size, loads, computes garbage
    f.write_bytes(bytes(data))
    _one_line(*_generate(d, capsys, "--verify"), "draft.onnx", "sha256")


def test_manifest_that_does_not_match_its_files(small_export, tmp_path, capsys):
    d = _copy(small_export, tmp_path / "m")
    man = json.loads((d / "manifest.json").read_text())
    man["target"]["config"]["n_layers"] = 7
    (d / "manifest.json").write_text(json.dumps(man))
    _one_line(*_generate(d, capsys), "differs from manifest.json")
    (d / "manifest.json").write_text("{not json")
    _one_line(*_generate(d, capsys), "manifest.json", "not valid JSON")


def test_tokenizer_that_does_not_match_the_export(small_export, tmp_path, capsys):
    d = _copy(small_export, tmp_path / "k")
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["added_tokens"][0]["content"] = "<|changed|>"
    (d / "tokenizer.json").write_text(json.dumps(tj))
    _one_line(*_generate(d, capsys), "tokenizer.json", "not the tokenizer")


SPECS = st.one_of(
    st.sampled_from(
        [
            "chain:3",
            "full:2,2",
            "beam:2,3",
            "dynamic:2,2,4",
            "full:0,2",
            "chain:x",
            "beam:",
            "nonsense",
            "dynamic:1,1",
            "full:99,99",
            "static:/nope.json",
        ]
    ),
    st.text(max_size=12),
)
IDS = st.one_of(st.lists(st.integers(-5, 400), max_size=6).map(lambda xs: ",".join(map(str, xs))), st.text(max_size=8))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tree=SPECS,
    ids=IDS,
    temp=st.sampled_from(["0", "0.7", "-1", "nan", "x"]),
    top_p=st.sampled_from(["1", "0.9", "0", "2"]),
    n_new=st.sampled_from(["1", "5", "0", "-3", "10000"]),
    mode=st.sampled_from(["tree", "chain", "vanilla"]),
)
def test_cli_generate_either_works_or_says_one_line(small_export, capsys, tree, ids, temp, top_p, n_new, mode):
    try:
        rc = main(
            [
                "generate",
                "--export-dir",
                str(small_export),
                "--mode",
                mode,
                "--tree",
                tree,
                "--prompt-ids",
                ids,
                "--temperature",
                temp,
                "--top-p",
                top_p,
                "--max-new-tokens",
                n_new,
                "--json",
            ]
        )
    except SystemExit as e:  # argparse's own one-line errors
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if rc == 0:
        assert json.loads(out)["tokens"] is not None
    else:
        assert rc == 2 and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def generator(small_export):
    from arborspec.runtime.generator import Generator

    return Generator.from_export(small_export, tree="full:2,2")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.one_of(st.text(max_size=20), st.lists(st.integers(-3, 400), max_size=8)),
    n_new=st.integers(-2, 12),
    temp=st.one_of(st.floats(-1, 2), st.just(float("nan"))),
    top_k=st.integers(-1, 5),
    top_p=st.one_of(st.floats(-0.5, 1.5), st.just(float("nan"))),
)
def test_embedding_api_either_works_or_raises_one_arborspec_error(generator, prompt, n_new, temp, top_k, top_p):
    try:
        c = generator.generate(prompt, n_new, temperature=temp, top_k=top_k, top_p=top_p)
    except ArborspecError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert 1 <= len(c.tokens) <= n_new and c.stop_reason in ("eos", "length", "context")


def test_stale_partial_of_a_live_process_is_left_alone(tmp_path):
    from arborspec.runtime.fileio import partial_dir, remove_stale_partials

    out = tmp_path / "x"
    mine = partial_dir(out)  # this process is alive: not stale
    dead = tmp_path / ".x.partial-999999999-abcd"
    dead.mkdir()
    assert remove_stale_partials(out) == [dead] and mine.exists() and not dead.exists()
    os.rmdir(mine)


def test_atomic_writes_sweep_what_a_killed_writer_left(tmp_path):
    from arborspec.runtime.fileio import atomic_write_bytes

    target = tmp_path / "target.engine"
    dead = tmp_path / ".target.engine.999999999.abc.tmp"  # a build killed mid-write
    dead.write_bytes(b"half")
    live = tmp_path / f".target.engine.{os.getpid()}.xyz.tmp"  # a write in progress here
    live.write_bytes(b"busy")
    atomic_write_bytes(target, b"engine")
    assert target.read_bytes() == b"engine" and not dead.exists() and live.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and p != live]


def test_partial_folder_publishes_whole_or_leaves_nothing(tmp_path):
    """The one "temp folder, rename, remove on failure" helper (export, caches, checkpoints)."""
    from arborspec.runtime.fileio import PartialFolder

    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with PartialFolder(out) as d:
            (d / "a").write_text("half")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []  # neither out nor a partial sibling
    for text in ("one", "two"):  # the second replaces the first
        with PartialFolder(out) as d:
            (d / "a").write_text(text)
        assert (out / "a").read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with PartialFolder(out, keep_existing=True) as d:  # another writer published first: it wins
        (d / "a").write_text("three")
    assert (out / "a").read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_top_p_below_float32_range_keeps_the_top_token():
    """Found by the hypothesis suite: top_p = 2e-313 rounds to 0 in float32 and used to drop every
    token (NaN probabilities). The most likely token always stays."""
    import torch

    from arborspec.runtime.sampling import SamplingParams, probs

    p = probs(torch.tensor([[1.0, 3.0, 2.0]]), SamplingParams(1.0, 0, 2.2250738585e-313))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0]]))


def test_a_temperature_near_zero_is_nearly_greedy_not_nan():
    """Found by the hypothesis suite: temperature 1e-308 overflowed the logits to +inf (NaN)."""
    import torch

    from arborspec.runtime.sampling import SamplingParams, probs

    p = probs(torch.tensor([[1.0, 3.0, 2.0], [float("-inf")] * 3]), SamplingParams(1.1125369292536007e-308))
    assert torch.equal(p[0], torch.tensor([0.0, 1.0, 0.0]))
