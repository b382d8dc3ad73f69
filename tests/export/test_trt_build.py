"""TensorRT engine build, ahead of time on this (CPU-only) machine, and the TensorRT backend.

Role in one decoding step: none directly; these check that the engines the `tensorrt` backend
runs for draft levels, verify calls and prefills are built from the contract ONNX with
profiles that hold the decode loop's limits, and that `arborspec build` reports mistakes in
one line. Tiny exported models (Llama with GQA, GPT-2; 2 layers, hidden 32) are built with
tensorrt_rtx for SM 8.9 without a GPU: the serialized engine, engines.json and the parsed
network's I/O are checked. Running an engine (TrtEngine vs TorchEngine) needs a CUDA GPU and
skips with a reason without one.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from arborspec.models import ModelConfig, build_model

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
HAS_TRT = importlib.util.find_spec("tensorrt") is not None
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx not installed (pip install tensorrt-rtx)")
HAS_GPU = torch.cuda.is_available()
L = 2
CONTRACT_IN = ["input_ids", "position_ids", "attention_mask"] + [
    f"past_{k}.{i}" for i in range(L) for k in ("key", "value")
]
CONTRACT_OUT = ["logits"] + [f"new_{k}.{i}" for i in range(L) for k in ("key", "value")]


def tiny_cfg(family: str) -> ModelConfig:
    kv = 2 if family == "llama" else 4
    return ModelConfig(
        family=family,
        vocab_size=96,
        hidden_size=32,
        n_layers=L,
        n_heads=4,
        n_kv_heads=kv,
        head_dim=8,
        intermediate_size=64,
        max_position=256,
        name=f"tiny-{family}",
    )


def export_onnx(module, path: Path) -> Path:
    """The export engineer's exporter when present, else a minimal dynamo export here."""
    try:
        from arborspec.export.onnx_export import export_contract_onnx
    except ImportError:
        export_contract_onnx = None
    if export_contract_onnx is not None:
        export_contract_onnx(module, path, opset=23, dtype="fp32", verify=False)
        return path
    cfg = module.config
    b, t, p = 2, 3, 5  # distinct sizes >= 2 (a size of 1 silently becomes a constant)
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    pos = torch.arange(p, p + t).expand(b, t).contiguous()
    mask = torch.ones(b, t, p + t, dtype=torch.bool)
    past = tuple(torch.randn(p, b, cfg.n_kv_heads, cfg.head_dim) for _ in range(2 * L))
    B, T, P, S = (torch.export.Dim(n) for n in "BTPS")
    shapes = {
        "input_ids": {0: B, 1: T},
        "position_ids": {0: B, 1: T},
        "attention_mask": {0: B, 1: T, 2: S},
        "past": tuple({0: P, 1: B} for _ in past),
    }

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, position_ids, attention_mask, *past):
            return self.m(input_ids, position_ids, attention_mask, *past)

    torch.onnx.export(
        Wrap(module),
        (ids, pos, mask) + past,
        str(path),
        dynamo=True,
        opset_version=23,
        input_names=CONTRACT_IN,
        output_names=CONTRACT_OUT,
        dynamic_shapes=shapes,
        external_data=False,
    )
    return path


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """An export folder: llama (GQA) target.onnx, gpt2 draft.onnx."""
    d = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    export_onnx(build_model(tiny_cfg("llama")).eval(), d / "target.onnx")
    export_onnx(build_model(tiny_cfg("gpt2")).eval(), d / "draft.onnx")
    return d


LIMITS = dict(max_batch=2, max_tree_nodes=8, max_context=64)


# ------------------------------------------------------------------- planning (no TensorRT)


def test_profiles_cover_the_limits_and_are_self_consistent():
    from arborspec.export.trt_build import plan_profiles

    profs = plan_profiles(2, 8, 64)
    assert [p.name for p in profs] == ["decode", "prefill"]
    dec, pre = profs
    assert dec.T == (1, 9, 9) and dec.P[2] == 63 and pre.T[2] == 64 and pre.P == (0, 0, 63)
    for p in profs:
        assert p.B == (1, 2, 2)
        assert all(s == t + q for s, t, q in zip(p.S, p.T, p.P))
    # every legal call (P + T <= max_context) is covered by some profile
    for t in range(1, 65):
        for q in range(0, 65 - t):
            assert any(p.covers(2, t, q) for p in profs), (t, q)
    # a tree as large as the context: one profile suffices
    assert [p.name for p in plan_profiles(1, 63, 64)] == ["prefill"]


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(max_batch=1, max_tree_nodes=64, max_context=64), "no profile can hold"),
        (dict(max_batch=0, max_tree_nodes=8, max_context=64), "max_batch"),
        (dict(max_batch=1, max_tree_nodes=8, max_context=1), "max_context"),
    ],
)
def test_limits_no_profile_can_hold(kw, msg):
    from arborspec.export.trt_build import EngineBuildError, plan_profiles

    with pytest.raises(EngineBuildError, match=msg):
        plan_profiles(**kw)


def test_compute_capability_spelling():
    from arborspec.export.trt_build import EngineBuildError
    from arborspec.export.trt_build import normalize_compute_capability as n

    assert n("8.9") == n("89") == n("sm_89") == n("SM89") == n((8, 9)) == "8.9"
    assert n("12.0") == n("sm120") == "12.0"
    with pytest.raises(EngineBuildError, match="bad compute capability"):
        n("ampere")


def test_backend_imports_without_tensorrt_and_picks_profiles():
    from arborspec.runtime.backends import tensorrt as backend

    eng = object.__new__(backend.TrtEngine)
    eng.path = Path("x.engine")
    eng.profiles = [
        {"B": (1, 2), "T": (1, 9), "P": (0, 63), "S": (1, 72)},
        {"B": (1, 2), "T": (1, 64), "P": (0, 63), "S": (1, 127)},
    ]
    assert eng.profile_for(1, 9, 50) == 0
    assert eng.profile_for(2, 40, 0) == 1
    with pytest.raises(ValueError, match="no optimisation profile"):
        eng.profile_for(3, 1, 0)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU error")
def test_trt_engine_without_gpu_says_so(tmp_path):
    from arborspec.runtime.backends.tensorrt import TrtEngine

    f = tmp_path / "t.engine"
    f.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        TrtEngine(f)


@pytest.mark.skipif(HAS_TRT, reason="`tensorrt` is installed here")
def test_forcing_a_missing_module_says_how_to_install(monkeypatch):
    from arborspec.export.trt_build import TensorRTNotInstalled, import_tensorrt

    monkeypatch.setenv("ARBORSPEC_TRT_MODULE", "tensorrt")
    with pytest.raises(TensorRTNotInstalled, match="pip install tensorrt-rtx"):
        import_tensorrt()


# ------------------------------------------------------------------- builds (tensorrt_rtx)


@needs_rtx
@pytest.mark.parametrize("name", ["target", "draft"])
def test_aot_build_sm89_and_manifest(export_dir, tmp_path, name):
    from arborspec.export.trt_build import build_engine, engine_entry, sha256_file

    onnx_path = export_dir / f"{name}.onnx"
    t0 = time.perf_counter()
    r = build_engine(onnx_path, tmp_path / f"{name}.engine", compute_capability="8.9", flavour="tensorrt_rtx", **LIMITS)
    dt = time.perf_counter() - t0
    print(
        f"\n{name}: AOT build for SM 8.9 took {dt:.2f}s "
        f"(builder {r.entry['build_seconds']:.2f}s), engine {r.entry['bytes']} bytes"
    )
    assert r.engine_path.stat().st_size > 0
    man = json.loads((tmp_path / "engines.json").read_text())
    e = man["engines"][name]
    assert e == engine_entry(r.engine_path)
    assert e["compute_capability"] == "8.9"
    assert e["trt"]["module"] == "tensorrt_rtx" and e["trt"]["version"]
    assert e["onnx_sha256"] == sha256_file(onnx_path)
    assert e["limits"] == LIMITS
    assert e["cache"] == {"kind": "runtime", "file": f"{name}.engine.runtime.cache"}
    assert [d["name"] for d in e["inputs"]] == CONTRACT_IN
    assert [d["name"] for d in e["outputs"]] == CONTRACT_OUT
    dtypes = {d["name"]: d["dtype"] for d in e["inputs"] + e["outputs"]}
    assert dtypes["input_ids"] == dtypes["position_ids"] == "int64"
    assert dtypes["attention_mask"] == "bool"
    assert {dtypes[n] for n in CONTRACT_IN[3:] + CONTRACT_OUT} == {"float32"}
    cfg = tiny_cfg("llama" if name == "target" else "gpt2")
    assert [p["name"] for p in e["profiles"]] == ["decode", "prefill"]
    for p in e["profiles"]:
        sh = p["shapes"]
        for k in ("min", "opt", "max"):
            b, t = sh["input_ids"][k]
            pk = sh["past_key.0"][k]
            assert sh["position_ids"][k] == [b, t]
            assert sh["attention_mask"][k] == [b, t, pk[0] + t]  # S = P + T
            assert pk == [pk[0], b, cfg.n_kv_heads, cfg.head_dim]
            assert sh["past_value.1"][k] == pk
    dec = e["profiles"][0]["shapes"]
    assert dec["input_ids"]["max"] == [2, 9] and dec["past_key.0"]["min"][0] == 0


@needs_rtx
def test_parsed_network_matches_contract(export_dir):
    """Inspect the INetworkDefinition the build uses (no GPU, no build)."""
    from arborspec.export import trt_build as tb

    trt, _ = tb.import_tensorrt("tensorrt_rtx")
    builder = trt.Builder(tb._logger(trt))
    network, _parser, _mapped = tb._parse(trt, builder, tb._logger(trt), export_dir / "target.onnx")
    io = tb.network_io(trt, network)
    tb.check_contract(io)
    shapes = {d["name"]: d["shape"] for d in io["inputs"] + io["outputs"]}
    assert [d["name"] for d in io["inputs"]] == CONTRACT_IN
    assert [d["name"] for d in io["outputs"]] == CONTRACT_OUT
    assert shapes["input_ids"] == [-1, -1] and shapes["attention_mask"] == [-1, -1, -1]
    assert shapes["past_key.0"] == [-1, -1, 2, 8] and shapes["new_value.1"] == [-1, -1, 2, 8]
    assert shapes["logits"] == [-1, -1, 96]


@needs_rtx
def test_unsupported_compute_capability(export_dir, tmp_path):
    from arborspec.export.trt_build import EngineBuildError, build_engine

    with pytest.raises(EngineBuildError, match=r"9\.0 is not supported.*supported are .*8\.9"):
        build_engine(
            export_dir / "target.onnx",
            tmp_path / "t.engine",
            compute_capability="9.0",
            flavour="tensorrt_rtx",
            **LIMITS,
        )
    assert not (tmp_path / "t.engine").exists()


@needs_rtx
def test_static_batch_onnx_cannot_hold_max_batch(export_dir, tmp_path):
    import onnx

    from arborspec.export.trt_build import EngineBuildError, build_engine

    m = onnx.load(str(export_dir / "target.onnx"))
    for inp in m.graph.input:  # B exported with size 1 (the silent-constant trap)
        axis = 1 if inp.name.startswith("past_") else 0
        inp.type.tensor_type.shape.dim[axis].dim_value = 1
    bad = tmp_path / "static_b.onnx"
    onnx.save(m, str(bad))
    with pytest.raises(EngineBuildError, match="no profile can hold the limits.*fixes dimension 0"):
        build_engine(bad, tmp_path / "t.engine", compute_capability="8.9", flavour="tensorrt_rtx", **LIMITS)


@needs_rtx
def test_unsupported_op_is_named(export_dir, tmp_path):
    import onnx

    from arborspec.export.trt_build import EngineBuildError, build_engine

    m = onnx.load(str(export_dir / "draft.onnx"))
    node = next(n for n in m.graph.node if n.op_type == "Softmax")
    node.op_type, node.domain = "NoSuchOp", "com.example"
    m.opset_import.add(domain="com.example", version=1)
    bad = tmp_path / "bad_op.onnx"
    onnx.save(m, str(bad))
    with pytest.raises(EngineBuildError, match=r"cannot parse.*unsupported or rejected ops: NoSuchOp"):
        build_engine(bad, tmp_path / "t.engine", compute_capability="8.9", flavour="tensorrt_rtx", **LIMITS)


@needs_rtx
def test_not_an_onnx_file(tmp_path):
    from arborspec.export.trt_build import EngineBuildError, build_engine

    bad = tmp_path / "junk.onnx"
    bad.write_bytes(b"this is not a protobuf\x00\xff" * 10)
    with pytest.raises(EngineBuildError, match="not an ONNX model|cannot parse"):
        build_engine(bad, tmp_path / "t.engine", compute_capability="8.9", flavour="tensorrt_rtx", **LIMITS)
    with pytest.raises(FileNotFoundError):
        build_engine(
            tmp_path / "missing.onnx", tmp_path / "t.engine", compute_capability="8.9", flavour="tensorrt_rtx", **LIMITS
        )


@needs_rtx
def test_cli_build(export_dir, tmp_path, capsys, monkeypatch):
    from arborspec.tools.commands.cli import main

    monkeypatch.setenv("ARBORSPEC_TRT_MODULE", "tensorrt_rtx")
    out = tmp_path / "engines"
    rc = main(
        [
            "build",
            "--export-dir",
            str(export_dir),
            "--compute-capability",
            "8.9",
            "--max-batch",
            "1",
            "--max-tree-nodes",
            "4",
            "--max-context",
            "32",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    man = json.loads((out / "engines.json").read_text())
    assert set(man["engines"]) == {"target", "draft"}
    assert (out / "target.engine").stat().st_size > 0 and (out / "draft.engine").stat().st_size > 0
    capsys.readouterr()

    for argv, msg in [
        (["--export-dir", str(tmp_path / "nope")], "export folder not found"),
        (["--export-dir", str(export_dir), "--compute-capability", "9.0"], "supported are"),
        (
            [
                "--export-dir",
                str(export_dir),
                "--compute-capability",
                "8.9",
                "--max-tree-nodes",
                "40",
                "--max-context",
                "32",
            ],
            "no profile can hold",
        ),
    ]:
        assert main(["build", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


# ------------------------------------------------------------------- running (GPU only)


@pytest.mark.skipif(not (HAS_RTX or HAS_TRT), reason="no TensorRT module installed")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="running a TensorRT engine needs a CUDA GPU")
def test_trt_engine_matches_torch(export_dir, tmp_path):
    from arborspec.export.trt_build import build_engine
    from arborspec.runtime.backends.tensorrt import TrtEngine
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.kvcache import KVCache

    torch.manual_seed(0)
    module = build_model(tiny_cfg("llama")).eval()
    onnx_path = export_onnx(module, tmp_path / "target.onnx")
    from arborspec.export.trt_build import EngineBuildError

    try:
        build_engine(onnx_path, tmp_path / "target.engine", **LIMITS)
    except EngineBuildError as e:
        if "is not supported by" in str(e):  # e.g. TensorRT-RTX on a Hopper (SM 9.0) GPU
            pytest.skip(str(e).splitlines()[0])
        raise
    eng = TrtEngine(tmp_path / "target.engine")
    ref = TorchEngine(module, device="cuda")
    caches = [KVCache(eng.info.cache, 64, batch=1, device="cuda") for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    # prefill 10 tokens (P = 0), then a 5-node tree (siblings share a position)
    ids = torch.randint(0, 96, (1, 10), generator=g).cuda()
    pos = torch.arange(10).unsqueeze(0).cuda()
    mask = torch.ones(10, 10, dtype=torch.bool).tril().unsqueeze(0).cuda()
    outs = [e.forward(ids, pos, mask, c) for e, c in zip((eng, ref), caches)]
    torch.cuda.synchronize()
    assert (outs[0] - outs[1]).abs().max() < 1e-3
    assert torch.allclose(caches[0].k[:, :10], caches[1].k[:, :10], atol=1e-4)
    for c in caches:
        c.commit(None, 10)
    parents = [-1, 0, 0, 1, 2]
    anc = torch.eye(5, dtype=torch.bool)
    depth = [0] * 5
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    ids = torch.randint(0, 96, (1, 5), generator=g).cuda()
    pos = (10 + torch.tensor(depth)).unsqueeze(0).cuda()
    mask = torch.cat([torch.ones(5, 10, dtype=torch.bool), anc], 1).unsqueeze(0).cuda()
    outs = [e.forward(ids, pos, mask, c) for e, c in zip((eng, ref), caches)]
    torch.cuda.synchronize()
    assert (outs[0] - outs[1]).abs().max() < 1e-3
    assert torch.allclose(caches[0].v[:, 10:15], caches[1].v[:, 10:15], atol=1e-4)
    eng.close()
