"""Export folder: graphs (symbolic dims, checker, IR version, metadata), manifest, the runtime
loader, and one clear error per bad input (foreign ONNX, other contract version, missing
external data, draft vocabulary mismatch), with no half folder left behind."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from arborspec import CONTRACT_VERSION  # noqa: E402
from arborspec.export.export_folder import export_folder, truncated_draft  # noqa: E402
from arborspec.export.onnx_export import MAX_IR_VERSION, check_symbolic_inputs  # noqa: E402
from arborspec.models import ModelConfig, build_model  # noqa: E402
from arborspec.runtime.backends.torch_backend import TorchEngine  # noqa: E402
from arborspec.runtime.export_dir import ExportDirError, load_export_dir, read_manifest  # noqa: E402
from arborspec.runtime.kvcache import KVCache  # noqa: E402


@dataclass
class Loaded:  # the shape of arborspec.models.registry.LoadedModel
    module: torch.nn.Module
    config: ModelConfig
    tokenizer: object = None
    source: dict = field(default_factory=dict)


def tiny(family: str, vocab: int = 64) -> ModelConfig:
    if family == "llama":
        return ModelConfig("llama", vocab, 32, 2, 4, 2, 8, 64, max_position=128, name="tiny-llama")
    return ModelConfig("gpt2", vocab, 32, 2, 2, 2, 16, 64, max_position=128, name="tiny-gpt2")


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from arborspec.runtime.tokenizer import TextTokenizer

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["<unk>"] = vocab - 1
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return TextTokenizer(tk, {"bos_token_id": None, "eos_token_ids": [0]})


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = tiny(request.param)
    m = build_model(cfg).eval()
    ref = build_model(cfg).eval()
    ref.load_state_dict(m.state_dict())
    out = tmp_path_factory.mktemp("exp") / request.param
    s = export_folder(
        Loaded(m, cfg, word_tokenizer(cfg.vocab_size), {"kind": "test"}),
        out,
        draft="layers:1",
        max_context=96,
        max_tree_nodes=16,
        progress=False,
    )
    return s, ref


def test_folder_contents_and_manifest(folder):
    s, _ = folder
    names = set(s.files)
    assert {"target.onnx", "draft.onnx", "manifest.json", "tokenizer.json"} <= names
    man = read_manifest(s.out)
    assert man.contract_version == CONTRACT_VERSION
    assert man.limits == {"max_context": 96, "max_tree_nodes": 16}
    assert man.draft["spec"] == "layers:1" and man.draft["config"]["n_layers"] == 1
    assert [i["name"] for i in man.target["inputs"]][:3] == ["input_ids", "position_ids", "attention_mask"]
    assert man.target["outputs"][0] == {
        "name": "logits",
        "dtype": "float",
        "shape": ["batch", "tokens", man.target["config"]["vocab_size"]],
    }
    assert man.tokenizer["sha256"] and man.target["sha256"]
    read_manifest(s.out, check_checksums=True)
    assert not list(s.out.parent.glob(".*partial*"))


@pytest.mark.parametrize("name", ["target.onnx", "draft.onnx"])
def test_graphs_symbolic_checked_loadable(folder, name):
    s, _ = folder
    path = s.out / name
    m = onnx.load(str(path))
    check_symbolic_inputs(m, json.loads({p.key: p.value for p in m.metadata_props}["arborspec.config"])["n_layers"])
    onnx.checker.check_model(str(path), full_check=True)
    assert m.ir_version <= MAX_IR_VERSION
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["arborspec.contract_version"] == str(CONTRACT_VERSION)
    assert meta["arborspec.tokenizer_sha256"] == read_manifest(s.out).tokenizer["sha256"]
    pasts = {
        tuple(d.dim_param for d in i.type.tensor_type.shape.dim[:2])
        for i in m.graph.input
        if i.name.startswith("past_")
    }
    assert len(pasts) == 1  # one P and one B symbol shared by all pasts


def test_load_export_dir_matches_torch(folder):
    s, ref = folder
    target, draft, tok, man = load_export_dir(s.out)
    assert tok is not None and tok.vocab_size == ref.config.vocab_size
    ref_draft = truncated_draft(ref, 1)
    g = torch.Generator().manual_seed(3)
    for eng, mod in ((target, ref), (draft, ref_draft)):
        te = TorchEngine(mod)
        co, ct = KVCache(eng.info.cache, 32), KVCache(te.info.cache, 32)
        ids = torch.randint(0, 64, (1, 5), generator=g)
        pos = torch.tensor([[0, 1, 1, 2, 2]])  # a tree: siblings share positions
        mask = torch.tensor(
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool
        )[None]
        lo, lt = eng.forward(ids, pos, mask, co), te.forward(ids, pos, mask, ct)
        assert (lo - lt).abs().max() < 1e-4
        assert (co.k[:, :5] - ct.k[:, :5]).abs().max() < 1e-4


def _copy(s, tmp_path) -> Path:
    d = tmp_path / "copy"
    shutil.copytree(s.out, d)
    return d


def test_foreign_onnx_file(folder, tmp_path):
    from onnx import TensorProto, helper

    d = _copy(folder[0], tmp_path)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    m = helper.make_model(
        helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "g",
            [x],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
    )
    onnx.save(m, d / "target.onnx")
    with pytest.raises(ExportDirError, match="not an arborspec export"):
        read_manifest(d)
    (d / "target.onnx").write_bytes(b"hello, not a protobuf at all" * 3)
    with pytest.raises(ExportDirError):
        read_manifest(d)


def test_other_contract_version(folder, tmp_path):
    d = _copy(folder[0], tmp_path)
    man = json.loads((d / "manifest.json").read_text())
    man["contract_version"] = CONTRACT_VERSION + 1
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ExportDirError, match="contract version"):
        read_manifest(d)
    # the same check on the ONNX file's own metadata
    from arborspec.runtime.export_dir import check_arborspec_onnx

    with pytest.raises(ExportDirError, match="contract version"):
        check_arborspec_onnx(d / "target.onnx", expected_version=CONTRACT_VERSION + 1)


def test_missing_files(folder, tmp_path):
    d = _copy(folder[0], tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_manifest(tmp_path / "nope")
    (d / "draft.onnx").unlink()
    with pytest.raises(FileNotFoundError, match="draft"):
        read_manifest(d)
    (d / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        read_manifest(d)


def test_missing_external_data(folder, tmp_path):
    from conftest import externalize_target

    from arborspec.runtime.backends.onnxruntime import OrtEngine

    d = _copy(folder[0], tmp_path)
    externalize_target(d)
    read_manifest(d)
    OrtEngine(d / "target.onnx")  # loads with its data file
    (d / "target.onnx.data").unlink()
    with pytest.raises(FileNotFoundError, match="external-data"):
        read_manifest(d)
    with pytest.raises(FileNotFoundError, match="external-data"):
        OrtEngine(d / "target.onnx")


def test_draft_vocab_mismatch_leaves_nothing(tmp_path):
    cfg, dcfg = tiny("llama"), tiny("llama", vocab=80)
    out = tmp_path / "x"
    with pytest.raises(ValueError, match="draft vocabulary 80 != target vocabulary 64"):
        export_folder(
            Loaded(build_model(cfg), cfg),
            out,
            draft="other-model",
            draft_model=Loaded(build_model(dcfg), dcfg),
            progress=False,
        )
    assert list(tmp_path.iterdir()) == []


def test_cli_help_and_one_line_errors(tmp_path, capsys):
    from arborspec.tools.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    assert "arborspec export --model smollm2-135m" in capsys.readouterr().out
    rc = main(["export", "--model", "x", "--draft", "layers:two", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "layers:K" in err
    assert not (tmp_path / "o").exists() and list(tmp_path.iterdir()) == []


def test_fp16_export_runs_on_ort(tmp_path):
    from arborspec.export.onnx_export import export_contract_onnx
    from arborspec.runtime.backends.onnxruntime import OrtEngine

    cfg = tiny("llama")
    torch.manual_seed(0)
    m = build_model(cfg)
    r = export_contract_onnx(m, tmp_path / "h.onnx", dtype="fp16")  # includes the self-check
    assert r.max_abs_diff is not None and r.max_abs_diff < 0.1
    eng = OrtEngine(tmp_path / "h.onnx")
    assert eng.kv_dtype == torch.float16
    c = KVCache(eng.info.cache, 8)
    lo = eng.forward(
        torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tril(torch.ones(1, 2, 2, dtype=torch.bool)), c
    )
    assert lo.dtype == torch.float32 and torch.isfinite(lo).all()


def test_bigram_draft_table(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    cfg = tiny("gpt2", vocab=40)
    torch.manual_seed(0)
    s = export_folder(Loaded(build_model(cfg), cfg), tmp_path / "b", draft="bigram", progress=False, verify=False)
    assert "draft.onnx" not in s.files and "draft_bigram.safetensors" in s.files
    target, draft, tok, man = load_export_dir(s.out)
    assert isinstance(draft, Path) and draft.name == "draft_bigram.safetensors" and tok is None
    with safe_open(str(draft), "pt") as f:
        assert int(f.metadata()["vocab_size"]) == 40 and "logits" in f.keys()
