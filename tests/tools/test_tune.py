"""Tree tuning: the Sequoia DP against brute force, the tuned file, --tree auto, tune end to end."""

from __future__ import annotations

import json
import random

import pytest

from arborspec.runtime.trees import StaticTree, parse_tree_spec
from arborspec.tools.tune import tuner as T


def _all_trees(k: int, depth: int, budget: int):
    """Every prefix-closed set of rank paths (ranks < k, depth <= depth) with <= budget nodes."""

    def forests(d, r, b):
        # forests of children at depth d using ranks r..k-1 and at most b nodes
        if r == k or b == 0 or d > depth:
            yield []
            return
        yield from forests(d, r + 1, b)  # rank r absent
        for sub in forests(d + 1, 0, b - 1):
            for rest in forests(d, r + 1, b - 1 - len(sub)):
                yield [(r,)] + [(r,) + p for p in sub] + rest

    yield from forests(1, 0, budget)


def _random_q(rng, depth, k):
    q = []
    for _ in range(depth):
        w = [rng.random() ** 2 for _ in range(k)]
        s = sum(w) / rng.uniform(0.3, 0.95)
        q.append([x / s for x in w])  # not sorted by rank on purpose
    return q


@pytest.mark.parametrize("seed,k,depth,n_max", [(0, 2, 3, 6), (1, 3, 3, 6), (2, 3, 4, 5), (3, 2, 5, 6), (4, 4, 2, 5)])
def test_dp_matches_brute_force(seed, k, depth, n_max):
    rng = random.Random(seed)
    q = _random_q(rng, depth, k)
    trees = [[list(p) for p in t] for t in _all_trees(k, depth, n_max)]
    res = T.sequoia_dp(q, n_max, depth)
    for n in range(0, n_max + 1):
        brute = max(T.tree_value(t, q) for t in trees if len(t) <= n)
        assert res.value[n] == pytest.approx(brute, abs=1e-12), (n, res.value[n], brute)
        paths = res.tree(n)
        assert len(paths) <= n
        assert max((len(p) for p in paths), default=0) <= depth
        assert T.tree_value(paths, q) == pytest.approx(res.value[n], abs=1e-12)
        if paths:
            StaticTree(paths)  # prefix-closed, valid ranks


def test_dp_depth_dependent_and_chain():
    # rank 0 certain at every depth: the best n-node tree with depth <= n is the chain
    q = [[1.0, 0.0]] * 4
    res = T.sequoia_dp(q, 4, 4)
    assert res.tree(4) == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    assert res.value[4] == pytest.approx(4.0)
    # rank 1 better at depth 1 only
    q = [[0.2, 0.7], [0.9, 0.05]]
    res = T.sequoia_dp(q, 2, 2)
    assert res.tree(2) == [[1], [1, 0]]
    assert res.value[2] == pytest.approx(0.7 + 0.7 * 0.9)


def test_level_frontiers_and_cost():
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    assert T.level_frontiers(paths) == [2, 1]
    verify = {1: 10.0, 8: 17.0}
    dcost = {1: 1.0, 4: 4.0}
    assert T.step_cost_ms(paths, verify, dcost) == pytest.approx(16.0 + 1.0 + 2.0 + 1.0)
    assert T.interp({1: 10.0, 8: 17.0}, 4) == pytest.approx(13.0)
    assert T.interp({1: 10.0, 8: 17.0}, 15) == pytest.approx(24.0)


def test_choose_tree_prices_trees_with_the_replay_when_given():
    """With `simulate` (the decoding loop replayed over measured ranks) the replayed tokens per
    step price each DP tree; the DP's own estimate is kept beside it."""
    q = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.5, 0.2, 0.1]]
    verify, dcost = {1: 10.0, 64: 10.5}, {1: 0.01, 64: 0.02}
    dp = T.choose_tree(q, verify, dcost, 8, 3)["best"]
    assert dp["nodes"] > 1 and dp["expected_tokens_per_step"] == dp["dp_tokens_per_step"]
    # a replay in which only the one-node tree ever gets a token accepted
    best = T.choose_tree(q, verify, dcost, 8, 3, simulate=lambda paths: 2.0 if paths == [[0]] else 1.0)["best"]
    assert best["paths"] == [[0]] and best["expected_tokens_per_step"] == 2.0 and best["dp_tokens_per_step"] > 1.0


def test_calibration_prompts_follow_each_prompts_chat_flag(tmp_path):
    """tune calibrates on text as bench decodes it: by default each prompt's own `chat` flag
    decides the chat template; chat=True/False forces it for every text prompt."""
    from arborspec.tools.prompts import calibration_prompts

    class Tok:
        meta = {"chat_template": "x"}

        def apply_chat(self, messages):
            return "<user>" + messages[0]["content"]

        def encode(self, text, add_bos=True):
            return [len(text)] + ([7] if text.startswith("<user>") else [])

    f = tmp_path / "p.json"
    # split_prompts holds out the even-indexed entries: "aa" and "bbb" are the training split
    entries = [{"text": "held"}, {"text": "aa", "chat": True}, {"text": "held"}, {"text": "bbb"}]
    f.write_text(json.dumps({"prompts": entries}))
    assert calibration_prompts(Tok(), f, n=2) == [[8, 7], [3]]  # "<user>aa" templated, "bbb" not
    assert calibration_prompts(Tok(), f, n=2, chat=True) == [[8, 7], [9, 7]]
    assert calibration_prompts(Tok(), f, n=2, chat=False) == [[2], [3]]


def test_choose_tree_prefers_small_trees_when_verify_is_steep():
    q = [[0.6, 0.2, 0.1]] * 4
    flat = T.choose_tree(q, {1: 10.0, 64: 10.5}, {1: 0.01, 64: 0.02}, 16, 4)["best"]
    steep = T.choose_tree(q, {1: 10.0, 64: 200.0}, {1: 0.01, 64: 0.02}, 16, 4)["best"]
    assert flat["nodes"] > steep["nodes"]
    assert flat["expected_tokens_per_step"] > steep["expected_tokens_per_step"]


def test_tuned_file_loads_via_parse_tree_spec(tmp_path):
    q = [[0.5, 0.2, 0.1]] * 3
    res = T.sequoia_dp(q, 7, 3)
    doc = {"format": 1, "paths": res.tree(7), "expected_tokens_per_step": res.value[7] + 1}
    f = tmp_path / "t.json"
    f.write_text(json.dumps(doc))
    pol = parse_tree_spec(f"static:{f}")
    assert pol.max_nodes == 7 and sorted(map(list, pol.paths)) == sorted(doc["paths"])


def test_tree_auto_missing_is_one_clean_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    args = T.ModelsKey(model="nope-model", draft="layers:1", export_dir=None, backend=None, device="cpu")
    from arborspec.runtime.decoder_config import DecoderConfig, Opened, resolve_config

    def tree(spec, key):
        return resolve_config(DecoderConfig(tree=spec), Opened(has_draft=True), key).tree

    with pytest.raises(FileNotFoundError, match="arborspec tune --model nope-model --draft layers:1"):
        tree("auto", args)
    assert tree("full:3,2", args) == "full:3,2"
    eargs = T.ModelsKey(model=None, draft=None, export_dir=tmp_path / "exp", backend=None, device="cpu")
    with pytest.raises(FileNotFoundError, match="tree_auto.json"):
        tree("auto", eargs)
    # through the CLI: one line on stderr, exit 2 (before any model is loaded would be nicer,
    # but the export dir does not exist anyway)
    from arborspec.tools.commands.cli import main

    (tmp_path / "exp").mkdir()
    rc = main(["generate", "--export-dir", str(tmp_path / "exp"), "--tree", "auto", "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "error" in err


def _tiny_models(tmp_path):
    from conftest import random_model, tiny_config

    from arborspec.tools.train.distill_draft import save_hf_folder

    m = random_model(tiny_config("llama", vocab=96, layers=3, hidden=64))
    return save_hf_folder(m, tmp_path / "tiny")


def test_tune_end_to_end_and_tree_auto(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARBORSPEC_CACHE", str(tmp_path / "cache"))
    folder = _tiny_models(tmp_path)
    from arborspec.tools.commands.cli import main

    out = tmp_path / "tree.json"
    png = tmp_path / "tune.png"
    rc = main(
        [
            "tune",
            "--model",
            str(folder),
            "--draft",
            "layers:1",
            "--max-nodes",
            "12",
            "--max-depth",
            "4",
            "--max-width",
            "4",
            "--n-prompts",
            "3",
            "--calib-tokens",
            "24",
            "--reps",
            "2",
            "--past",
            "32",
            "--loop-candidates",
            "2",
            "--loop-tokens",
            "8",
            "--out",
            str(out),
            "--plot",
            str(png),
            "--quiet",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    # the two best trees by the cost model were re-timed in the decoding loop; the pick is priced by it
    loop = doc["in_loop"]
    assert len(loop["candidates"]) == 2 and loop["vanilla_step_ms"] > 0
    assert doc["predicted_step_ms"] in [c["loop_step_ms"] for c in loop["candidates"]]
    assert doc["predicted_tokens_per_s"] == pytest.approx(
        1e3 * doc["expected_tokens_per_step"] / doc["predicted_step_ms"]
    )
    assert doc["backend"] == "torch" and 1 <= doc["nodes"] <= 12 and doc["depth"] <= 4
    assert doc["expected_tokens_per_step"] >= 1.0 and doc["predicted_tokens_per_s"] > 0
    assert set(doc["cost_curve_ms"]) >= {"1", "13"} and len(doc["acceptance"]["q"]) == 4
    assert png.is_file() and png.stat().st_size > 1000
    pol = parse_tree_spec(f"static:{out}")
    assert pol.max_nodes == doc["nodes"]
    capsys.readouterr()
    # --tree auto finds the cached copy and decodes with it
    rc = main(
        [
            "generate",
            "--model",
            str(folder),
            "--draft",
            "layers:1",
            "--tree",
            "auto",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--json",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert res["stats"]["tree"].startswith("static:") and len(res["tokens"]) == 8
    # a different draft has no tuned tree
    rc = main(
        [
            "generate",
            "--model",
            str(folder),
            "--draft",
            "layers:2",
            "--tree",
            "auto",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
        ]
    )
    assert rc == 2 and "arborspec tune" in capsys.readouterr().err
    # --model runs: the sampled tune's file sits beside the greedy one in the cache, and --tree
    # auto takes it at temperature > 0 only
    small = ["--max-nodes", "6", "--max-depth", "3", "--max-width", "3", "--n-prompts", "2", "--calib-tokens", "12"]
    small += ["--reps", "2", "--past", "16", "--loop-candidates", "1", "--loop-tokens", "6", "--quiet"]
    model = ["--model", str(folder), "--draft", "layers:1"]
    assert main(["tune"] + model + small + ["--temperature", "0.9"]) == 0
    cached = sorted(p.name for p in (tmp_path / "cache" / "tune").iterdir())
    assert len(cached) == 2 and cached[1] == cached[0][: -len(".json")] + ".sampled.json", cached
    capsys.readouterr()
    for temp, tail in (("0.9", ".sampled.json"), ("0", cached[0][-12:])):
        rc = main(
            ["generate"]
            + model
            + ["--tree", "auto", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
            + ["--temperature", temp, "--json"]
        )
        assert rc == 0 and json.loads(capsys.readouterr().out)["stats"]["tree"].endswith(tail)


def test_acceptance_of_the_target_itself_is_one_at_rank_zero():
    """Drafting with the target: its greedy token is always its own rank-0 candidate."""
    from conftest import random_model, tiny_config

    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.drafts.bigram import BigramDraft

    eng = TorchEngine(random_model(tiny_config("llama", vocab=96, layers=2, hidden=64)))
    acc = T.measure_acceptance(eng, eng, [[1, 2, 3], [4, 5]], max_new_tokens=20, k=4, max_depth=3)
    assert acc["counts"][0] == 40 and acc["counts"][2] > 0
    for row in acc["q"]:
        assert row[0] == pytest.approx(1.0) and sum(row[1:]) == 0
    # a bigram table whose top-1 is always wrong for the target at rank 0 but right at rank 1
    import torch

    v = 96
    from arborspec.runtime.decode import SpeculativeDecoder

    out = SpeculativeDecoder(eng, mode="vanilla").generate([7], 30).tokens
    seq = [7] + out
    logits = torch.full((v, v), -10.0)
    for a, b in zip(seq[:-1], seq[1:]):
        logits[a].fill_(-10.0)
    for a, b in zip(seq[:-1], seq[1:]):
        logits[a, b] = 5.0
        logits[a, (b + 1) % v] = 6.0
    acc = T.measure_acceptance(eng, BigramDraft(None, logits, v), [[7]], max_new_tokens=30, k=4, max_depth=2)
    # every position's successor is unique in this sequence only if the greedy text never repeats a token
    # with a different successor; rank 1 then carries the acceptance
    assert acc["q"][0][1] >= 0.5 and acc["q"][0][0] <= 0.5


@pytest.mark.parametrize("tree", ["chain:3", "full:2,2", "full:3,3"])
def test_simulated_steps_equal_real_greedy_decoding(tree):
    """The cheap acceptance simulation (teacher-forced draft ranks) counts exactly the verify
    steps of real greedy tree decoding."""
    from conftest import random_model, tiny_config, truncated

    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.decode import SpeculativeDecoder

    m = random_model(tiny_config("llama", vocab=96, layers=3, hidden=64), seed=3)
    tgt, dft = TorchEngine(m), TorchEngine(truncated(m, 1))
    mode = "chain" if tree.startswith("chain") else "tree"
    paths = T.spec_paths(tree)
    k = max(p[-1] for p in paths) + 1
    for prompt in ([1, 2, 3], [9, 8, 7, 6, 5]):
        res = SpeculativeDecoder(tgt, dft, mode=mode, tree=tree).generate(prompt, 40)
        seq = prompt + res.tokens
        rank = T.draft_topk_ranks(dft, seq, k).tolist()
        assert T.simulate_greedy_steps(rank, len(prompt), len(seq), paths) == res.stats.steps


def test_in_loop_step_times_are_measured_interleaved(monkeypatch):
    """The trees' and vanilla's in-loop step times come from decoding each prompt with every
    policy in turn (a slow spell of the machine falls on all of them alike), not one policy over
    every prompt and then the next: here the decoder records (policy, prompt) per generation."""
    from conftest import random_model, tiny_config, truncated

    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.decode import SpeculativeDecoder

    m = random_model(tiny_config("llama"), seed=1)
    target, draft = TorchEngine(m), TorchEngine(truncated(m, 1))
    order, real = [], SpeculativeDecoder.generate

    def recording(self, prompt, n, *a, **k):
        order.append((self.policy.spec if self.policy else "vanilla", tuple(prompt)))
        return real(self, prompt, n, *a, **k)

    monkeypatch.setattr(SpeculativeDecoder, "generate", recording)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    pols = [StaticTree([[0]]), StaticTree([[0], [0, 0]]), None]
    ms = [m for m, _ in T.loop_measure(target, draft, pols, prompts, 6, ())]
    assert len(ms) == 3 and all(x > 0 for x in ms)
    timed = order[3:]  # after one warm-up generation each
    names = [o[0] for o in order[:3]]
    assert timed == [(n, tuple(p)) for p in prompts for n in names], timed


@pytest.mark.parametrize("tree,temperature", [("chain:3", 3.0), ("full:2,2", 4.0), ("full:3,3", 5.0)])
def test_replay_over_sampled_text_equals_sampled_tree_decoding(tree, temperature):
    """Sampled, a static tree's walk (`topk` candidates) commits a child's token exactly when it
    accepted that child (a rejected child is zeroed before the final draw), so replaying the tree
    over the text sampled tree decoding itself committed counts exactly its verify steps: what
    `tune --temperature` relies on to count tokens per step on sampled text."""
    from conftest import random_model, tiny_config, truncated

    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.sampling import SamplingParams

    # flat rows (scale 0.3) at these temperatures: the text is not the greedy one, some drafted
    # tokens are accepted and some steps stop short of the tree's depth
    m = random_model(tiny_config("llama", vocab=96, layers=3, hidden=64), seed=3, scale=0.3)
    tgt, dft = TorchEngine(m), TorchEngine(truncated(m, 1))
    mode = "chain" if tree.startswith("chain") else "tree"
    paths = T.spec_paths(tree)
    k = max(p[-1] for p in paths) + 1
    sp = SamplingParams(temperature)
    accepted = short = differs = 0
    for seed, prompt in enumerate(([1, 2, 3], [9, 8, 7, 6, 5], [4, 4, 4])):
        res = SpeculativeDecoder(tgt, dft, mode=mode, tree=tree, sampling=sp).generate(prompt, 40, seed=seed)
        seq = prompt + res.tokens
        rank = T.draft_topk_ranks(dft, seq, k).tolist()
        assert T.simulate_greedy_steps(rank, len(prompt), len(seq), paths) == res.stats.steps
        accepted += len(res.tokens) - res.stats.steps
        short += sum(n for a, n in res.stats.accepted_hist.items() if int(a) <= max(map(len, paths)))
        differs += res.tokens != SpeculativeDecoder(tgt, mode="vanilla").generate(prompt, 40).tokens
    assert accepted > 0 and short > 3 and differs


def test_sampled_acceptance_is_measured_on_sampled_text():
    """Drafting with the target itself: on greedy text its token is always its own rank 0; on text
    sampled at T = 20 (rows near flat) the sampled token is mostly not its argmax, so rank 0 holds
    less than all."""
    from conftest import random_model, tiny_config

    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.sampling import SamplingParams

    eng = TorchEngine(random_model(tiny_config("llama", vocab=96, layers=2, hidden=64)))
    prompts = [[1, 2, 3], [4, 5]]
    greedy = T.measure_acceptance(eng, eng, prompts, max_new_tokens=30, k=4, max_depth=2)
    sampled = T.measure_acceptance(eng, eng, prompts, 30, 4, 2, sampling=SamplingParams(20.0), seed=5)
    assert greedy["q"][0][0] == pytest.approx(1.0) and greedy["text"] == "greedy"
    assert sampled["text"] == "sampled" and 0.0 < sampled["q"][0][0] < 0.95 and sum(sampled["q"][0][1:]) > 0
    again = T.measure_acceptance(eng, eng, prompts, 30, 4, 2, sampling=SamplingParams(20.0), seed=5)
    assert again["q"] == sampled["q"]  # seeded: prompt i is drawn with seed + i


def test_tune_for_sampling_writes_its_own_tree_and_auto_picks_it_by_temperature(tmp_path, capsys):
    """`tune --temperature T` writes tree_auto.sampled.json (the greedy tree_auto.json untouched),
    records the sampling it measured and the candidates that were faster in the loop, and `--tree
    auto` takes it (and its candidates) at temperature > 0 (generate, the embedding API) and the
    greedy tree at 0."""
    from types import SimpleNamespace

    from conftest import random_model, tiny_config

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.generator import Generator
    from arborspec.runtime.sampling import SamplingParams
    from arborspec.runtime.tuned_tree import auto_tree_file
    from arborspec.tools.commands.cli import main

    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=6, scale=1.0)
    e = tmp_path / "e"
    export_folder(
        SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"}),
        e,
        draft="layers:1",
        progress=False,
    )
    assert auto_tree_file(e, None, sampled=True).name == "tree_auto.sampled.json"
    assert auto_tree_file(e, "lookup", sampled=True).name == "tree_auto.lookup.sampled.json"
    small = ["--max-nodes", "6", "--max-depth", "3", "--max-width", "3", "--n-prompts", "2", "--calib-tokens", "16"]
    small += ["--reps", "2", "--past", "16", "--loop-candidates", "1", "--loop-tokens", "6", "--quiet"]
    tune = ["tune", "--export-dir", str(e)] + small
    # bad sampling: one line, exit 2, nothing written
    assert main(tune + ["--temperature", "-1"]) == 2
    assert main(tune + ["--top-p", "0.9"]) == 2 and "--temperature" in capsys.readouterr().err
    assert not list(e.glob("tree_auto*"))
    assert main(tune + ["--temperature", "0.8", "--top-p", "0.95"]) == 0
    doc = json.loads((e / "tree_auto.sampled.json").read_text())
    assert doc["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.95} and doc["acceptance"]["text"] == "sampled"
    assert not (e / "tree_auto.json").exists()
    # each loop candidate ran with both candidate modes; the file keeps the faster one's
    loop = doc["in_loop"]["candidates"]
    assert [c["candidates"] for c in loop] == ["topk", "sample-unique"] and all(
        c["loop_tokens_per_step"] >= 1 for c in loop
    )
    best = {m: max(c["loop_tokens_per_s"] for c in loop if c["candidates"] == m) for m in ("topk", "sample-unique")}
    won = "sample-unique" if best["sample-unique"] >= T.SAMPLED_MARGIN * best["topk"] else "topk"
    assert doc["candidates"] == won and doc["predicted_tokens_per_s"] == pytest.approx(best[won])
    gen = ["generate", "--export-dir", str(e), "--prompt-ids", "3,4,5,3,4", "--max-new-tokens", "6", "--tree", "auto"]
    capsys.readouterr()
    assert main(gen + ["--temperature", "0.8", "--json"]) == 0
    assert "tree_auto.sampled.json" in json.loads(capsys.readouterr().out)["stats"]["tree"]
    assert main(gen) == 2  # greedy: no greedy tree tuned yet, one line naming the command
    assert "arborspec tune --export-dir" in capsys.readouterr().err
    assert main(tune) == 0
    doc = json.loads((e / "tree_auto.json").read_text())
    assert doc["sampling"] is None and doc["acceptance"]["text"] == "greedy"
    capsys.readouterr()
    assert main(gen + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["tree"].endswith("tree_auto.json")
    assert doc["candidates"] is None  # greedy: top-k, always
    # the sampled file's candidates are what decoding with it takes, unless given explicitly
    for won in ("sample-unique", "topk"):
        sdoc = json.loads((e / "tree_auto.sampled.json").read_text())
        (e / "tree_auto.sampled.json").write_text(json.dumps(dict(sdoc, candidates=won)))
        with Generator.from_export(e, tree="auto") as g:
            assert str(g.tree).endswith("tree_auto.json") and str(g.sampled_tree).endswith("tree_auto.sampled.json")
            c = g.generate([3, 4, 5], max_new_tokens=4)
            assert c.stats.tree.endswith("tree_auto.json") and g._decoder(SamplingParams()).candidates == "topk"
            c = g.generate([3, 4, 5], max_new_tokens=4, temperature=0.8, seed=1)
            assert c.stats.tree.endswith("tree_auto.sampled.json")
            assert g._decoder(SamplingParams(0.8)).candidates == won
        with Generator.from_export(e, tree="auto", candidates="sample") as g:
            assert g._decoder(SamplingParams(0.8)).candidates == "sample"
        # bench: --tree auto at T > 0 runs the sampled file with its candidates; --candidates overrides
        pf = tmp_path / "p.json"
        pf.write_text(json.dumps({"prompts": [{"id": "a", "category": "c", "ids": [3, 4, 5, 3, 4]}]}))
        bench = ["bench", "--export-dir", str(e), "--prompts", str(pf), "--max-new-tokens", "4", "--modes", "tree"]
        bench += [
            "--tree",
            "auto",
            "--temperature",
            "0.8",
            "--warmup",
            "0",
            "--quiet",
            "--json-out",
            str(tmp_path / "b.json"),
        ]
        for extra, want in (([], won), (["--candidates", "sample"], "sample")):
            assert main(bench + extra) == 0
            cfg = json.loads((tmp_path / "b.json").read_text())["configs"][-1]
            assert cfg["name"].endswith("tree_auto.sampled.json") and cfg["candidates"] == want
    (e / "tree_auto.sampled.json").write_text(json.dumps(dict(sdoc, candidates="best")))
    assert main(gen + ["--temperature", "0.8"]) == 2
    assert "unknown candidates 'best'" in capsys.readouterr().err


@pytest.mark.parametrize("su_gain,want", [(1.01, "topk"), (1.05, "sample-unique")])
def test_sampled_loop_pricing_keeps_topk_unless_sample_unique_is_clearly_faster(monkeypatch, su_gain, want):
    """Sampled tuning runs each loop candidate with both rules and keeps top-k candidates unless
    sample-unique made SAMPLED_MARGIN (2 %) more tokens a second: a tie in the loop is noise
    (the int4 export's [[0]]: 114.9 against 114.3 tok/s there, 1.32x against 1.36x in the bench)."""
    from arborspec.runtime.sampling import SamplingParams

    grid = [
        {
            "paths": [[0]],
            "nodes": 1,
            "depth": 1,
            "tokens_per_s": 10.0,
            "step_ms": 10.0,
            "expected_tokens_per_step": 1.5,
        },
        {
            "paths": [[0], [0, 0]],
            "nodes": 2,
            "depth": 2,
            "tokens_per_s": 9.0,
            "step_ms": 11.0,
            "expected_tokens_per_step": 1.7,
        },
    ]
    seen = []

    def fake_measure(target, draft, pols, prompts, tokens, eos, progress=None, sampling=None):
        seen.extend((p[0].paths, p[1]) if p else None for p in pols)
        # (ms a step, tokens a step): [[0]] topk 100 tok/s, [[0],[0,0]] topk 90; sample-unique x su_gain
        return [(10.0, 1.0), (10.0, 0.9), (10.0, su_gain), (10.0, 0.9 * su_gain), (8.0, 1.0)]

    monkeypatch.setattr(T, "loop_measure", fake_measure)
    choice = {"grid": [dict(g) for g in grid]}
    loop = T.price_in_loop(None, None, choice, [[1, 2]], (), 2, 8, sampling=SamplingParams(0.8))
    assert [c["candidates"] for c in loop["candidates"]] == ["topk", "topk", "sample-unique", "sample-unique"]
    assert seen[-1] is None and [s[1] for s in seen[:4]] == ["topk", "topk", "sample-unique", "sample-unique"]
    assert choice["best"]["candidates"] == want and choice["best"]["paths"] == [[0]]
    assert choice["best"]["expected_tokens_per_step"] == pytest.approx(1.0 if want == "topk" else su_gain)
    assert choice["vanilla_tokens_per_s"] == pytest.approx(125.0)
    assert grid[0].get("candidates") is None  # the grid's rows are not rewritten


def test_cost_curves_time_calls_beside_the_decoders_host_threads():
    """The verify curve times each call with torch on the threads the decoder leaves it beside
    that engine (runtime/step.host_threads: 1 beside ONNX Runtime on the CPU), not torch's
    default: torch's woken threads fight ONNX Runtime's pool and overcharge every row past the
    first; the caller's setting comes back afterwards, and an engine without capabilities (a
    head) is timed under the caller's setting (tune sets the target's)."""
    from types import SimpleNamespace

    import torch

    from arborspec.runtime.backends.base import EngineCapabilities
    from arborspec.runtime.kvcache import CacheSpec
    from arborspec.tools.tune.cost_curves import decoder_threads, engine_cost_curve

    seen = []

    class Probe:
        device = torch.device("cpu")
        info = SimpleNamespace(max_position=64, vocab_size=16, cache=CacheSpec(n_layers=1, n_kv_heads=1, head_dim=2))
        caps = EngineCapabilities(host_threads=1)

        def forward(self, ids, pos, mask, cache):
            seen.append(torch.get_num_threads())

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        curve = engine_cost_curve(Probe(), [1, 2], past=4, reps=2)
        assert set(curve) == {1, 2} and seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
        seen.clear()
        with decoder_threads(SimpleNamespace()):  # no caps: the caller's threads
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
