"""`arborspec bench` end to end on tiny random models (torch backend, HF baselines, ORT export)."""

from __future__ import annotations

import json

import pytest
import torch

from arborspec.tools import prompts as prompt_sets
from arborspec.tools.bench import decoding as bench
from arborspec.tools.bench import report as bench_report
from arborspec.tools.commands.cli import main

PROMPTS = {
    "prompts": [
        {"id": "a", "category": "chat", "ids": [1, 5, 9, 13, 2, 7]},
        {"id": "b", "category": "code", "ids": [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]},
        {"id": "c", "category": "repetitive", "ids": [10, 11, 12, 10, 11, 12, 10, 11]},
        {"id": "d", "category": "chat", "ids": [20, 21]},
    ]
}


def _hf_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked distributions, like a trained model's, so drafts get accepted
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    folder = tmp_path / "tiny-llama"
    m.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    folder = _hf_folder(tmp)
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    return tmp, folder, prompts


def _check_schema(res, names):
    assert res["schema_version"] == bench_report.SCHEMA_VERSION
    for k in ("machine", "backend", "model", "draft", "versions", "command", "date"):
        assert k in res["meta"], k
    assert [c["name"] for c in res["configs"]] == names
    assert len(res["per_prompt"]) == 3  # --limit-prompts 3: round-robin over the categories
    assert {p["category"] for p in res["per_prompt"]} == {"chat", "code", "repetitive"}
    for p in res["per_prompt"]:
        assert set(p["runs"]) == set(names)
        for r in p["runs"].values():
            for k in (
                "tokens_per_s",
                "speedup_vs_vanilla",
                "mean_accepted",
                "target_calls",
                "time_split",
                "overhead_per_step_ms",
                "accepted_hist",
                "greedy_match",
                "tokens",
                "new_tokens",
            ):
                assert k in r, k
            assert r["new_tokens"] == 12
    agg = res["aggregate"]
    assert set(agg["configs"]) == set(names)
    for a in agg["configs"].values():
        for k in (
            "tokens_per_s_median",
            "tokens_per_s_total",
            "speedup_vs_vanilla_median",
            "speedup_vs_vanilla_total",
            "mean_accepted",
            "time_split",
            "ms_per_token",
            "greedy_match",
        ):
            assert k in a, k
    assert agg["greedy_match"] is True
    assert agg["configs"]["vanilla"]["mean_accepted"] == pytest.approx(1.0)
    assert agg["configs"]["vanilla"]["speedup_vs_vanilla_total"] == pytest.approx(1.0)
    ttft = agg["configs"]["vanilla"]["ttft_s_median"]  # time to first token, reported by bench
    assert ttft is not None and 0 < ttft <= max(
        r["runs"]["vanilla"]["decode_s"] + r["runs"]["vanilla"]["prefill_s"] for r in res["per_prompt"]
    )


def test_bench_torch_with_hf_baselines(tiny, capsys):
    tmp, folder, prompts = tiny
    out, png = tmp / "r.json", tmp / "r.png"
    rc = main(
        [
            "bench",
            "--model",
            str(folder),
            "--draft",
            "layers:1",
            "--modes",
            "vanilla,chain,tree",
            "--chain",
            "chain:3",
            "--tree",
            "full:2,2;beam:2,3",
            "--tree",
            "dynamic:2,3,5",
            "--prompts",
            str(prompts),
            "--limit-prompts",
            "3",
            "--max-new-tokens",
            "12",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--baselines",
            "hf-greedy,hf-assisted,hf-lookup",
            "--hf-assistant-layers",
            "1",
            "--no-progress",
            "--json-out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    names = ["vanilla", "chain:3", "full:2,2", "beam:2,3", "dynamic:2,3,5", "hf-greedy", "hf-assisted", "hf-lookup"]
    _check_schema(res, names)
    # transformers on the same weights: greedy decoding gives our vanilla's tokens
    for p in res["per_prompt"]:
        assert p["runs"]["hf-greedy"]["tokens"] == p["runs"]["vanilla"]["tokens"]
        assert p["runs"]["hf-greedy"]["mean_accepted"] == pytest.approx(1.0)
    assert res["aggregate"]["configs"]["hf-greedy"]["speedup_vs_hf_greedy_total"] == pytest.approx(1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "| hf-assisted |" in table and "| full:2,2 |" in table


def test_bench_onnxruntime_export(tiny, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    _, folder, prompts = tiny
    from arborspec.export.export_folder import export_folder

    exp = tmp_path / "exp"
    export_folder(str(folder), exp, draft="layers:1", progress=False)
    out = tmp_path / "ort.json"
    rc = main(
        [
            "bench",
            "--export-dir",
            str(exp),
            "--backend",
            "onnxruntime",
            "--tree",
            "full:2,2",
            "--prompts",
            str(prompts),
            "--limit-prompts",
            "3",
            "--max-new-tokens",
            "12",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--baselines",
            "hf-greedy",
            "--lookup-tree",
            "full:3,2",
            "--suffix-tree",
            "chain:1",
            "--suffix-mix-tree",
            "chain:2",
            "--no-progress",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    _check_schema(
        res, ["vanilla", "chain:4", "full:2,2", "lookup+full:3,2", "suffix+chain:1", "suffix-mix+chain:2", "hf-greedy"]
    )
    assert res["meta"]["backend"] == "onnxruntime"
    # the lookup draft ran next to the export's draft: its own draft, vanilla's tokens
    lk = [c for c in res["configs"] if c["name"] == "lookup+full:3,2"][0]
    assert lk["draft"] == "lookup" and lk["mode"] == "tree"
    for p in res["per_prompt"]:
        assert p["runs"]["lookup+full:3,2"]["greedy_match"] is True
    # the suffix draft alone and mixed with the export's draft: their own drafts, vanilla's tokens
    drafts = {c["name"]: c["draft"] for c in res["configs"]}
    assert drafts["suffix+chain:1"] == "suffix" and drafts["suffix-mix+chain:2"] == "suffix-mix"
    for p in res["per_prompt"]:
        assert p["runs"]["suffix+chain:1"]["greedy_match"] is True
        assert p["runs"]["suffix-mix+chain:2"]["greedy_match"] is True


def test_bench_candidate_modes_side_by_side(tiny, capsys):
    """--candidates topk,sample-unique at T > 0: every speculative config once per mode, the
    second named SPEC@MODE; a dynamic tree (ranked by score) runs with top-k only."""
    tmp, folder, prompts = tiny
    out = tmp / "cand.json"
    args = ["bench", "--model", str(folder), "--draft", "layers:1", "--prompts", str(prompts)]
    args += ["--limit-prompts", "3", "--max-new-tokens", "12", "--warmup", "0", "--threads", "1", "--no-progress"]
    tree = ["--chain", "chain:3", "--tree", "full:2,2;dynamic:2,3,5"]
    rc = main(args + tree + ["--temperature", "0.8", "--candidates", "topk,sample-unique", "--json-out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    cands = {c["name"]: c.get("candidates") for c in res["configs"]}
    assert cands == {
        "vanilla": "topk",
        "chain:3": "topk",
        "full:2,2": "topk",
        "dynamic:2,3,5": "topk",
        "chain:3@sample-unique": "sample-unique",
        "full:2,2@sample-unique": "sample-unique",
    }
    runs = [p["runs"] for p in res["per_prompt"]]
    # the same seed, other draws: sampled candidates change the sampled tokens somewhere
    assert any(r["full:2,2"]["tokens"] != r["full:2,2@sample-unique"]["tokens"] for r in runs)
    assert all(r["chain:3@sample-unique"]["new_tokens"] >= 1 for r in runs)
    capsys.readouterr()
    assert main(args + tree + ["--candidates", "sample"]) == 2  # greedy: candidates are the top ones
    assert "--candidates needs --temperature > 0" in capsys.readouterr().err
    assert main(args + tree + ["--temperature", "0.8", "--candidates", "topk,best"]) == 2
    assert "unknown candidate mode 'best'" in capsys.readouterr().err


def test_bench_top_k_and_top_p_reach_ours_and_the_transformers_baseline(tiny, capsys):
    """--top-k / --top-p cut the sampling of every configuration, ours and the baselines': at
    T = 1 with top-k 1 each samples the greedy tokens, where plain T = 1 sampling (the negative
    control) leaves them; a cut without a temperature, or a bad one, is one error line."""
    pytest.importorskip("transformers", reason="the hf-greedy baseline needs transformers")
    tmp, folder, prompts = tiny
    args = ["bench", "--model", str(folder), "--draft", "layers:1", "--prompts", str(prompts), "--no-progress"]
    args += ["--limit-prompts", "3", "--max-new-tokens", "12", "--warmup", "0", "--threads", "1"]
    args += ["--chain", "chain:2", "--tree", "full:2,2", "--baselines", "hf-greedy"]
    res = {}
    for name, extra in (
        ("greedy", []),
        ("top-k 1", ["--temperature", "1", "--top-k", "1"]),
        ("top-p tiny", ["--temperature", "1", "--top-p", "1e-6"]),
        ("plain", ["--temperature", "1"]),
    ):
        out = tmp / f"{name}.json"
        assert main(args + extra + ["--json-out", str(out)]) == 0, name
        res[name] = json.loads(out.read_text())
    greedy = [p["runs"]["vanilla"]["tokens"] for p in res["greedy"]["per_prompt"]]
    names = ["vanilla", "chain:2", "full:2,2", "hf-greedy"]
    for name in ("top-k 1", "top-p tiny"):
        for n in names:
            assert [p["runs"][n]["tokens"] for p in res[name]["per_prompt"]] == greedy, (name, n)
    meta = res["top-k 1"]["meta"]
    assert (meta["temperature"], meta["top_k"], meta["top_p"]) == (1.0, 1, 1.0)
    for n in names:
        assert [p["runs"][n]["tokens"] for p in res["plain"]["per_prompt"]] != greedy, n
    capsys.readouterr()
    assert main(args + ["--top-p", "0.9"]) == 2
    assert "--top-k and --top-p need --temperature > 0" in capsys.readouterr().err
    assert main(args + ["--temperature", "1", "--top-p", "2"]) == 2
    assert "top-p must be in (0, 1], got 2.0" in capsys.readouterr().err


def test_bench_user_errors(tiny, capsys):
    _, folder, prompts = tiny
    assert main(["bench", "--model", str(folder), "--prompts", str(prompts), "--tree", "full:2"]) == 2
    assert "tree spec" in capsys.readouterr().err
    assert main(["bench", "--model", str(folder), "--prompts", str(prompts), "--baselines", "vllm"]) == 2
    assert "unknown baseline" in capsys.readouterr().err
    assert main(["bench", "--model", str(folder), "--prompts", str(folder / "nope.json")]) == 2
    text = folder.parent / "text.json"
    text.write_text(json.dumps([{"id": "t", "category": "chat", "text": "hello"}]))
    assert main(["bench", "--model", str(folder), "--prompts", str(text), "--modes", "vanilla", "--no-progress"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_select_prompts_round_robin():
    entries = [{"id": str(i), "category": c, "ids": [1]} for i, c in enumerate("aaabbc")]
    assert [e["id"] for e in prompt_sets.select_prompts(entries, 3)] == ["0", "3", "5"]
    assert [e["id"] for e in prompt_sets.select_prompts(entries, 4)] == ["0", "1", "3", "5"]
    assert bench.split_tree_specs(["full:3,2;beam:4,8", "chain:2"]) == ["full:3,2", "beam:4,8", "chain:2"]


def test_packaged_prompts():
    entries, _ = prompt_sets.read_prompts_file(None)
    cats = {e["category"] for e in entries}
    assert {"chat", "code", "summarisation", "repetitive"} <= cats
    assert len(entries) >= 25
    assert sum(1 for e in entries if e["category"] == "summarisation" and len(e["text"]) > 4000) >= 3


def test_heldout_prompts_bench_as_chat_prompts(tmp_path):
    """tools/data/heldout_prompts.json (the set no tuning or training reads) runs in bench: its
    "kind" is the category and its file-level "chat": true applies the chat template."""
    from arborspec.tools.train.eagle3_heldout import PROMPTS_PATH

    entries, _ = prompt_sets.read_prompts_file(PROMPTS_PATH)
    assert {e["category"] for e in entries} == {"instruction", "code", "summary", "extraction"}
    assert all(e["chat"] is True for e in entries)

    class Tok:  # records what reaches the tokenizer
        def apply_chat(self, msgs):
            return "<chat>" + msgs[-1]["content"]

        def encode(self, text, add_bos=True):
            return [len(text), 1 if text.startswith("<chat>") else 0]

    enc = prompt_sets.encode_prompts(entries[:2], Tok())
    assert [e["ids"][1] for e in enc] == [1, 1]
    f = tmp_path / "p.json"  # without the file-level flag: plain text, and an explicit "chat" wins
    f.write_text(
        json.dumps({"prompts": [{"id": "a", "kind": "k", "text": "x"}, {"id": "b", "text": "y", "chat": True}]})
    )
    plain, _ = prompt_sets.read_prompts_file(f)
    assert plain[0]["category"] == "k" and "chat" not in plain[0] and plain[1]["chat"] is True


# ---------------------------------------------------------------------------------- peers
def _tiny_word_tokenizer(folder, vocab: int):
    """A word-level tokenizer (w0 .. w{vocab-1}) saved with transformers: what the GenAI model
    builder needs next to the weights of a Hugging Face folder."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="w0", bos_token="w1", eos_token="w2"
    ).save_pretrained(folder)


def _peer_bench(model, prompts, out, baselines, extra=()):
    return main(
        [
            "bench",
            "--model",
            str(model),
            "--modes",
            "vanilla",
            "--prompts",
            str(prompts),
            "--limit-prompts",
            "3",
            "--max-new-tokens",
            "12",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--baselines",
            baselines,
            "--no-progress",
            "--json-out",
            str(out),
            *extra,
        ]
    )


def test_bench_ort_genai_on_tiny_hf_folder(tiny, tmp_path, monkeypatch, capsys):
    """ort-genai: GenAI's model builder on a tiny random HF Llama folder (+ tokenizer); fp32 greedy
    gives our vanilla's tokens; the built model is cached (a second bench does not rebuild)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install 'arborspec[peers]')")
    import shutil

    _, folder, prompts = tiny
    hf = tmp_path / "tiny-llama-tok"
    shutil.copytree(folder, hf)
    _tiny_word_tokenizer(hf, 96)
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "genai.json"
    assert _peer_bench(hf, prompts, out, "ort-genai,ort-genai-ngram,ort-genai-int4") == 0
    table, err = capsys.readouterr()
    assert "building the ONNX Runtime GenAI fp32 model" in err and "Traceback" not in err
    res = json.loads(out.read_text())
    assert [c["name"] for c in res["configs"]] == ["vanilla", "ort-genai", "ort-genai-ngram", "ort-genai-int4"]
    assert [c["kind"] for c in res["configs"]] == ["ours", "peer", "peer", "peer"]
    assert res["meta"]["skipped"] == {}
    assert res["meta"]["versions"]["onnxruntime-genai"]
    peer = res["meta"]["peers"]["ort-genai"]
    assert peer["version"] == res["meta"]["versions"]["onnxruntime-genai"]
    assert peer["build"]["precision"] == "fp32" and peer["eos"] == [2]
    assert res["meta"]["peers"]["ort-genai-ngram"]["speculative_options"]["ngram_size"] == 2
    for p in res["per_prompt"]:
        van = p["runs"]["vanilla"]
        for name in ("ort-genai", "ort-genai-ngram"):  # fp32, the same weights: the same tokens
            r = p["runs"][name]
            assert r["tokens"] == van["tokens"], (name, p["id"])
            assert r["greedy_match"] is True and r["agree_prefix"] == len(van["tokens"])
            assert r["stop_reason"] == van["stop_reason"] and r["tokens_per_s"] > 0
        assert 1 <= p["runs"]["ort-genai-int4"]["new_tokens"] <= 12
        assert "peer_stats" in p["runs"]["ort-genai-ngram"]
    agg = res["aggregate"]["configs"]
    assert agg["ort-genai"]["identical_prompts"] == 3 and agg["ort-genai"]["agree_prefix_frac"] == pytest.approx(1.0)
    assert res["aggregate"]["greedy_match"] is True  # our configurations
    assert "| ort-genai | — |" in table and "3/3 (100%)" in table
    cached = sorted(p.name for p in (tmp_path / "cache" / "peers").iterdir())
    assert len(cached) == 2 and all(not n.startswith(".") for n in cached)  # fp32 + int4, no leftovers
    assert _peer_bench(hf, prompts, out, "ort-genai") == 0
    assert "building" not in capsys.readouterr().err  # the cached model is reused


def _tiny_gguf(path):
    """A tiny random Llama GGUF (F32) with a byte-level BPE vocabulary llama.cpp and transformers load."""
    transformers = pytest.importorskip("transformers")
    from test_loaders import write_tiny_gguf
    from test_tokenizer import synthetic_meta

    meta = synthetic_meta()
    cfg = transformers.LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return write_tiny_gguf(m, path, tied=False, tokenizer=meta)


def test_bench_peers_on_tiny_gguf(tmp_path, monkeypatch, capsys):
    """A tiny GGUF with a vocabulary: GenAI through the transformers-written HF folder, and
    llama.cpp (plain and prompt lookup) on the file itself, all giving our vanilla's tokens."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai not installed (pip install 'arborspec[peers]')")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'arborspec[peers]')")
    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "peers.json"
    assert _peer_bench(gguf_path, prompts, out, "ort-genai,llama-cpp,llama-cpp-lookup") == 0
    assert "Traceback" not in capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["meta"]["skipped"] == {}
    assert res["meta"]["peers"]["llama-cpp"]["version"] == res["meta"]["versions"]["llama-cpp-python"]
    assert res["meta"]["peers"]["llama-cpp-lookup"]["draft"]["LlamaPromptLookupDecoding"]["num_pred_tokens"] == 10
    for p in res["per_prompt"]:
        for name in ("ort-genai", "llama-cpp", "llama-cpp-lookup"):
            assert p["runs"][name]["tokens"] == p["runs"]["vanilla"]["tokens"], (name, p["id"])
    # prompt lookup verifies several tokens per call on the repetitive prompt
    assert res["per_prompt"][2]["runs"]["llama-cpp-lookup"]["mean_accepted"] > 1.0


def test_llama_cpp_lookup_prompt_longer_than_a_batch(tmp_path):
    """llama-cpp-python 0.3.36 with a draft and logits_all=False sizes its logits buffer to n_batch
    rows: a prompt longer than 512 tokens failed (found on SmolLM2's summaries)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'arborspec[peers]')")
    from arborspec.tools.bench.peers import LlamaCppRunner

    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    prompt = [int(x) for x in torch.randint(3, 200, (600,), generator=torch.Generator().manual_seed(1))]
    plain = LlamaCppRunner(gguf_path, 1, 640, lookup=False).run("llama-cpp", prompt, 8, [], 0.0, 0)
    look = LlamaCppRunner(gguf_path, 1, 640, lookup=True).run("llama-cpp-lookup", prompt, 8, [], 0.0, 0)
    assert look["tokens"] == plain["tokens"] and len(plain["tokens"]) == 8


def test_bench_missing_or_failing_peer_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    """A peer that is not installed is skipped with one line (and its reason in the JSON); one
    that fails while running is dropped with one line; the bench goes on and exits 0."""
    import sys

    from arborspec.tools.bench import peers as bench_peers

    _, folder, prompts = tiny
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(bench_peers, "pkg_version", lambda pkg: None)
    out = tmp_path / "missing.json"
    assert _peer_bench(folder, prompts, out, "ort-genai,ort-genai-int4,llama-cpp,llama-cpp-lookup") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for name, pkg in (
        ("ort-genai", "onnxruntime-genai"),
        ("ort-genai-int4", "onnxruntime-genai"),
        ("llama-cpp", "llama-cpp-python"),
        ("llama-cpp-lookup", "llama-cpp-python"),
    ):
        lines = [ln for ln in err.splitlines() if f" {name} skipped:" in ln]
        assert len(lines) == 1, (name, err)
        assert f"{pkg} is not installed" in lines[0]
    res = json.loads(out.read_text())
    assert [c["name"] for c in res["configs"]] == ["vanilla"]
    assert set(res["meta"]["skipped"]) == {"ort-genai", "ort-genai-int4", "llama-cpp", "llama-cpp-lookup"}
    assert "pip install 'arborspec[peers]'" in res["meta"]["skipped"]["llama-cpp"]

    class Boom:
        def run(self, *a, **kw):
            raise RuntimeError("model exploded\nsecond line")

    monkeypatch.setattr(bench_peers, "open_peers", lambda names, *a, **k: ({"llama-cpp": Boom()}, {}, {}))
    assert _peer_bench(folder, prompts, out, "llama-cpp") == 0
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if "llama-cpp skipped" in ln] == [
        "arborspec bench: note: llama-cpp skipped: failed while running (RuntimeError: second line)"
    ]
    res = json.loads(out.read_text())
    assert [c["name"] for c in res["configs"]] == ["vanilla"]
    assert all(set(p["runs"]) == {"vanilla"} for p in res["per_prompt"])
    assert res["meta"]["skipped"]["llama-cpp"].startswith("failed while running")


def test_a_greedy_mismatch_is_a_warning_only_where_it_should_not_happen():
    from arborspec.tools.bench.decoding import BenchConfig, mismatch_message

    ours = BenchConfig("full:2,2", "ours", "tree", "full:2,2")
    assert mismatch_message(ours, "p", 5).startswith("WARNING greedy mismatch: full:2,2")
    inexact = mismatch_message(ours, "p", 5, exact=False)
    assert inexact.startswith("note: ") and "int8 activations" in inexact
    assert "transformers" in mismatch_message(BenchConfig("hf-greedy", "hf", "vanilla"), "p", 5, exact=False)


def test_llama_cpp_samples_at_the_temperature_with_its_seed(tmp_path, monkeypatch, capsys):
    """At --temperature T llama.cpp samples (plain temperature, the bench's seed): the same seed
    gives the same tokens, other seeds other tokens; GenAI (greedy only) is skipped in one line."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'arborspec[peers]')")
    from arborspec.tools.bench.peers import LlamaCppRunner

    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    prompt = [5, 9, 17, 33, 65]
    r = LlamaCppRunner(gguf_path, 1, 128, lookup=False, temperature=1.5)
    runs = {seed: r.run("llama-cpp", prompt, 16, [], 1.5, seed)["tokens"] for seed in (0, 1, 2, 3)}
    assert r.run("llama-cpp", prompt, 16, [], 1.5, 2)["tokens"] == runs[2]
    assert len({tuple(t) for t in runs.values()}) > 1
    greedy = r.run("llama-cpp", prompt, 16, [], 0.0, 0)["tokens"]
    assert any(t != greedy for t in runs.values())
    # bench's --top-k / --top-p reach it: top-k 1 (or a tiny nucleus) at T = 1.5 is greedy again
    seed = next(sd for sd, t in runs.items() if t != greedy)  # a seed whose plain sampling leaves greedy
    assert r.run("llama-cpp", prompt, 16, [], 1.5, seed, top_k=1)["tokens"] == greedy
    assert r.run("llama-cpp", prompt, 16, [], 1.5, seed, top_p=1e-6)["tokens"] == greedy
    assert "temp 1.5" in r.describe("llama-cpp")["sampling"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "t08.json"
    assert _peer_bench(gguf_path, prompts, out, "ort-genai,llama-cpp", ["--temperature", "0.8"]) == 0
    err = capsys.readouterr().err
    assert "ort-genai skipped: ONNX Runtime GenAI runs greedy only" in err and "Traceback" not in err
    res = json.loads(out.read_text())
    assert [c["name"] for c in res["configs"]] == ["vanilla", "llama-cpp"]
    assert all(p["runs"]["llama-cpp"]["new_tokens"] >= 1 for p in res["per_prompt"])


def test_quality_llama_cpp_on_the_same_gguf(tmp_path, capsys):
    """`bench --quality --baselines llama-cpp`: llama.cpp's perplexity of the same token ids over the
    same windows, and its greedy agreement; on an F32 GGUF it equals our fp32 export's."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'arborspec[peers]')")
    pytest.importorskip("onnxscript")
    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    exp = tmp_path / "fp32"
    assert main(["export", "--model", str(gguf_path), "--out", str(exp), "--quiet"]) == 0
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "q.json"
    argv = ["bench", "--quality", "--export-dir", str(exp), "--reference-export-dir", str(exp)]
    argv += ["--baselines", "llama-cpp", "--prompts", str(prompts), "--max-new-tokens", "10"]
    argv += ["--quality-window", "96", "--no-progress", "--json-out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "vs llama.cpp on tiny.gguf:" in text
    rows = json.loads(out.read_text())["quality"]
    assert [r["export"].startswith("llama.cpp") for r in rows] == [False, False, True]
    ours, lc = rows[1], rows[2]
    assert lc["tokens"] == ours["tokens"] and lc["windows"] == ours["windows"] > 1
    # an F32 GGUF: the same weights, so the same perplexity up to float rounding (a row off by
    # one, or the wrong window, would be far off: the random model is near-uniform otherwise)
    assert lc["perplexity"] == pytest.approx(ours["perplexity"], rel=2e-3)
    assert lc["agreement"]["rate"] == 1.0 and lc["agreement"]["prompts"] == len(PROMPTS["prompts"])


def test_nbits_kernels_tool_runs_every_kind(capsys):
    """tools/bench/nbits_kernels.py (docs/int4.md's kernel costs): a MatMulNBits session per
    zero-point kind and accuracy level; bad sizes are one error line."""
    pytest.importorskip("onnxruntime")
    from arborspec.tools.bench import nbits_kernels

    rows = nbits_kernels.measure(64, 48, reps=2, threads=1, rows=(1, 2))
    assert {(r["accuracy_level"], r["zero_points"], r["rows"]) for r in rows} == {
        (a, z, t) for a in (0, 4) for z in ("none", "uint8", "float") for t in (1, 2)
    }
    assert all(r["us"] > 0 for r in rows)
    s = nbits_kernels.session(64, 48, "float", 4, 1)  # the float-zero-point graph computes
    import numpy as np

    assert s.run(None, {"x": np.ones((1, 3, 64), np.float32)})[0].shape == (1, 3, 48)
    assert nbits_kernels.main(["--k", "40"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_overhead_tool_measures_each_tree_and_a_bad_spec_is_one_line(capsys):
    """tools/bench/overhead.py (the runtime's own time per step, null engines): a row per tree
    with its nodes and time; a malformed tree spec or temperature is one error line, exit 2,
    before anything is measured."""
    from arborspec.tools.bench import overhead

    assert overhead.main(["--trees", "chain:2", "full:2,2", "--steps", "5", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "chain:2" in out and "full:2,2" in out
    for bad in (
        ["--trees", "chain:2", "vanilla"],
        ["--trees", "chain:2", "--temperature", "-1"],
        ["--batch", "2", "--temperature", "1", "--top-p", "2"],  # the batch mode checks its sampling too
    ):
        assert overhead.main([*bad, "--steps", "5", "--vocab", "64"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("overhead: error: ") and len(err.strip().splitlines()) == 1
