"""The draft-source interface: what proposes the tree's candidate tokens.

Role in one decode step: step 1 asks a draft source for the root's distribution (`start`,
one call over the tokens committed since the last step, ending with the root) and then, level
by level, for the frontier's distributions (`expand`, ONE call per level, each frontier node
seeing the committed context, its ancestors and itself); step 5 tells it which path was
accepted (`commit`), so it keeps exactly that path in its own cache. The decode loop
(runtime/decode.py) and the tree builder (runtime/drafts/tree_builder.py) know nothing else
about a draft: a new draft kind implements `DraftSource` and plugs in without touching them.

Also here: `TopK` / `topk_of` (a call's top-k candidates, from runtime/topk.py), `NodeView`
(the nodes drafted so far), `tree_capacity`, `scratch_mask` (a level's mask over a draft's
scratch cache) and the draft -> target vocabulary mapping (`to_target`, `full_vocab`) for
drafts over a reduced vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..topk import TopK, topk_of  # re-exported: the draft sources import them from here
from ..tree_plan import MaskBuffer
from ..trees import Tree, TreePolicy
from .proposed import unwrap


@dataclass
class NodeView:
    """The nodes drafted so far in this step, level order (views, no copies)."""

    tokens: torch.Tensor  # [n] target token ids
    depth: torch.Tensor  # [n] 1 for the root's children
    parents: torch.Tensor  # [n] parent node index, -1 for the root
    anc: torch.Tensor  # bool [n, n]: anc[i, j] = j is i or an ancestor of i


class DraftSource:
    """Base of every draft source. Subclasses override the methods they need.

    vocab_size: width of the logits rows it returns; token_map: [vocab_size] target id of each
    row entry (None: the rows are over the target vocabulary); needs_target_features: the
    decode loop passes the target's features (hidden states) to reset/commit; finite_logits:
    False for tables whose rows may have no candidates (all -inf), so trees are pruned per step
    instead of following a fixed plan; model_s: seconds spent inside model calls (stats);
    sample_scale: sampled candidates are drawn from q = softmax(sample_scale * logits / T), and
    the accept rule reads that same q, so any scale is lossless (1: the draft's own
    distribution; > 1 sharpens an under-confident draft; top-k candidates ignore it)."""

    kind = "draft"
    vocab_size: int = 0
    token_map: torch.Tensor | None = None
    needs_target_features = False
    finite_logits = True
    model_s = 0.0
    sample_scale = 1.0

    def widen(self, policy: TreePolicy) -> TreePolicy:
        """The policy the decoder runs this source under: `policy` itself; a source that proposes
        its own trees (`propose`) returns a ProposingPolicy with room for them
        (runtime/drafts/proposed.py)."""
        return policy

    def propose(self, root: int):
        """The tree this source proposes below `root` as a whole (a proposed.Proposal), for a
        source whose `widen` returns a ProposingPolicy; one per step, before `commit`."""
        raise NotImplementedError

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        """Once per generation, before `reset`: size scratch space for `policy` and a committed
        context of up to `max_len` tokens."""

    def forget(self) -> None:
        """Drop what the source keeps from earlier sequences for a next one that starts the same
        way (the EAGLE-3 head's cache entries), so that the next `reset` starts cold: what a
        caller asks for with prefix_cache=False (a benchmark's cold requests)."""

    def reset(self, committed: list[int], features: torch.Tensor | None = None) -> None:
        """Start a sequence: `committed` are the tokens before the first root; `features` the
        target's features for them (from the prefill) when `needs_target_features`."""

    def start(self, root: int) -> torch.Tensor:
        """The root's draft logits [vocab_size] (one draft call)."""
        raise NotImplementedError

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        """Logits [F, vocab_size] for the frontier node indices (one draft call)."""
        raise NotImplementedError

    # Top-k candidates only (what deterministic trees need): a source whose engine computes
    # them where the logits are (in the graph, on the GPU) overrides these, so the host never
    # touches a vocabulary-wide row.
    def start_topk(self, root: int, k: int, logprobs: bool = False) -> TopK:
        return topk_of(self.start(root)[None], k, logprobs)

    def expand_topk(self, nodes: NodeView, frontier: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
        return topk_of(self.expand(nodes, frontier), k, logprobs)

    def commit(self, tree: Tree, path: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Keep the accepted path (node indices, root excluded); `features` are the verify
        call's target features over [root, nodes...] when `needs_target_features`."""

    def defer(self, root: int, features: torch.Tensor | None = None) -> None:
        """`root` was committed in a step verified without a tree (a batch above its speculation
        limit, runtime/batch_decode.py): stay in step for the next `start`. `features`: the
        target's features of the root row [1, F] when `needs_target_features`. By default the
        root call and an empty commit; sources that queue tokens for their next call override it
        with no call at all (the queue runs as one chain at the next start)."""
        self.start(root)
        self.commit(Tree.empty(), torch.zeros(0, dtype=torch.long), features)

    def batch_driver(self, max_batch: int):
        """A driver that drafts a whole batch with ONE draft call per tree level
        (runtime/drafts/batched.py: `answer(pairs)`, `handle()` per sequence), or None: each
        sequence then drafts through its own `fork()`. Declared per draft kind: a model draft
        whose engine batches trees has one; table drafts (bigram, lookup: no model call), EAGLE-3
        and mixed drafts do not (their forks share the engines)."""
        return None

    def leave(self) -> None:
        """The sequence leaves a batch (a batched draft frees its cache row); nothing by default."""

    def fork(self) -> "DraftSource":
        """A source for another sequence of a batch (runtime/batch_decode.py): the same engines
        and tables, its own per-sequence state. Closing a fork never closes shared engines."""
        raise NotImplementedError(f"draft {self.kind} cannot be batched")

    @property
    def batchable(self) -> bool:
        """Declared by overriding `fork`: whether this source can draft for a batch."""
        return type(self).fork is not DraftSource.fork

    def close(self) -> None:
        """Release engines and buffers."""


def scratch_mask(
    buf: MaskBuffer, anc: torch.Tensor, frontier: np.ndarray, slot_node: np.ndarray, scratch0: int, p: int
) -> torch.Tensor:
    """The mask [1, F, p+F] of a draft level's call over a scratch cache: every row sees the
    committed prefix [0, scratch0) (True in the buffer), the scratch rows [scratch0, p) of its
    ancestors (slot_node: scratch row -> node) and itself. Call `buf.release()` after the call."""
    f, n_slots = int(frontier.size), p - scratch0
    block = np.zeros((f, n_slots + f), dtype=bool)
    if n_slots:
        block[:, :n_slots] = anc.numpy()[frontier[:, None], slot_node[:n_slots]]
    block[:, n_slots:] = np.eye(f, dtype=bool)
    mask = buf.view(f, p, col0=scratch0)
    mask[0, :, scratch0:].copy_(torch.from_numpy(block))
    return mask


class ModelMixDraft(DraftSource):
    """A draft source built over a model draft `base` (mixed with a table draft): the engine and
    the time inside model calls are the base's."""

    base: DraftSource

    @property
    def engine(self):
        return getattr(self.base, "engine", None)

    @property
    def model_s(self) -> float:
        return self.base.model_s


def tree_capacity(policy: TreePolicy, vocab: int) -> int:
    """Upper bound on the nodes a policy drafts in one step, before its final pruning (a
    ProposingPolicy's model part: its proposals are merged after)."""
    policy = unwrap(policy)
    kind = policy.kind
    if kind == "dynamic":
        k = min(policy.k, vocab)
        return k + (policy.depth - 1) * k * k
    if kind == "beam":
        return sum(policy.widths)
    if kind == "static":
        return len(policy.paths)
    w = min(policy.w, vocab)
    return sum(w**lvl for lvl in range(1, policy.depth + 1))


def to_target(toks: torch.Tensor, token_map: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocabulary ids -> target ids (`token_map`: the draft's d2t; None: the same vocabulary)."""
    return toks if token_map is None else token_map[toks]


def full_vocab(q: torch.Tensor, token_map: torch.Tensor | None, out_vocab: int) -> torch.Tensor:
    """A draft distribution over the target vocabulary (zeros outside the draft's)."""
    if token_map is None:
        return q
    full = torch.zeros(q.shape[0], out_vocab, dtype=q.dtype, device=q.device)
    return full.index_copy_(1, token_map.to(q.device), q)
