"""The inputs `arborspec compare` feeds every graph: the runtime's own calls of a decode (a
prefill, a one-token step, one verify per tree policy, and the draft's calls while drafting),
recorded as Polygraphy feed dicts.

Role in one decode step: none; it replays steps 1-3 of real decoding for the comparison.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from arborspec.runtime import contract as C
from arborspec.runtime.backends.base import EngineCapabilities
from arborspec.runtime.errors import InputError

STATIC_PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


# ----------------------------------------------------------------------------- feeds
@dataclass
class Feed:
    name: str
    data: "OrderedDict[str, np.ndarray]"

    @property
    def t(self) -> int:
        return int(self.data[C.INPUT_IDS].shape[1])

    @property
    def p(self) -> int:
        return int(self.data[C.ATTENTION_MASK].shape[2]) - self.t


def _feed(ids, pos, mask, cache, kv_dtype=np.float32) -> "OrderedDict[str, np.ndarray]":
    d = OrderedDict()
    d[C.INPUT_IDS] = np.ascontiguousarray(ids.detach().cpu().numpy().astype(np.int64))
    d[C.POSITION_IDS] = np.ascontiguousarray(pos.detach().cpu().numpy().astype(np.int64))
    d[C.ATTENTION_MASK] = np.ascontiguousarray(mask.detach().cpu().numpy().astype(bool))
    for i in range(cache.spec.n_layers):
        k, v = cache.past(i)  # [P, B, Hkv, D] whatever the cache's layout
        d[C.past_key(i)] = np.ascontiguousarray(k.detach().float().cpu().numpy().astype(kv_dtype))
        d[C.past_value(i)] = np.ascontiguousarray(v.detach().float().cpu().numpy().astype(kv_dtype))
    return d


def _is_kv(name: str, kind: str) -> bool:
    return name.startswith(f"{kind}_key.") or name.startswith(f"{kind}_value.")


def feed_in_layout(feed: dict, layout: str) -> "OrderedDict[str, np.ndarray]":
    """A recorded feed (past K/V [P, B, Hkv, D]) in a graph's own input layout: for "bhsd"
    graphs each past becomes the layer's slab [B, Hkv, P+T, D] holding the past at [0, P)."""
    if layout != "bhsd":
        return feed
    t = feed[C.INPUT_IDS].shape[1]
    out = OrderedDict()
    for name, x in feed.items():
        if _is_kv(name, "past"):
            p, b, h, d = x.shape
            slab = np.zeros((b, h, p + t, d), dtype=x.dtype)
            slab[:, :, :p] = x.transpose(1, 2, 0, 3)
            x = slab
        out[name] = x
    return out


def outputs_in_layout(outputs: dict, feed: dict, layout: str) -> "OrderedDict[str, np.ndarray]":
    """Reference outputs (new K/V [T, B, Hkv, D]) in a graph's own output layout: for "bhsd"
    graphs each new_key/new_value is the layer's whole slab after the call (past + new)."""
    if layout != "bhsd":
        return outputs
    out = OrderedDict()
    for name, x in outputs.items():
        if _is_kv(name, "new"):
            past = feed[name.replace("new_", "past_", 1)]
            x = np.ascontiguousarray(np.concatenate([past, x], axis=0).transpose(1, 2, 0, 3))
        out[name] = x
    return out


class _Recorder:
    """An engine wrapper that records every call's inputs as a contract feed."""

    def __init__(self, engine, kv_dtype=np.float32):
        self.engine, self.info, self.device = engine, engine.info, engine.device
        self.caps = EngineCapabilities()  # plain forward calls only (recorded one by one)
        self.kv_dtype = kv_dtype
        self.label = ""
        self.feeds: list[Feed] = []
        self._seen: set = set()
        self.enabled = True

    def forward(self, ids, pos, mask, cache):
        if self.enabled:
            f = _feed(ids, pos, mask, cache, self.kv_dtype)
            key = (cache.length, f[C.INPUT_IDS].tobytes(), f[C.POSITION_IDS].tobytes(), f[C.ATTENTION_MASK].tobytes())
            if key not in self._seen:  # e.g. the same draft prefill before every policy
                self._seen.add(key)
                self.feeds.append(Feed(f"{self.label} T={ids.shape[1]} P={cache.length}", f))
        return self.engine.forward(ids, pos, mask, cache)


def default_policies(max_tree_nodes: int, static_file: str | os.PathLike | None = None) -> list[str]:
    """Tree specs covering every policy, the largest (dynamic) at max_tree_nodes nodes."""
    m = int(max_tree_nodes)
    specs = [f"chain:{min(4, m)}", "full:2,3", "beam:2,4,4", f"dynamic:8,3,{m}"]
    if static_file is not None:
        specs.insert(3, f"static:{static_file}")
    from arborspec.runtime.trees import parse_tree_spec

    return [s for s in specs if parse_tree_spec(s).max_nodes <= m]


def build_feeds(
    target,
    draft=None,
    *,
    max_tree_nodes: int = 64,
    max_context: int | None = None,
    trees: int = 1,
    seed: int = 0,
    policies: list[str] | None = None,
    kv_dtype=np.float32,
) -> dict[str, list[Feed]]:
    """The feeds the runtime produces, for {"target": [...], "draft": [...]}.

    target: an Engine; draft: an Engine (neural draft: its calls are recorded), a BigramDraft,
    or None (the target itself shapes the trees). `trees` trees per policy, each over a cache
    of P > 0 random past tokens (P differs from tree to tree)."""
    from arborspec.runtime.drafts.bigram import BigramDraft

    if trees < 1:
        raise InputError(f"--trees must be >= 1, got {trees}")
    g = torch.Generator().manual_seed(int(seed))
    limit = min(target.info.max_position, max_context or target.info.max_position)
    rec_t = _Recorder(target, kv_dtype)
    rec_d = None
    if draft is None:
        dsrc_engine = target
    elif isinstance(draft, BigramDraft):
        dsrc_engine = None
    else:
        rec_d = _Recorder(draft, kv_dtype)
        dsrc_engine = rec_d
    with tempfile.TemporaryDirectory(prefix="arborspec-compare-") as tmp:
        pols, biggest = _feed_policies(policies, max_tree_nodes, Path(tmp), trees, limit)
        maker = _TreeFeeds(rec_t, rec_d, draft, dsrc_engine, pols, biggest, seed)
        for i in range(trees):
            maker.record(i, g)
    out = {"target": rec_t.feeds}
    if rec_d is not None:
        out["draft"] = rec_d.feeds
    return out


_FIRST_PAST = 9  # past tokens under the first tree (3 more under each next one)


def _feed_policies(policies, max_tree_nodes: int, tmp: Path, trees: int, limit: int):
    """-> (parsed tree policies, the largest tree's nodes + 1); the static policy's file written
    in `tmp`; the context the feeds need checked against the export's `limit`."""
    from arborspec.runtime.trees import parse_tree_spec

    static = tmp / "static_tree.json"
    static.write_text(json.dumps(STATIC_PATHS))
    specs = policies if policies is not None else default_policies(max_tree_nodes, static)
    pols = [parse_tree_spec(s) for s in specs]
    biggest = max([p.max_nodes for p in pols] + [1]) + 1
    need = _FIRST_PAST + 3 * (trees - 1) + biggest + 2
    if need > limit:
        raise InputError(f"the feeds need a context of {need} positions, the export allows {limit}")
    return pols, biggest


class _TreeFeeds:
    """The recorders and draft source of one build_feeds call; `record(i, g)` adds tree i's feeds."""

    def __init__(self, rec_t, rec_d, draft, dsrc_engine, pols, biggest: int, seed: int):
        self.rec_t, self.rec_d, self.draft, self.dsrc_engine = rec_t, rec_d, draft, dsrc_engine
        self.pols, self.biggest, self.seed = pols, biggest, seed

    def record(self, i: int, g: torch.Generator) -> None:
        """Tree `i`: P random past tokens prefilled (recorded for the first tree only), vanilla's
        one-token step (first tree), then per policy the draft's calls while drafting and the
        target's verify call (recorded, not run)."""
        from arborspec.runtime.kvcache import KVCache
        from arborspec.runtime.tree_plan import Prefill, causal_prefill, verify_inputs
        from arborspec.runtime.trees import Tree

        rec_t = self.rec_t
        target = rec_t.engine
        vocab = target.info.vocab_size
        p = _FIRST_PAST + 3 * i
        past = torch.randint(0, vocab, (p,), generator=g).tolist()
        root = int(torch.randint(0, vocab, (1,), generator=g))
        cap = p + self.biggest + 1
        cache = KVCache(target.info.cache, cap, 1, target.device)
        # prefill: a prompt chain over an empty cache (P = 0)
        rec_t.enabled, rec_t.label = i == 0, "prefill (chain)"
        causal_prefill(rec_t, past, cache, Prefill(chunk=p))
        rec_t.enabled = True
        if i == 0:  # vanilla's step: the root alone over the cache
            rec_t.label = "decode (vanilla)"
            ids, pos, mask = verify_inputs(root, Tree.empty(), p, target.device)
            rec_t.forward(ids, pos, mask, cache)
        for pol in self.pols:
            self._verify_feed(pol, past, root, cache, cap)

    def _verify_feed(self, pol, past: list, root: int, cache, cap: int) -> None:
        """The draft's calls while it drafts a tree of `pol` after `past`, and the target's verify
        call for that tree (recorded only: it need not run here)."""
        from arborspec.runtime.drafts.model import ModelDraft
        from arborspec.runtime.drafts.tree_builder import DraftOptions, draft_tree
        from arborspec.runtime.sampling import SamplingParams
        from arborspec.runtime.tree_plan import verify_inputs

        rec_t, target, p = self.rec_t, self.rec_t.engine, len(past)
        src = self.draft if self.dsrc_engine is None else ModelDraft(self.dsrc_engine, cap)
        src.prepare(pol, cap)
        src.reset(past)
        name = pol.spec if pol.kind != "static" else "static:file"
        if self.rec_d is not None:
            self.rec_d.label = f"draft for {name}"
        prev = rec_t.enabled
        rec_t.enabled = self.dsrc_engine is not target
        tree = draft_tree(src, pol, root, SamplingParams(), DraftOptions(rng=torch.Generator().manual_seed(self.seed)))
        rec_t.enabled = prev
        ids, pos, mask = verify_inputs(root, tree, p, target.device)
        rec_t.label = f"verify {name} ({tree.n} nodes)"
        rec_t.feeds.append(Feed(f"{rec_t.label} T={ids.shape[1]} P={p}", _feed(ids, pos, mask, cache, rec_t.kv_dtype)))


def eagle3_head_feeds(cfg, seed: int = 0) -> list[Feed]:
    """Random tree steps for an EAGLE-3 head (models/eagle3.Eagle3Config `cfg`): target
    features [T, F], token ids, positions, a tree mask over P past draft positions (one past
    column masked out) and the head's one-layer past K/V [P, 1, Hkv, D]."""
    g = torch.Generator().manual_seed(int(seed) + 77)
    feeds = []
    for p, t in ((0, 5), (7, 1), (12, 6)):
        mask = torch.ones(1, t, p + t, dtype=torch.bool)
        mask[0, :, p:] = torch.ones(t, t, dtype=torch.bool).tril()
        if t > 2:  # a tree, not a chain: rows 2.. skip row 1
            mask[0, 2:, p + 1] = False
        if p:
            mask[0, :, p // 2] = False
        data = OrderedDict()
        data[C.INPUT_IDS] = torch.randint(0, cfg.vocab_size, (1, t), generator=g).numpy()
        data[C.TARGET_FEATURES] = torch.randn(t, cfg.feature_size, generator=g).numpy()
        data[C.POSITION_IDS] = (p + torch.arange(t))[None].numpy()
        data[C.ATTENTION_MASK] = mask.numpy()
        shape = (p, 1, cfg.n_kv_heads, cfg.head_dim)
        data[C.past_key(0)] = torch.randn(shape, generator=g).numpy()
        data[C.past_value(0)] = torch.randn(shape, generator=g).numpy()
        feeds.append(Feed(f"eagle3 P={p} T={t}", data))
    return feeds
