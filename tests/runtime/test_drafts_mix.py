"""A model draft mixed with prompt lookup (`--draft BASE+lookup[:N]`, runtime/drafts/mixed.py):
the mixture's top-k and rows are what its docstring says (q = w p_L + (1 - w) p_M where
lookup finds a continuation, p_M elsewhere, duplicates merged); greedy tree (every policy) and
chain == vanilla with a layers:K draft and with an EAGLE-3 head over a reduced vocabulary;
lossless sampling (top-k and sampled candidates); the CLI and `open_export` take the spec, and
bad specs are one line."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_model, tiny_config, truncated
from lossless_util import chi_square_pvalue, exact_two_token_distribution, sample_two_tokens
from test_eagle3 import SAMPLING_CASES, sampling_target
from test_eagle3 import _draft as eagle3_draft

from arborspec.models.eagle3 import default_aux_layers
from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.base import TopK
from arborspec.runtime.drafts.lookup import LookupDraft
from arborspec.runtime.drafts.mixed import LookupMixDraft
from arborspec.runtime.drafts.model import as_draft_source
from arborspec.runtime.drafts.spec import DraftSpec, parse_draft_spec
from arborspec.runtime.errors import ArborspecError
from arborspec.runtime.sampling import SamplingParams
from arborspec.runtime.trees import StaticTree

POLICIES = ["chain:3", "full:2,2", "beam:2,3,3", "dynamic:3,3,8", "dynamic:2,5,8,0.2", "static"]
# a prompt that repeats itself, so lookup finds continuations and the mixture is exercised
PROMPT = [5, 9, 2, 7, 1, 5, 9, 2, 7, 3, 5, 9, 2]


class _FixedModel:
    """A stand-in model draft: fixed top-k answers over a reduced vocabulary."""

    vocab_size, finite_logits, needs_target_features, kind = 4, True, False, "fixed"
    token_map = torch.tensor([10, 11, 12, 13])
    model_s = 0.0

    def __init__(self, rows: TopK):
        self.rows = rows

    def expand_topk(self, nodes, frontier, k, logprobs=False):
        return TopK(self.rows.values[:, :k], self.rows.indices[:, :k])


def test_the_mixture_ranks_lookup_first_and_merges_duplicates():
    model = _FixedModel(TopK(torch.log(torch.tensor([[0.6, 0.3], [0.7, 0.2]])), torch.tensor([[1, 0], [2, 3]])))
    look = LookupDraft(20, max_ngram=1)
    mix = LookupMixDraft(model, look, weight=0.5)
    # row 0: lookup saw 11 (= model id 1) twice and 15 once; row 1: lookup has nothing
    lk = TopK(torch.log(torch.tensor([[2 / 3, 1 / 3], [0.0, 0.0]])), torch.tensor([[11, 15], [0, 0]]))
    got = mix._mix_topk(model.expand_topk(None, None, 2), lk, 3)
    assert got.indices[0].tolist() == [11, 15, 10]
    assert torch.allclose(got.values[0].exp(), torch.tensor([0.5 * 2 / 3 + 0.5 * 0.6, 0.5 / 3, 0.5 * 0.3]))
    assert got.indices[1, :2].tolist() == [12, 13]  # no lookup hit: q = p_M
    assert torch.allclose(got.values[1, :2].exp(), torch.tensor([0.7, 0.2]))
    assert got.values[1, 2] == -math.inf
    rows = mix._mix_rows(torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0]])), torch.full((1, 20), -math.inf))
    assert torch.allclose(rows.exp().sum(-1), torch.ones(1)) and rows[0, 10].exp() == pytest.approx(0.5)


def test_draft_specs_parse_or_fail_in_one_line():
    """The one draft-spec parser (runtime/drafts/spec.py) the runtime, the CLI and export share."""
    assert parse_draft_spec("eagle3+lookup") == DraftSpec("eagle3", "eagle3", 3, "eagle3")
    assert parse_draft_spec("eagle3:/x/y+lookup:5") == DraftSpec("eagle3", "eagle3:/x/y", 5, "eagle3:/x/y")
    assert parse_draft_spec("layers:2") == DraftSpec("layers", 2, None, "layers:2")
    assert parse_draft_spec(None).kind == "none" and parse_draft_spec(" ", default="export").kind == "export"
    assert parse_draft_spec("lookup").arg == 3 and parse_draft_spec("LOOKUP:5").arg == 5
    assert parse_draft_spec("export+lookup:4") == DraftSpec("export", None, 4, "export")
    assert parse_draft_spec("bigram").kind == "bigram" and parse_draft_spec("HuggingFaceTB/x").kind == "model"
    for bad in ("+lookup", "lookup+lookup", "eagle3+bigram", "eagle3+lookup:0", "layers:x", "lookup:two"):
        with pytest.raises(ArborspecError) as e:
            parse_draft_spec(bad)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def target():
    m = random_model(tiny_config("llama", vocab=96, layers=4, hidden=64, heads=4, kv=2), seed=3)
    m.feature_layers = default_aux_layers(4)
    return m


@pytest.mark.parametrize("spec", POLICIES)
def test_greedy_with_a_mixed_draft_equals_vanilla(target, tmp_path, spec):
    eng = TorchEngine(target)
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(PROMPT, 30).tokens
    mode = "chain" if spec.startswith("chain") else "tree"
    tree = StaticTree([[0], [1], [0, 0], [0, 0, 0]]) if spec == "static" else spec
    for base in (eagle3_draft(target, tmp_path), as_draft_source(TorchEngine(truncated(target, 1)))):
        mix = LookupMixDraft(base, LookupDraft(96, max_ngram=2))
        dec = SpeculativeDecoder(eng, mix, mode=mode, tree=tree)
        assert dec.generate(PROMPT, 30).tokens == ref, (spec, base.kind)
        assert dec.generate([4], 12).tokens == SpeculativeDecoder(eng, mode="vanilla").generate([4], 12).tokens


@pytest.mark.parametrize("cand,sp,spec", SAMPLING_CASES)
def test_sampling_with_a_mixed_draft_is_lossless(tmp_path, cand, sp, spec):
    m = sampling_target()
    eng = TorchEngine(m)
    prompt = [1, 3, 2, 1, 3, 5, 1, 3]  # lookup proposes after "1 3", the head everywhere
    exact = exact_two_token_distribution(eng, prompt, sp)
    assert (exact > 0.01).sum() >= 4
    mix = LookupMixDraft(eagle3_draft(m, tmp_path, draft_vocab=5, seed=2, scale=0.3), LookupDraft(8, max_ngram=2))
    mode = "chain" if spec.startswith("chain") else "tree"
    dec = SpeculativeDecoder(eng, mix, mode=mode, tree=spec, candidates=cand, sampling=sp)
    counts = sample_two_tokens(dec, prompt, 2000, seed0=900)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_export_folder_and_cli_take_a_mixed_draft(tmp_path, capsys):
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.export_dir import open_export
    from arborspec.tools.commands.cli import main

    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=6, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    export_folder(lm, tmp_path / "e", draft="layers:1", progress=False)
    export_folder(lm, tmp_path / "n", draft="none", progress=False)
    with open_export(tmp_path / "e", draft="export+lookup:2") as ex:
        assert isinstance(ex.draft, LookupMixDraft) and ex.draft.lookup.max_n == 2
        ids = [3, 4, 5, 3, 4, 5, 3, 4]
        ref = SpeculativeDecoder(ex.target, mode="vanilla").generate(ids, 16).tokens
        assert SpeculativeDecoder(ex.target, ex.draft, tree="full:2,2").generate(ids, 16).tokens == ref
    with pytest.raises(ArborspecError, match="no model draft to mix"):
        open_export(tmp_path / "n", draft="export+lookup")
    args = ["generate", "--export-dir", str(tmp_path / "e"), "--prompt-ids", "3,4,5,3,4,5,3,4", "--max-new-tokens", "8"]
    assert main(args + ["--draft", "export+lookup", "--tree", "full:2,2"]) == 0
    capsys.readouterr()
    assert main(args + ["--draft", "lookup+lookup"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("arborspec: error: bad draft spec") and err.count("\n") == 1


@pytest.mark.parametrize("kind", ["mix", "lookup"])
@pytest.mark.parametrize("tree", ["chain:3", "full:2,2", "static"])
def test_tune_replay_counts_the_steps_of_real_decoding(target, tmp_path, kind, tree):
    """`tune` measures a mixed draft (and plain lookup) through the draft-source interface
    (acceptance_sim.source_depth_ranks): replaying the decoding loop over those ranks takes
    exactly the verify steps real greedy decoding takes, and the cost curve measures the model's
    level call (the lookup's own table gather for plain lookup)."""
    import json

    from arborspec.tools.tune.acceptance_sim import measure_acceptance, simulate_greedy_steps, spec_paths
    from arborspec.tools.tune.cost_curves import draft_cost_curve

    eng = TorchEngine(target)
    look = LookupDraft(96, max_ngram=2)
    draft = LookupMixDraft(eagle3_draft(target, tmp_path, draft_vocab=60, seed=4, scale=0.5), look)
    draft = draft if kind == "mix" else look
    paths = [[0], [1], [0, 0], [0, 0, 0], [1, 0]] if tree == "static" else spec_paths(tree)
    spec = tree
    if tree == "static":
        (tmp_path / "t.json").write_text(json.dumps({"paths": paths}))
        spec = f"static:{tmp_path / 't.json'}"
    prompts = [PROMPT, [3, 8, 8, 4, 3, 8, 8], [11, 2]]
    acc = measure_acceptance(eng, draft, prompts, 30, 8, 4)
    steps = tokens = 0
    for p, run in zip(prompts, acc["runs"]):
        mode = "chain" if tree.startswith("chain") else "tree"
        res = SpeculativeDecoder(eng, draft, mode=mode, tree=spec).generate(p, 30)
        assert run["end"] - run["start"] == len(res.tokens)
        assert simulate_greedy_steps(None, run["start"], run["end"], paths, run["by_depth"]) == res.stats.steps
        steps, tokens = steps + res.stats.steps, tokens + len(res.tokens)
    assert steps < tokens  # drafted tokens were accepted
    cost = draft_cost_curve(draft, [1, 4], past=32, reps=2)
    assert set(cost) == {1, 4} and all(v > 0 for v in cost.values())


def test_tune_and_tree_auto_per_draft_on_an_export(tmp_path, capsys):
    """`tune --export-dir DIR --draft export+lookup` writes its own tree file next to the export
    draft's (tree_auto.export_lookup.json), and `--tree auto` with that draft decodes with it:
    each draft gets the tree tuned for it."""
    import json
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.generator import Generator
    from arborspec.runtime.tuned_tree import auto_tree_file
    from arborspec.tools.commands.cli import main

    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=6, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    e = tmp_path / "e"
    export_folder(lm, e, draft="layers:1", progress=False)
    assert auto_tree_file(e).name == "tree_auto.json" and auto_tree_file(e, "export").name == "tree_auto.json"
    assert auto_tree_file(e, "export+lookup:2").name == "tree_auto.export_lookup_2.json"
    # the suffix draft adds its own nodes: BASE+suffix decodes on BASE's tuned tree
    assert auto_tree_file(e, "export+suffix").name == auto_tree_file(e, "suffix").name == "tree_auto.json"
    small = ["--max-nodes", "6", "--max-depth", "3", "--max-width", "3", "--n-prompts", "2", "--calib-tokens", "16"]
    small += ["--reps", "2", "--past", "16", "--loop-candidates", "1", "--loop-tokens", "6", "--quiet"]
    gen = ["generate", "--export-dir", str(e), "--prompt-ids", "3,4,5,3,4,5,3,4", "--max-new-tokens", "8"]
    assert main(gen + ["--draft", "export+lookup", "--tree", "auto"]) == 2  # not tuned yet: one line
    assert "--draft export+lookup" in capsys.readouterr().err
    assert main(["tune", "--export-dir", str(e), "--draft", "export+lookup"] + small) == 0
    doc = json.loads((e / "tree_auto.export_lookup.json").read_text())
    assert doc["draft"] == "export+lookup" and not (e / "tree_auto.json").exists()
    capsys.readouterr()
    assert main(gen + ["--draft", "export+lookup", "--tree", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "tree_auto.export_lookup.json" in json.dumps(out)
    with Generator.from_export(e, draft="export+lookup", tree="auto") as g:
        assert "tree_auto.export_lookup.json" in str(g.tree)
    # no tree named: the tuned one is the default where `tune` ran for that draft, else the export's
    with Generator.from_export(e, draft="export+lookup") as g, Generator.from_export(e) as own:
        assert "tree_auto.export_lookup.json" in str(g.tree) and own.tree == "full:3,2"
    capsys.readouterr()
    assert main(gen + ["--draft", "export+lookup", "--json"]) == 0
    assert "tree_auto.export_lookup.json" in json.loads(capsys.readouterr().out)["stats"]["tree"]
    assert main(gen + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["tree"] == "full:3,2"
    # bench: --lookup-tree auto takes the tree tuned for lookup, --mix-tree auto the mixed one's
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps({"prompts": [{"id": "a", "category": "c", "ids": [3, 4, 5, 3, 4, 5, 3, 4]}]}))
    bench = ["bench", "--export-dir", str(e), "--prompts", str(pf), "--max-new-tokens", "6", "--modes", "vanilla"]
    bench += ["--warmup", "0", "--no-progress", "--lookup-tree", "auto", "--mix-tree", "auto"]
    assert main(bench) == 2  # lookup not tuned yet: one line naming the command that tunes it
    assert "--draft lookup" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["tune", "--export-dir", str(e), "--draft", "lookup"] + small) == 0
    assert main(bench + ["--json-out", str(tmp_path / "b.json")]) == 0
    names = [c["name"] for c in json.loads((tmp_path / "b.json").read_text())["configs"]]
    assert any("tree_auto.lookup.json" in n and n.startswith("lookup+") for n in names), names
    assert any("tree_auto.export_lookup.json" in n and n.startswith("mix+") for n in names), names
    # no --tree: the tree mode runs the tree tuned for the draft, as generate and serve do
    one = ["bench", "--export-dir", str(e), "--prompts", str(pf), "--max-new-tokens", "6", "--warmup", "0"]
    assert (
        main([*one, "--no-progress", "--modes", "tree", "--draft", "lookup", "--json-out", str(tmp_path / "c.json")])
        == 0
    )
    names = [c["name"] for c in json.loads((tmp_path / "c.json").read_text())["configs"]]
    assert any("tree_auto.lookup.json" in n for n in names), names


def test_batched_decoding_with_a_mixed_draft_equals_decoding_alone(target, tmp_path):
    """Batched: every sequence drafts through its own fork (its own head cache and lookup index)
    and equals decoding it alone, with the same verify steps."""
    from arborspec.runtime.batch_decode import BatchDecoder

    eng = TorchEngine(target)
    prompts = [PROMPT, [4], [3, 3, 8, 1, 6, 3, 3, 8, 1], [7, 2]]

    def mixed():
        return LookupMixDraft(eagle3_draft(target, tmp_path), LookupDraft(96, max_ngram=2))

    ref = [SpeculativeDecoder(eng, mixed(), tree="full:2,2").generate(p, 20) for p in prompts]
    got = BatchDecoder(eng, mixed(), tree="full:2,2", max_batch=3).generate_many(prompts, 20)
    assert [s.tokens for s in got] == [r.tokens for r in ref]
    assert [s.stats.steps for s in got] == [r.stats.steps for r in ref]


def test_a_probability_floor_sizes_the_tree_step_by_step(target, tmp_path):
    """dynamic:K,D,N,P keeps only nodes whose cumulative draft probability is >= P: the trees
    shrink where the draft is unsure (down to none: a plain one-token step), every node kept
    clears the floor, and the output still equals vanilla."""
    from arborspec.runtime.drafts.tree_builder import draft_tree
    from arborspec.runtime.trees import parse_tree_spec
    from arborspec.tools.tune.acceptance_sim import target_features

    eng = TorchEngine(target)
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(PROMPT, 30).tokens
    sizes = {}
    for spec in ("dynamic:2,5,8", "dynamic:2,5,8,0.3"):
        mix = LookupMixDraft(eagle3_draft(target, tmp_path), LookupDraft(96, max_ngram=2))
        dec = SpeculativeDecoder(eng, mix, tree=spec)
        r = dec.generate(PROMPT, 30)
        assert r.tokens == ref
        sizes[spec] = r.stats.tree_nodes / r.stats.steps
    assert sizes["dynamic:2,5,8,0.3"] < sizes["dynamic:2,5,8"]
    pol = parse_tree_spec("dynamic:2,5,8,0.3")
    mix = LookupMixDraft(eagle3_draft(target, tmp_path), LookupDraft(96, max_ngram=2))
    mix.prepare(pol, 64)
    mix.reset(PROMPT[:-1], target_features(eng, PROMPT[:-1]))
    tree = draft_tree(mix, pol, PROMPT[-1], SamplingParams())
    assert tree.n <= 8 and bool((tree.score >= math.log(0.3) - 1e-6).all())
