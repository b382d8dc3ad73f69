"""Tree invariants (hypothesis): each node sees exactly its ancestors and itself, siblings
share a position, positions are past_len + depth, budgets are respected; spec parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arborspec.runtime.drafts.base import DraftSource
from arborspec.runtime.drafts.tree_builder import DraftOptions, draft_tree
from arborspec.runtime.sampling import SamplingParams
from arborspec.runtime.tree_plan import VerifyBuffers, verify_inputs
from arborspec.runtime.trees import TreeSpecError, parse_tree_spec


class RandomDraft(DraftSource):
    """A draft source with random (seeded) logits: enough to exercise the tree code."""

    kind = "fake"

    def __init__(self, vocab, seed):
        self.vocab_size = vocab
        self.g = torch.Generator().manual_seed(seed)

    def start(self, root):
        return torch.randn(self.vocab_size, generator=self.g)

    def expand(self, nodes, frontier):
        return torch.randn(frontier.numel(), self.vocab_size, generator=self.g)


specs = st.one_of(
    st.builds(lambda k: f"chain:{k}", st.integers(1, 6)),
    st.builds(lambda d, w: f"full:{d},{w}", st.integers(1, 3), st.integers(1, 4)),
    st.builds(lambda ws: "beam:" + ",".join(map(str, ws)), st.lists(st.integers(1, 8), min_size=1, max_size=4)),
    st.builds(lambda k, d, n: f"dynamic:{k},{d},{n}", st.integers(1, 4), st.integers(1, 4), st.integers(1, 20)),
)


def ancestors_by_walk(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@settings(max_examples=60, deadline=None)
@given(
    spec=specs,
    vocab=st.integers(4, 40),
    seed=st.integers(0, 10**6),
    past=st.integers(0, 50),
    temp=st.sampled_from([0.0, 1.0]),
    cand=st.sampled_from(["topk", "sample", "sample-unique"]),
)
def test_tree_invariants(spec, vocab, seed, past, temp, cand):
    policy = parse_tree_spec(spec)
    sampled = cand != "topk" and temp > 0
    if sampled and policy.data_dependent:
        cand, sampled = "topk", False  # beam / dynamic rank by score: top-k only
    tree = draft_tree(
        RandomDraft(vocab, seed),
        policy,
        root=1,
        sp=SamplingParams(temp),
        opts=DraftOptions(candidates=cand, rng=torch.Generator().manual_seed(seed)),
    )
    n = tree.n
    assert n <= policy.max_nodes
    assert n == 0 or int(tree.depth.max()) <= policy.depth
    parents = tree.parents.tolist()
    for i in range(n):
        assert parents[i] < i  # level order
        want = ancestors_by_walk(parents, i)
        assert set(tree.anc[i].nonzero().flatten().tolist()) == want
        assert int(tree.depth[i]) == len(want)
    if policy.kind in ("full", "chain"):
        w = min(policy.w, vocab)
        assert n == sum(w**l for l in range(1, policy.depth + 1))
    if policy.kind == "beam":
        for level, width in enumerate(policy.widths, 1):
            assert int((tree.depth == level).sum()) <= width
    # siblings never repeat a token under top-k and sample-unique candidates
    for p in set(parents):
        toks = tree.tokens[tree.parents == p].tolist()
        if cand != "sample" or not sampled:
            assert len(toks) == len(set(toks))
    if sampled:  # every candidate was drawn from a distribution that can give it, kept per node
        assert tree.candidates == cand and tree.q is not None
        assert torch.allclose(tree.q.sum(-1), torch.ones(tree.q.shape[0]), atol=1e-5)
        assert bool((tree.q[tree.qrow, tree.tokens] > 0).all())
        for i in range(n):  # siblings share their parent's row
            assert int(tree.qrow[i]) == int(tree.qrow[parents.index(parents[i])])
    ids, pos, mask = verify_inputs(1, tree, past)
    # the decode loop's preallocated buffers (reused across steps) give the same verify inputs
    vb = VerifyBuffers("cpu")
    vb.fill(1, tree, past + 3)  # a larger call first: once released, the buffers keep none of it
    vb.release()
    ids2, pos2, mask2 = vb.fill(1, tree, past)
    assert torch.equal(ids2, ids) and torch.equal(pos2, pos) and torch.equal(mask2, mask)
    vb.release()
    assert ids.shape == (1, n + 1) and mask.shape == (1, n + 1, past + n + 1)
    assert pos[0, 0] == past and torch.equal(pos[0, 1:], tree.depth + past)
    m = mask[0]
    assert m[:, :past].all()  # everyone sees the cache
    assert m[:, past].all()  # and the root
    assert m[0, past + 1 :].sum() == 0  # the root sees no node
    for i in range(n):
        seen = set((m[i + 1, past + 1 :].nonzero().flatten()).tolist())
        assert seen == ancestors_by_walk(parents, i)
        sib = [j for j in range(n) if parents[j] == parents[i]]
        assert all(pos[0, j + 1] == pos[0, i + 1] for j in sib)


@pytest.mark.parametrize("scale", [1.0, 1 / 0.75, 0.5])
@pytest.mark.parametrize("cand", ["sample", "sample-unique"])
def test_sampled_q_follows_the_drafts_sample_scale(scale, cand):
    """Sampled candidates come from q = softmax(scale * logits / T), per frontier row, with the
    warping after the scale (top-k here); the draft's sample_scale sets the scale."""
    sp = SamplingParams(0.8, 5)
    draft = RandomDraft(12, 3)
    draft.sample_scale = scale
    tree = draft_tree(draft, parse_tree_spec("full:2,2"), 1, sp, DraftOptions(cand, torch.Generator().manual_seed(0)))
    rows = RandomDraft(12, 3)  # the same seed: the same logits, row by row
    root = rows.start(1)[None]
    level2 = rows.expand(None, torch.arange(2))
    want = torch.cat([root, level2]) * scale / 0.8
    kth = want.topk(5, -1).values[:, -1:]
    want = torch.softmax(want.masked_fill(want < kth, float("-inf")), -1)
    assert tree.q.shape == want.shape
    torch.testing.assert_close(tree.q, want, rtol=1e-5, atol=1e-6)


def test_static_tree(tmp_path):
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    f = tmp_path / "t.json"
    f.write_text(json.dumps(paths))
    policy = parse_tree_spec(f"static:{f}")
    tree = draft_tree(RandomDraft(10, 0), policy, 1, SamplingParams(0.0))
    assert tree.n == len(paths)
    assert sorted(tree.depth.tolist()) == sorted(len(p) for p in paths)
    assert tree.draft_calls == 3  # one per level


@pytest.mark.parametrize(
    "bad", ["full:3", "full:a,b", "chain:0", "beam:", "dynamic:1,2", "nope:3", "full", "", "beam:4,-1"]
)
def test_malformed_specs(bad):
    with pytest.raises(TreeSpecError):
        parse_tree_spec(bad)


def test_static_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        parse_tree_spec(f"static:{tmp_path}/missing.json")
    f = tmp_path / "orphan.json"
    f.write_text("[[0], [1, 0]]")
    with pytest.raises(TreeSpecError, match="no parent path"):
        parse_tree_spec(f"static:{f}")
    f.write_text("{not json")
    with pytest.raises(TreeSpecError, match="not valid JSON"):
        parse_tree_spec(f"static:{f}")


def test_lookup_topk_equals_topk_of_its_rows():
    """LookupDraft's direct top-k (no vocabulary-wide row) gives the same values as the top-k of
    its full rows, and candidates with the same counts."""
    from arborspec.runtime.drafts.base import NodeView, topk_of
    from arborspec.runtime.drafts.lookup import LookupDraft

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 6, (80,), generator=g).tolist()
    d = LookupDraft(50, max_ngram=3)
    d.reset(seq)
    for root in range(6):
        full = topk_of(d.start(root)[None], 4, True)
        got = d.start_topk(root, 4, True)
        assert torch.allclose(got.values, full.values, equal_nan=True)
        fin = torch.isfinite(full.values)
        assert set(got.indices[fin].tolist()) == set(full.indices[fin].tolist())
    nodes = NodeView(
        torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([[True, False], [True, True]])
    )
    fr = torch.tensor([0, 1])
    d.start(3)
    assert torch.allclose(d.expand_topk(nodes, fr, 3).values, topk_of(d.expand(nodes, fr), 3).values)


def test_dynamic_with_a_probability_floor_parses_and_refuses_bad_values():
    from arborspec.runtime.errors import TreeSpecError
    from arborspec.runtime.trees import DynamicTree, parse_tree_spec

    pol = parse_tree_spec("dynamic:2,6,8,0.1")
    assert isinstance(pol, DynamicTree) and pol.max_nodes == 8 and pol.depth == 6
    assert pol.select(1, np.log(np.array([[0.5, 0.09]]))).tolist() == [[True, False]]
    assert parse_tree_spec("dynamic:2,6,8").select(1, np.log(np.array([[0.5, 0.09]]))).all()
    for bad in ("dynamic:2,6,8,1.5", "dynamic:2,6,8,x", "dynamic:2,6,0.1"):
        with pytest.raises(TreeSpecError):
            parse_tree_spec(bad)
