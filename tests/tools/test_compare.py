"""`arborspec compare` (Polygraphy Comparator, PyTorch vs ONNX Runtime on runtime-made feeds)
and the Polygraphy data-loader script, on tiny exports whose source is saved to disk (an HF
folder for llama with GQA, a nanoGPT checkpoint for gpt2), as a user's would be."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("polygraphy")

from conftest import random_model, tiny_config  # noqa: E402

from arborspec.export.export_folder import export_folder  # noqa: E402
from arborspec.tools.commands.cli import main  # noqa: E402

POLYGRAPHY = Path(sys.executable).parent / "polygraphy"


def save_hf_llama(m, d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    c = m.config
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "num_hidden_layers": c.n_layers,
                "num_attention_heads": c.n_heads,
                "num_key_value_heads": c.n_kv_heads,
                "head_dim": c.head_dim,
                "intermediate_size": c.intermediate_size,
                "max_position_embeddings": c.max_position,
                "rope_theta": c.rope_theta,
                "rms_norm_eps": c.norm_eps,
                "tie_word_embeddings": c.tie_embeddings,
            }
        )
    )
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in m.state_dict().items() if not (c.tie_embeddings and k == "lm_head.weight")}
    save_file(sd, str(d / "model.safetensors"))
    return d


def save_nanogpt(m, path: Path) -> Path:
    c = m.config
    torch.save(
        {
            "model_args": {
                "n_layer": c.n_layers,
                "n_head": c.n_heads,
                "n_embd": c.hidden_size,
                "block_size": c.max_position,
                "vocab_size": c.vocab_size,
                "bias": True,
            },
            "model": {k: v.clone() for k, v in m.state_dict().items()},
        },
        str(path),
    )
    return path


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def export(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"cmp-{request.param}")
    if request.param == "llama":  # GQA: 4 heads, 2 KV heads
        src = save_hf_llama(random_model(tiny_config("llama", max_position=256)), d / "src")
    else:
        src = save_nanogpt(random_model(tiny_config("gpt2", max_position=256), seed=1), d / "ckpt.pt")
    out = d / "export"
    export_folder(str(src), out, draft="layers:1", progress=False, verify=False)
    return out


def run_cli(args, capsys):
    rc = main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_compare_passes(export, capsys):
    rc, out, err = run_cli(["compare", "--export-dir", str(export), "--no-progress"], capsys)
    assert rc == 0, out + err
    assert "PASSED" in out
    for graph in ("target", "draft"):
        assert f"\n{graph} " in out
    # every policy and the T range reach the table
    for name in (
        "prefill",
        "decode (vanilla)",
        "chain:4",
        "full:2,3",
        "beam:2,4,4",
        "static:file",
        "dynamic:8,3,64 (64 nodes) T=65",
    ):
        assert name in out, name
    if not torch.cuda.is_available():
        assert "skipped: no GPU" in out


def _perturb(src: Path, dst: Path) -> str:
    """Copy an export and add noise to one target initializer (manifest size/sha updated, as a
    broken exporter would have written them)."""
    import onnx
    from onnx import numpy_helper

    from arborspec.export.onnx_export import sha256_file

    shutil.copytree(src, dst)
    path = dst / "target.onnx"
    model = onnx.load(str(path))
    init = max((i for i in model.graph.initializer if len(i.dims) == 2), key=lambda i: np.prod(i.dims))
    arr = numpy_helper.to_array(init).copy()
    arr += np.random.default_rng(0).normal(0, 0.05, arr.shape).astype(arr.dtype)
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, str(path))
    man = json.loads((dst / "manifest.json").read_text())
    man["target"]["bytes"] = path.stat().st_size
    man["target"]["sha256"] = sha256_file(path)
    (dst / "manifest.json").write_text(json.dumps(man))
    return init.name


def test_compare_fails_on_perturbed_weights(export, tmp_path, capsys):
    bad = tmp_path / "bad"
    _perturb(export, bad)
    rc, out, err = run_cli(
        ["compare", "--export-dir", str(bad), "--runners", "torch,onnxruntime", "--no-progress"], capsys
    )
    assert rc == 1, out + err
    assert "FAILED" in out and "target:logits" in out
    assert "FAIL " in out or out.rstrip().endswith("FAIL") or " FAIL" in out
    assert "draft:" not in out.splitlines()[-1]  # the draft graph is untouched


def test_compare_usage_errors(export, tmp_path, capsys):
    rc, out, err = run_cli(["compare", "--export-dir", str(tmp_path / "nope")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    rc, out, err = run_cli(["compare", "--export-dir", str(export), "--runners", "torch,nope"], capsys)
    assert rc == 2 and "unknown runner" in err
    rc, out, err = run_cli(["compare", "--export-dir", str(export), "--runners", "torch"], capsys)
    assert rc == 2 and "two" in err
    if not torch.cuda.is_available():
        rc, out, err = run_cli(["compare", "--export-dir", str(export), "--runners", "torch,tensorrt"], capsys)
        assert rc == 2 and "no GPU" in err and err.count("\n") == 1


def test_save_and_replay_with_polygraphy_cli(export, tmp_path, capsys):
    if "llama" not in str(export):
        pytest.skip("one family is enough for the replay")
    i, o = tmp_path / "in.json", tmp_path / "out.json"
    rc, out, err = run_cli(
        [
            "compare",
            "--export-dir",
            str(export),
            "--runners",
            "torch,onnxruntime",
            "--save-inputs",
            str(i),
            "--save-outputs",
            str(o),
            "--no-progress",
        ],
        capsys,
    )
    assert rc == 0, out + err
    assert i.is_file() and o.is_file() and (tmp_path / "in.draft.json").is_file()
    r = subprocess.run(
        [
            str(POLYGRAPHY),
            "run",
            str(export / "target.onnx"),
            "--onnxrt",
            "--load-inputs",
            str(i),
            "--load-outputs",
            str(o),
            "--atol",
            "1e-4",
            "--rtol",
            "1e-3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASSED" in r.stdout + r.stderr


def test_polygraphy_run_with_data_loader_script(export, tmp_path):
    """The command documented in arborspec.tools.compare.polygraphy_data_loader runs our feeds."""
    from polygraphy.comparator import RunResults

    import arborspec.tools.compare.polygraphy_data_loader as dl

    if "gpt2" not in str(export):
        pytest.skip("one family is enough for the CLI run")
    saved = tmp_path / "ort.json"
    for graph in ("target", "draft"):
        r = subprocess.run(
            [
                str(POLYGRAPHY),
                "run",
                str(export / f"{graph}.onnx"),
                "--onnxrt",
                "--data-loader-script",
                dl.__file__,
                "--save-outputs",
                str(saved),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        res = RunResults.load(str(saved))
        ((_, iters),) = res.items()
        ts = [it["logits"].shape[1] for it in iters]
        feeds = dl.feeds(export, graph)
        assert len(iters) == len(feeds) >= 5
        assert ts == [f["input_ids"].shape[1] for f in feeds]
        ps = [f["attention_mask"].shape[2] - f["input_ids"].shape[1] for f in feeds]
        assert 0 in ps and any(p > 0 for p in ps)
        assert 1 in ts and len({t for t in ts if t >= 2}) >= 2
        if graph == "target":
            assert max(ts) == 65  # dynamic tree at max_tree_nodes = 64, + the root


def test_feeds_cover_every_policy():
    from conftest import truncated

    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.tools.compare.comparison import build_feeds

    m = random_model(tiny_config("llama"))
    f = build_feeds(TorchEngine(m), TorchEngine(truncated(m, 1)), max_tree_nodes=20, trees=2)
    names = " | ".join(x.name for x in f["target"])
    for k in ("prefill", "decode", "chain:4", "full:2,3", "beam:2,4,4", "static:file", "dynamic:8,3,20"):
        assert k in names
    ts = [x.t for x in f["target"]]
    assert max(ts) == 21 and 1 in ts
    assert {x.p for x in f["target"] if "verify" in x.name} == {9, 12}  # P > 0, one per tree
    assert any(x.p == 0 for x in f["draft"]) and any(x.p > 0 and x.t > 1 for x in f["draft"])
    # a verify feed is the runtime's: positions past + depth, the mask sees the whole past
    v = next(x for x in f["target"] if x.name.startswith("verify full"))
    assert v.data["attention_mask"][0, :, : v.p].all()
    assert v.data["position_ids"][0, 0] == v.p and v.data["position_ids"].max() == v.p + 2
