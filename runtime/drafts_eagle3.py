"""EAGLE-3 draft source: a one-layer head over the target's own features, reduced vocabulary.

Role in one decode step: step 1 (drafting) and step 5 (commit). Token/feature alignment: the
draft's context entry at position j pairs token x[j+1] with the target's features f[j] (the
hidden states the target computed at position j, where it predicted x[j+1]); a tree node pairs
its token with the draft's own output hidden state of its parent. So

* reset(committed x[0..m-1], features f[0..m-1]) queues entries (x[1], f[0]) .. (x[m-1], f[m-2])
  and keeps f[m-1] for the first root;
* start(root) runs the queued entries and (root, last feature) as one causal chain and returns
  the root entry's logits; its output hidden state feeds the root's children;
* expand runs one call over the frontier: each node's embedding with its parent's output hidden;
* commit(tree, path, features) drops every scratch entry (they were made from draft hidden
  states) and queues the accepted nodes y1..yk with the TARGET features of the verify call that
  accepted them: (y1, f[root]), (y2, f[y1]) .. and keeps f[yk] for the next root. The cache thus
  holds exactly what a fresh draft prefill of the committed tokens and features would.

Candidates come out over the draft vocabulary; `token_map` (d2t) turns them into target ids,
and sampled candidates' q lives on the target vocabulary with zeros outside the draft's.
The head is any object with EAGLE-3's contract forward (models/eagle3.py: `project`,
`token_map`, forward(embeds, hidden, pos, mask, past_k, past_v) -> logits, hidden, new_k,
new_v), run here through torch; `embed` maps target token ids to embeddings.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .drafts import DraftSource, NodeView, scratch_mask, tree_capacity
from .kvcache import CacheSpec, KVCache
from .tree_plan import MaskBuffer
from .trees import Tree, TreePolicy


class Eagle3Draft(DraftSource):
    kind = "eagle3"
    needs_target_features = True

    def __init__(self, head, embed: torch.Tensor, device: str | torch.device = "cpu"):
        c = head.config
        self.head = head.to(device).eval()
        self.embed = embed.to(device)
        self.device = torch.device(device)
        self.vocab_size = c.draft_vocab_size
        self.token_map = head.token_map().cpu()
        self.spec = CacheSpec(1, c.n_kv_heads, c.head_dim, torch.float32)
        self.hidden_size = c.hidden_size
        self.cache: KVCache | None = None
        self.mask = MaskBuffer(self.device, 1 << 12)
        self.model_s = 0.0
        self._tokens: list[int] = []  # queued entries: tokens ...
        self._feats: torch.Tensor | None = None  # ... and their target features [n, F]
        self._last: torch.Tensor | None = None  # the feature the next root pairs with [F]
        self._base = self._chain = 0
        self._slot = np.full(64, -1, dtype=np.int64)
        self._slot_node = np.zeros(64, dtype=np.int64)
        self._node_hidden = torch.zeros(64, c.hidden_size)
        self._root_hidden = torch.zeros(c.hidden_size)

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        cap = tree_capacity(policy, self.vocab_size)
        need = max_len + cap + 2
        if self.cache is None or self.cache.max_len < need:
            self.cache = KVCache(self.spec, need, 1, self.device)
        if self._slot.size < cap:
            self._slot = np.full(cap, -1, dtype=np.int64)
            self._slot_node = np.zeros(cap, dtype=np.int64)
            self._node_hidden = torch.zeros(cap, self.hidden_size)

    def reset(self, committed: list[int], features: torch.Tensor | None = None) -> None:
        self.cache.reset()
        m = len(committed)
        f = features if features is not None else torch.zeros(0, self.head.config.feature_size)
        self._tokens = list(committed[1:])
        self._feats = f[: max(m - 1, 0)].float().cpu()
        self._last = f[m - 1].float().cpu() if m else torch.zeros(self.head.config.feature_size)

    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor):
        t0 = time.perf_counter()
        c = self.cache
        dev = self.device
        logits, out, k, v = self.head(self.embed[tokens.to(dev)][None], hidden.to(dev)[None], pos.to(dev)[None],
                                      mask, *c.past(0))
        c.write_tail(k[None], v[None])
        self.model_s += time.perf_counter() - t0
        return logits[0].cpu(), out[0].cpu()

    @torch.inference_mode()
    def start(self, root: int) -> torch.Tensor:
        feats = torch.cat([self._feats, self._last[None]]) if self._feats is not None else self._last[None]
        tokens = torch.tensor(self._tokens + [int(root)])
        m = int(tokens.numel())
        c = self.cache
        p = c.length
        hidden = self.head.project(feats.to(self.device)).cpu()
        mask = self.mask.view(m, p)
        mask[0, :, p:] = torch.ones(m, m, dtype=torch.bool).tril()
        logits, out = self._run(tokens, hidden, torch.arange(p, p + m), mask)
        self.mask.release()
        self._base, self._chain = p, m
        c.length = p + m
        self._slot.fill(-1)
        self._root_hidden = out[-1]
        self._root_token = int(root)
        return logits[-1]

    @torch.inference_mode()
    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        f = int(frontier.numel())
        c = self.cache
        p = c.length
        scratch0 = self._base + self._chain
        n_slots = p - scratch0
        fr = frontier.numpy()
        mask = scratch_mask(self.mask, nodes.anc, fr, self._slot_node, scratch0, p)
        parents = nodes.parents.numpy()[fr]
        hidden = torch.stack([self._root_hidden if q < 0 else self._node_hidden[q] for q in parents.tolist()])
        pos = nodes.depth[frontier] + (scratch0 - 1)
        logits, out = self._run(nodes.tokens[frontier], hidden, pos, mask)
        self.mask.release()
        self._slot[fr] = np.arange(n_slots, n_slots + f)
        self._slot_node[n_slots:n_slots + f] = fr
        self._node_hidden[torch.from_numpy(fr)] = out
        c.length = p + f
        return logits

    def commit(self, tree: Tree, path: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Keep the chain; queue the accepted nodes with the verify call's target features
        (rows: 0 = the root, i + 1 = node i)."""
        self.cache.length = self._base + self._chain
        feats = features.float().cpu() if features is not None else None
        rows = [0] + [int(i) + 1 for i in path.tolist()]
        self._tokens = tree.tokens[path].tolist() if path.numel() else []
        if feats is None:
            feats = torch.zeros(len(rows), self.head.config.feature_size)
            rows = list(range(len(rows)))
        self._feats = feats[rows[:-1]]
        self._last = feats[rows[-1]]

    def close(self) -> None:
        self.cache = None
