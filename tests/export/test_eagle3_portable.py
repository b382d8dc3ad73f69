"""The portable EAGLE-3 head (`export --draft eagle3:CKPT --attention onnx`): standard-ONNX head
graphs in the "sbhd" cache layout beside the portable target with its `hidden_states` output;
ONNX Runtime greedy tree decoding with them == vanilla (and proposes what the PyTorch head
proposes); `compare` covers both head graphs; tensorrt_rtx builds engines for them ahead of
time on the CPU (engines.json lists draft + draft_fc with their profiles); the GroupQueryAttention
head is one line in `arborspec build`. Running the engines needs a CUDA GPU and skips without one.

Role in one decode step: step 1 (the head's draft levels) and the verify call's features.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import random_model, tiny_config
from test_eagle3 import checkpoint

from arborspec.models.eagle3 import default_aux_layers, load_eagle3
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.eagle3 import Eagle3Draft

pytest.importorskip("onnxruntime")
HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx not installed (pip install tensorrt-rtx)")
HAS_GPU = torch.cuda.is_available()
PROMPT = [5, 9, 2, 7, 1]
MAX_TREE_NODES = 16


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """(folder, target module, torch head): a tiny Llama target + a random EAGLE-3 checkpoint
    exported with --attention onnx."""
    from arborspec.export.export_folder import export_folder

    d = tmp_path_factory.mktemp("e3portable")
    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    checkpoint(d / "ckpt", m.config, 40, seed=5)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    t0 = time.perf_counter()
    export_folder(
        lm,
        d / "exp",
        f"eagle3:{d / 'ckpt'}",
        max_context=128,
        max_tree_nodes=MAX_TREE_NODES,
        attention="onnx",
        progress=False,
    )
    print(f"\nportable EAGLE-3 export (target + head, with both self-checks): {time.perf_counter() - t0:.1f}s")
    return d / "exp", m, load_eagle3(d / "ckpt", m.config)


def test_portable_head_graphs_are_standard_onnx_in_the_contract(portable):
    import onnx

    from arborspec.runtime import contract as C
    from arborspec.runtime.drafts.eagle3 import OrtEagle3Head

    out, m, head = portable
    man = json.loads((out / "manifest.json").read_text())
    d = man["draft"]
    assert d["kind"] == "eagle3" and d["kv_layout"] == "sbhd" and d["exporter"].startswith("eagle3-dynamo")
    assert d["aux_layers"] == default_aux_layers(4) and d["max_abs_diff"] < 1e-3
    for name in ("target.onnx", d["file"], d["fc_file"]):
        g = onnx.load(str(out / name))
        assert {n.domain for n in g.graph.node} <= {"", "ai.onnx"}, name  # no contrib op (TensorRT parses it)
        meta = {p.key: p.value for p in g.metadata_props}
        assert meta[C.META_KV_LAYOUT] == "sbhd", name
    layer = onnx.load(str(out / d["file"]))
    assert [i.name for i in layer.graph.input] == [*C.input_names(1), C.HIDDEN_IN]
    assert [o.name for o in layer.graph.output] == [*C.output_names(1), C.HIDDEN_STATES]
    meta = {p.key: p.value for p in layer.metadata_props}
    assert meta[C.META_ROLE] == C.ROLE_EAGLE3 and meta[C.META_D2T]
    tmeta = {p.key: p.value for p in onnx.load(str(out / "target.onnx")).metadata_props}
    assert json.loads(tmeta[C.META_FEATURE_LAYERS]) == default_aux_layers(4)
    h = OrtEagle3Head(out / d["file"], out / d["fc_file"])
    assert h.info.cache.layout == "sbhd" and torch.equal(h.token_map, head.token_map())
    h.close()


@pytest.mark.parametrize("spec", ["chain:3", "full:2,3", "dynamic:3,3,10"])
def test_greedy_with_the_portable_head_equals_vanilla_on_onnxruntime(portable, spec):
    from arborspec.runtime.export_dir import open_export

    out, m, head = portable
    mode = "chain" if spec.startswith("chain") else "tree"
    with open_export(out, "onnxruntime", draft="eagle3", load_tok=False) as ex:
        assert isinstance(ex.draft, Eagle3Draft) and ex.draft.spec.layout == "sbhd"
        assert ex.target.info.n_features == 3 * 64
        ref = SpeculativeDecoder(ex.target, mode="vanilla").generate(PROMPT, 30).tokens
        res = SpeculativeDecoder(ex.target, ex.draft, mode=mode, tree=spec).generate(PROMPT, 30)
        assert res.tokens == ref and res.stats.draft_calls > 0
        # the exported head proposes what the PyTorch head proposes: the same acceptance per step
        twin = SpeculativeDecoder(
            ex.target, Eagle3Draft(head, m.model.embed_tokens.weight.detach()), mode=mode, tree=spec
        ).generate(PROMPT, 30)
        assert res.stats.accepted_hist == twin.stats.accepted_hist
        assert res.stats.draft_calls == twin.stats.draft_calls


def test_compare_covers_the_portable_head(portable):
    from arborspec.tools.compare.comparison import compare_export

    out, m, head = portable
    rep = compare_export(out, "torch,onnxruntime", target_module=m, draft_module=head, progress=False)
    seen = {(r.graph, r.output) for r in rep.rows}
    assert rep.passed
    assert {
        ("target", "hidden_states"),
        ("draft", "logits"),
        ("draft", "hidden_states"),
        ("draft", "hidden_in"),
    } <= seen
    assert {("draft", "new_key.0"), ("draft", "new_value.0")} <= seen


@needs_rtx
def test_build_engines_for_the_portable_head_ahead_of_time(portable, tmp_path, capsys, monkeypatch):
    from arborspec.runtime import contract as C
    from arborspec.tools.commands.cli import main

    out, _, _ = portable
    monkeypatch.setenv("ARBORSPEC_TRT_MODULE", "tensorrt_rtx")
    edir = tmp_path / "engines"
    t0 = time.perf_counter()
    argv = ["build", "--export-dir", str(out), "--compute-capability", "8.9", "--max-tree-nodes", "8"]
    assert main([*argv, "--max-context", "64", "--out", str(edir)]) == 0
    print(f"\ntensorrt_rtx AOT build of target + head (2 graphs) for SM 8.9: {time.perf_counter() - t0:.1f}s")
    printed = capsys.readouterr().out
    assert "draft_fc:" in printed and "projection: N 1..64" in printed
    man = json.loads((edir / "engines.json").read_text())
    assert set(man["engines"]) == {"target", "draft", "draft_fc"}
    for name in ("target", "draft", "draft_fc"):
        assert (edir / f"{name}.engine").stat().st_size > 0
    t, d, fc = (man["engines"][k] for k in ("target", "draft", "draft_fc"))
    assert [o["name"] for o in t["outputs"]][-1] == C.HIDDEN_STATES and t["outputs"][-1]["shape"][-1] == 3 * 64
    assert [i["name"] for i in d["inputs"]] == [*C.input_names(1), C.HIDDEN_IN]
    assert [o["name"] for o in d["outputs"]] == [*C.output_names(1), C.HIDDEN_STATES]
    assert d["role"] == C.ROLE_EAGLE3 and d["onnx_metadata"][C.META_D2T]
    # the draft's profiles: T up to max tree nodes + 1; P over the head's own cache (the context
    # plus one tree's scratch entries)
    assert [p["name"] for p in d["profiles"]] == ["decode", "prefill"]
    dec = d["profiles"][0]
    assert dec["ranges"]["T"] == [1, 9, 9] and dec["ranges"]["P"][2] == 64 + 8
    assert dec["shapes"][C.HIDDEN_IN]["max"] == [1, 9, 64]
    assert fc["profiles"][0]["ranges"] == {"N": [1, 9, 64]} and fc["inputs"][0]["shape"] == [-1, 3 * 64]


def test_build_refuses_the_gqa_head_in_one_line(portable, tmp_path, capsys):
    """A head written as ONNX Runtime's GroupQueryAttention graph cannot be built: one line,
    before any TensorRT work (needs no TensorRT module)."""
    from arborspec.export.eagle3_graph import export_eagle3_head
    from arborspec.tools.commands.cli import main

    out, m, head = portable
    gqa = tmp_path / "gqa"
    shutil.copytree(out, gqa)
    export_eagle3_head(head, m.model.embed_tokens.weight.detach(), gqa, 128, verify=False, portable=False)
    assert main(["build", "--export-dir", str(gqa), "--compute-capability", "8.9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "re-export with --attention onnx" in err and "EAGLE-3 head" in err, err
    assert not (gqa / "engines").exists()


@needs_rtx
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="running TensorRT engines needs a CUDA GPU (none here)")
def test_greedy_with_the_head_on_tensorrt_equals_vanilla(portable, tmp_path, monkeypatch):
    from arborspec.export.trt_build import EngineBuildError
    from arborspec.runtime.export_dir import open_export
    from arborspec.tools.commands.cli import main

    out, _, _ = portable
    work = tmp_path / "exp"
    shutil.copytree(out, work)
    cc = "%d.%d" % torch.cuda.get_device_capability()
    try:
        from arborspec.export.trt_build import import_tensorrt, supported_compute_capabilities

        trt, flav = import_tensorrt()
        if flav == "tensorrt_rtx" and cc not in supported_compute_capabilities(trt):
            pytest.skip(f"{flav} cannot build for this GPU (compute capability {cc})")
    except EngineBuildError as e:
        pytest.skip(str(e).splitlines()[0])
    assert main(["build", "--export-dir", str(work), "--max-tree-nodes", "16", "--max-context", "128"]) == 0
    with open_export(work, "onnxruntime", draft="none", load_tok=False) as ex:
        ref = SpeculativeDecoder(ex.target, mode="vanilla").generate(PROMPT, 30).tokens
    with open_export(work, "tensorrt", device="cuda", draft="eagle3", load_tok=False) as ex:
        assert isinstance(ex.draft, Eagle3Draft) and ex.target.info.n_features == 3 * 64
        for spec in ("chain:3", "dynamic:3,3,10"):
            mode = "chain" if spec.startswith("chain") else "tree"
            res = SpeculativeDecoder(ex.target, ex.draft, mode=mode, tree=spec).generate(PROMPT, 30)
            assert res.tokens == ref and res.stats.draft_calls > 0
