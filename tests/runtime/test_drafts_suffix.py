"""The suffix draft (`--draft suffix`, `BASE+suffix`; runtime/drafts/suffix.py, suffix_index.py,
proposed.py): the automaton's longest repeat and end positions against brute force, incremental
update == rebuild, the continuation trie's counts, the proposal's length following the match,
the memory's bound and eviction and no leak across requests where it is off, the merge of a
proposal into a model tree; greedy == vanilla alone, mixed (the model told of proposed nodes it
did not draft) and batched; the spec, `open_export` and the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_model, tiny_config, truncated

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.model import ModelDraft
from arborspec.runtime.drafts.proposed import Proposal, ProposingPolicy, merge, proposal_tree
from arborspec.runtime.drafts.spec import SuffixOptions, parse_draft_spec
from arborspec.runtime.drafts.suffix import SuffixDraft, SuffixMixDraft, continuations, grow
from arborspec.runtime.drafts.suffix_index import Matcher, SuffixAutomaton, SuffixMemory
from arborspec.runtime.errors import ArborspecError
from arborspec.runtime.trees import Tree, parse_tree_spec


def _longest_repeat(s: list[int]) -> int:
    """Brute force: the longest suffix of s that also ends at an earlier position."""
    n = len(s)
    best = 0
    for L in range(1, n):
        suf = s[n - L :]
        if any(s[e - L + 1 : e + 1] == suf for e in range(L - 1, n - 1)):
            best = L
        else:
            break
    return best


@pytest.mark.parametrize("seed,alphabet", [(0, 2), (1, 3), (2, 6)])
def test_the_automaton_finds_the_longest_repeat_and_its_ends(seed, alphabet):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, alphabet, 120).tolist()
    sam = SuffixAutomaton()
    for i, t in enumerate(s):
        sam.append(t)
        state, length = sam.repeat()
        assert length == _longest_repeat(s[: i + 1])
        if length:
            suf = s[i + 1 - length : i + 1]
            want = [e for e in range(i - 1, length - 2, -1) if s[e - length + 1 : e + 1] == suf]
            assert sam.ends(state, i, limit=1000, visits=10**6) == want


def test_the_matcher_follows_the_longest_suffix_found_in_another_text():
    rng = np.random.default_rng(3)
    text = rng.integers(0, 4, 200).tolist()
    sam = SuffixAutomaton()
    sam.extend(text)
    stream = rng.integers(0, 4, 60).tolist()
    m = Matcher(sam)
    joined = "," + ",".join(map(str, text)) + ","
    for i, t in enumerate(stream):
        m.feed(t)
        best = 0
        for L in range(1, i + 2):
            if "," + ",".join(map(str, stream[i + 1 - L : i + 1])) + "," in joined:
                best = L
        assert m.length == best


def test_continuation_counts_and_the_best_path():
    text = [1, 2, 3, 9, 9, 1, 2, 3, 9, 8, 1, 2, 4, -1, 7]
    conts = continuations(text, [2, 7, 11], 4)  # after "1 2 3" twice, "1 2" once; a separator cuts
    assert conts == [[9, 9, 1, 2], [9, 8, 1, 2], [4]]
    assert continuations([5, 1, 2, 1, 2], [2], 5, periodic=True) == [[1, 2, 1, 2, 1]]  # a loop repeats
    p = grow(conts, 8, 0.1, paths=4)
    assert p.tokens.tolist() == [9, 4, 9, 8, 1, 1, 2, 2] and p.parents.tolist() == [-1, -1, 0, 0, 2, 3, 4, 5]
    assert np.allclose(np.exp(p.scores), [2 / 3] + [1 / 3] * 7)
    chain = grow(conts, 8, 0.1, paths=1)
    assert chain.parents.tolist() == [-1, 0, 1, 2] and chain.tokens.tolist() == [9, 9, 1, 2]
    assert grow(conts, 8, 0.5, paths=4).tokens.tolist() == [9]  # a share >= 1/2: the first token only
    assert grow(conts, 2, 0.1, paths=4).n == 2  # the budget


def _fed(d: SuffixDraft, prompt, tokens):
    d.reset(prompt[:-1])
    root = prompt[-1]
    for t in tokens:  # each step accepts nothing: the next token is the root
        d.propose(root)
        d.commit(Tree.empty(), torch.zeros(0, dtype=torch.long))
        root = t
    return d.propose(root)


def test_incremental_update_equals_a_rebuild():
    rng = np.random.default_rng(4)
    text = (rng.integers(0, 5, 40).tolist()) * 3
    a = _fed(SuffixDraft(8, SuffixOptions(min=1, paths=3)), text[:30], text[30:])
    b = SuffixDraft(8, SuffixOptions(min=1, paths=3))
    b.reset(text[:-1])
    p = b.propose(text[-1])
    assert a.n > 0 and a.tokens.tolist() == p.tokens.tolist() and a.parents.tolist() == p.parents.tolist()


def test_the_proposal_follows_the_match():
    rng = np.random.default_rng(5)
    span = rng.integers(10, 1000, 60).tolist()
    noise = rng.integers(1000, 2000, 50).tolist()
    d = SuffixDraft(2000, SuffixOptions(nodes=24, alpha=1.0, min=2))
    d.reset(span + noise + span[:29])
    long = d.propose(span[29])  # 30 tokens repeat: a 24-token chain, the span's next tokens
    assert long.tokens.tolist() == span[30:54] and long.parents.tolist() == list(range(-1, 23))
    d.reset(span + noise + [span[0], 5000])
    assert d.propose(span[1]).n == 0  # a match of one token (under min=2): nothing
    d.reset(noise + span[:20] + noise[:3] + span[:2])
    short = d.propose(span[2])  # three tokens match: three nodes, alpha x L
    assert short.tokens.tolist() == span[3:6]
    d.reset(list(range(3000, 3050)))
    assert d.propose(7).n == 0  # no repeat at all
    d.reset([50, 1, 2, 1, 2, 1, 2, 1])  # a loop: the copy overlaps itself and repeats
    assert d.propose(2).tokens.tolist() == [1, 2, 1, 2, 1, 2]


def test_the_memory_is_bounded_and_evicts_the_oldest():
    mem = SuffixMemory(100)
    for i in range(30):
        mem.add(list(range(1000 * i, 1000 * i + 20)))
        assert mem.tokens <= 100
    assert 1000 * 29 in mem.gens[-1].tokens and 0 not in (t for g in mem.gens for t in g.tokens)


def test_earlier_outputs_help_only_with_memory_on():
    rng = np.random.default_rng(6)
    answer = rng.integers(100, 900, 40).tolist()
    q1, q2 = rng.integers(1000, 1100, 30).tolist(), rng.integers(1100, 1200, 30).tolist()
    for mem, want in ((0, 0), (1000, 16)):
        d = SuffixDraft(2000, SuffixOptions(nodes=16, mem=mem))
        _fed(d, q1, answer)  # request 1 answers `answer`
        d.reset(q2 + answer[:19])  # request 2 starts writing the same answer
        assert d.propose(answer[19]).n == want
    d.forget()  # a cold request forgets what came before
    d.reset(q2 + answer[:19])
    assert d.propose(answer[19]).n == 0
    fork = SuffixDraft(2000, SuffixOptions(nodes=16, mem=1000))
    assert fork.memory is not d.memory  # every draft object has its own (forks share it)
    assert d.fork().memory is d.memory


def _model_tree(tokens_parents):
    par = torch.tensor([p for _, p in tokens_parents])
    toks = torch.tensor([t for t, _ in tokens_parents])
    return proposal_tree(Proposal(par.numpy(), toks.numpy(), np.zeros(len(par), dtype=np.float32)))


def test_merge_unions_paths_and_dedups():
    base = _model_tree([(5, -1), (6, -1), (7, 0)])  # 5 -> 7, 6
    prop = Proposal(np.array([-1, 0, 1]), np.array([5, 7, 8]), np.zeros(3, dtype=np.float32))  # 5 -> 7 -> 8
    t = merge(base, prop)
    assert t.tokens.tolist() == [5, 6, 7, 8] and t.parents.tolist() == [-1, -1, 0, 2]
    assert t.depth.tolist() == [1, 1, 2, 3] and t.base is base and t.base_kept == 3
    assert t.anc[3].tolist() == [True, False, True, True]
    assert merge(base, Proposal(np.array([-1]), np.array([6]), np.zeros(1, dtype=np.float32))) is base
    chain = _model_tree([(5, -1)])
    other = Proposal(np.array([-1, 0, 1]), np.array([9, 8, 7]), np.zeros(3, dtype=np.float32))
    assert merge(chain, other).n == 4  # no leaf limit: a second branch
    assert merge(chain, other, paths=1, lead=4) is chain  # a short disagreeing proposal loses
    alone = merge(chain, other, paths=1, lead=3)  # a long one replaces the model's tree
    assert alone.tokens.tolist() == [9, 8, 7] and alone.base is chain and alone.base_kept == 0


def _target():
    cfg = tiny_config("llama", vocab=24, layers=2, hidden=32)
    return random_model(cfg, seed=11, scale=1.5)


PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 6, 8, 3, 4, 5]


def test_the_shortest_match_defaults_to_one_alone_and_four_mixed():
    """Unless `min` is given, the suffix draft alone proposes from a one-token match, and mixed
    with a model draft only from MIN_MIXED tokens (shorter matches mostly add rows after the
    model's own node that the target rejects: measured, runtime/drafts/spec.py); a given `min` is
    kept either way, and min=0 is refused in one line."""
    from arborspec.runtime.drafts.spec import MIN_ALONE, MIN_MIXED

    assert (MIN_ALONE, MIN_MIXED) == (1, 4)
    text = [5, 6, 7, 8, 9, 20, 21, 5, 6, 7]  # the context ends with "5 6 7" seen before
    alone = SuffixDraft(64)
    alone.reset(text[:-1])
    assert alone.propose(text[-1]).tokens.tolist()[:1] == [8]  # a 3-token match: proposed alone
    base = ModelDraft(TorchEngine(truncated(_target(), 1)))
    mixed = SuffixMixDraft(base, SuffixDraft(64))
    assert mixed.suffix.opts.min == MIN_MIXED
    mixed.suffix.reset(text[:-1])
    assert mixed.propose(text[-1]).n == 0  # 3 tokens < 4: nothing to merge
    mixed.suffix.reset(text[:-1] + [8, 9, 22, 5, 6, 7, 8])
    assert mixed.propose(9).n > 0  # "5 6 7 8 9" again: a 5-token match
    kept = SuffixMixDraft(base, SuffixDraft(64, SuffixOptions(min=1)))
    assert kept.suffix.opts.min == 1
    assert parse_draft_spec("export+suffix").mix.min is None
    with pytest.raises(ArborspecError, match="min, paths, lead >= 1"):
        parse_draft_spec("export+suffix:min=0")


@pytest.mark.parametrize("tree", ["chain:1", "full:2,2", "dynamic:2,3,6"])
@pytest.mark.parametrize("kind", ["suffix", "model+suffix"])
def test_greedy_with_the_suffix_draft_is_vanilla(kind, tree):
    m = _target()
    eng = TorchEngine(m)
    ref = SpeculativeDecoder(eng, mode="vanilla").generate(PROMPT, 40).tokens
    suffix = SuffixDraft(24, SuffixOptions(nodes=8, min=1, alpha=2.0, paths=2, lead=2))
    draft = suffix if kind == "suffix" else SuffixMixDraft(ModelDraft(TorchEngine(truncated(m, 1))), suffix)
    dec = SpeculativeDecoder(eng, draft, tree=tree)
    assert isinstance(dec.policy, ProposingPolicy) and dec.policy.max_nodes == (
        8 if kind == "suffix" else 8 + parse_tree_spec(tree).max_nodes
    )
    seen = {"proposed": 0}
    commit = draft.commit

    def spy(t, path, features=None):  # count accepted nodes that the suffix draft proposed
        if kind == "suffix":
            seen["proposed"] += int(path.numel())
        elif t.base is not None:
            seen["proposed"] += int((path >= t.base_kept).sum())
        commit(t, path, features)

    draft.commit = spy
    res = dec.generate(PROMPT, 40)
    assert res.tokens == ref
    assert seen["proposed"] > 0  # the proposals reached the verify and were accepted
    assert res.stats.steps < 40


def test_batched_greedy_with_the_suffix_draft_is_vanilla():
    m = _target()
    eng = TorchEngine(m)
    prompts = [PROMPT, [9, 10, 9, 10, 9]]
    ref = [SpeculativeDecoder(eng, mode="vanilla").generate(p, 20).tokens for p in prompts]
    bd = BatchDecoder(eng, SuffixDraft(24, SuffixOptions(min=1)), tree="chain:1", max_batch=2)
    assert [r.tokens for r in bd.generate_many(prompts, 20)] == ref


def test_specs_and_one_line_errors(tmp_path, capsys):
    from types import SimpleNamespace

    from arborspec.export.export_folder import export_folder
    from arborspec.runtime.export_dir import open_export
    from arborspec.tools.commands.cli import main

    assert parse_draft_spec("suffix").arg == SuffixOptions()
    assert parse_draft_spec("SUFFIX:nodes=16,alpha=2,mem=4096").arg == SuffixOptions(nodes=16, alpha=2.0, mem=4096)
    ds = parse_draft_spec("export+suffix:paths=2")
    assert (ds.kind, ds.mix_kind, ds.mix) == ("export", "suffix", SuffixOptions(paths=2))
    for bad in ("suffix:nodes=0", "suffix:size=3", "suffix:alpha=x", "suffix+lookup", "lookup+suffix", "suffix:prob=2"):
        with pytest.raises(ArborspecError, match="bad draft spec"):
            parse_draft_spec(bad)
    m = random_model(tiny_config("llama", vocab=64, layers=2, hidden=64, heads=4, kv=2), seed=6, scale=1.0)
    lm = SimpleNamespace(module=m, config=m.config, tokenizer=None, source={"kind": "test"})
    export_folder(lm, tmp_path / "e", draft="layers:1", progress=False)
    ids = [3, 4, 5, 3, 4, 5, 3, 4]
    with open_export(tmp_path / "e", draft="export+suffix") as ex:
        assert isinstance(ex.draft, SuffixMixDraft)
        ref = SpeculativeDecoder(ex.target, mode="vanilla").generate(ids, 16).tokens
        assert SpeculativeDecoder(ex.target, ex.draft, tree="full:2,2").generate(ids, 16).tokens == ref
    with open_export(tmp_path / "e", draft="suffix:min=1") as ex:
        assert isinstance(ex.draft, SuffixDraft)
        assert SpeculativeDecoder(ex.target, ex.draft, tree="chain:1").generate(ids, 16).tokens == ref
    args = [
        "generate",
        "--export-dir",
        str(tmp_path / "e"),
        "--prompt-ids",
        ",".join(map(str, ids)),
        "--max-new-tokens",
        "8",
    ]
    assert main(args + ["--draft", "export+suffix", "--tree", "full:2,2"]) == 0
    assert main(args + ["--draft", "suffix", "--tree", "chain:1"]) == 0
    capsys.readouterr()
    assert main(args + ["--draft", "suffix:nodes=zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("arborspec: error: bad draft spec") and err.count("\n") == 1


@pytest.mark.slow
def test_smollm2_int4_export_greedy_with_the_suffix_draft_is_vanilla():
    """On the real int4 SmolLM2 export with its EAGLE-3 head (when this machine has it cached):
    `suffix` and `export+suffix` with the tuned tree decode vanilla's tokens on a request that
    repeats its prompt, and the suffix draft carries more than one token a call there."""
    from arborspec.models.registry import cache_dir
    from arborspec.runtime.export_dir import open_export

    e = cache_dir() / "exports" / "smollm2-135m-int4-eagle3-int8-v24"
    if not (e / "manifest.json").is_file():
        pytest.skip(f"no cached int4 SmolLM2 export with a head at {e}")
    text = "Repeat this list exactly, twice: apples, pears, plums, figs, dates, limes, kiwis, cherries."
    with open_export(e, draft="export") as ex:
        ids = ex.tokenizer.encode(ex.tokenizer.apply_chat([{"role": "user", "content": text}]), add_bos=False)
        ref = SpeculativeDecoder(ex.target, mode="vanilla").generate(ids, 48).tokens
        tuned = f"static:{e / 'tree_auto.json'}"
        alone = SpeculativeDecoder(ex.target, SuffixDraft(ex.target.info.vocab_size), tree="chain:1").generate(ids, 48)
        assert alone.tokens == ref and alone.stats.mean_accepted > 1.2
        mixed = SuffixMixDraft(ex.draft, SuffixDraft(ex.target.info.vocab_size))
        assert SpeculativeDecoder(ex.target, mixed, tree=tuned).generate(ids, 48).tokens == ref
