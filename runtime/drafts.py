"""Draft sources: what proposes the tree's candidate tokens.

Role in one decode step: step 1 asks a draft source for the root's distribution (`start`,
one call over the tokens committed since the last step, ending with the root) and then, level
by level, for the frontier's distributions (`expand`, ONE call per level, each frontier node
seeing the committed context, its ancestors and itself); step 5 tells it which path was
accepted (`commit`), so it keeps exactly that path in its own cache. The decode loop
(runtime/decode.py) and the tree builder (runtime/drafting.py) know nothing else about a draft:
a new draft kind implements `DraftSource` and plugs in without touching them.

Sources here: `ModelDraft` (any contract engine with the target's vocabulary: a smaller model,
or a `layers:K` truncated copy of the target), `BigramDraft` (the seed's table draft: the
target's own next-token top-k given one token; no cache). `LookupDraft` (prompt lookup) lives
in runtime/lookup.py, `Eagle3Draft` in runtime/drafts_eagle3.py, and `LookupMixDraft` (a model
draft mixed with lookup) in runtime/drafts_mix.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .kvcache import KVCache
from .tree_plan import MaskBuffer, run_chain
from .trees import Tree, TreePolicy


@dataclass
class TopK:
    """A draft call's top-k per row: `values` [F, k] (log-probs when asked for, else raw
    logits), `indices` [F, k] draft-vocabulary ids; computed where the logits are."""

    values: torch.Tensor
    indices: torch.Tensor


def topk_of(logits: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
    """Top-k of logits [F, V] on their device; log-probs (values minus the log-normaliser) when
    `logprobs` (rows with no finite logit keep -inf)."""
    vals, idx = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1)
    if logprobs:
        lse = torch.logsumexp(logits.float(), -1, keepdim=True)
        vals = vals - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return TopK(vals, idx)


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
    instead of following a fixed plan; model_s: seconds spent inside model calls (stats)."""

    kind = "draft"
    vocab_size: int = 0
    token_map: torch.Tensor | None = None
    needs_target_features = False
    finite_logits = True
    model_s = 0.0

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        """Once per generation, before `reset`: size scratch space for `policy` and a committed
        context of up to `max_len` tokens."""

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

    def fork(self) -> "DraftSource":
        """A source for another sequence of a batch (runtime/batch_decode.py): the same engines
        and tables, its own per-sequence state. Closing a fork never closes shared engines."""
        raise NotImplementedError(f"draft {self.kind} cannot be batched")

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


def tree_capacity(policy: TreePolicy, vocab: int) -> int:
    """Upper bound on the nodes a policy drafts in one step, before its final pruning."""
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


class ModelDraft(DraftSource):
    """A neural draft behind the engine protocol, with its own preallocated cache.

    Cache layout: committed tokens [0, base), then this step's chain (the pending tokens and
    the root) [base, base + chain), then one scratch row per expanded node. Node -> scratch row
    bookkeeping lives here (`_slot`), keyed by the node's drafted index (`Tree.origin`)."""

    kind = "model"
    PREFILL_CHUNK = 512  # entries per call when the chain is long (the prompt at the first step)

    def __init__(self, engine, max_len: int | None = None):
        self.engine = engine
        self.vocab_size = engine.info.vocab_size
        self.cache = KVCache(engine.info.cache, max_len, 1, engine.device) if max_len else None
        self.mask = MaskBuffer(engine.device, 1 << 12)
        self._sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
        self.pending: list[int] = []
        self._base = 0  # committed length before this step's chain
        self._chain = 0  # tokens of the first call (pending + root)
        # node -> scratch row and scratch row -> node (numpy: tiny arrays, cheap ops)
        self._slot = np.full(64, -1, dtype=np.int64)
        self._slot_node = np.zeros(64, dtype=np.int64)
        self.model_s = 0.0
        self._owns_engine = True

    def fork(self) -> "ModelDraft":
        f = ModelDraft(self.engine)
        f._owns_engine = False
        return f

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        cap = tree_capacity(policy, self.vocab_size)
        need = max_len + cap + 2
        if self.cache is None or self.cache.max_len < need:
            self.cache = KVCache(self.engine.info.cache, need, 1, self.engine.device)
        if self._slot.size < cap:
            self._slot = np.full(cap, -1, dtype=np.int64)
            self._slot_node = np.zeros(cap, dtype=np.int64)

    def reset(self, committed: list[int], features=None) -> None:
        if self.cache is None:
            raise RuntimeError("ModelDraft.prepare() must run before reset()")  # a caller bug
        self.cache.reset()
        self.pending = list(committed)

    def _forward(self, ids, pos, mask, k: int | None = None, logprobs: bool = False):
        t0 = time.perf_counter()
        if k is None:
            out = self.engine.forward(ids, pos, mask, self.cache)
        else:
            out = TopK(*self.engine.forward_topk(ids, pos, mask, self.cache, k, logprobs))
        if self._sync:
            self._sync()
        self.model_s += time.perf_counter() - t0
        return out

    def _start(self, root: int, k: int | None = None, logprobs: bool = False):
        """Run the pending tokens and the root as a causal chain (in chunks of PREFILL_CHUNK
        when it is long: the prompt); the root's row of the output."""
        chain = self.pending + [root]
        m = len(chain)
        c = self.cache
        p = c.length
        dev = self.engine.device

        def call(s, r, mask):
            ids = torch.tensor([chain[s : s + r]], dtype=torch.long, device=dev)
            pos = torch.arange(c.length, c.length + r, device=dev)[None]
            return self._forward(ids, pos, mask, k, logprobs)

        out = run_chain(call, self.mask, m, c, self.PREFILL_CHUNK)
        self._base, self._chain = p, m  # c.length is p + m
        self._slot.fill(-1)
        if k is None:
            return out[0, -1]
        return TopK(out.values[0, -1:], out.indices[0, -1:])

    def _expand(self, nodes: NodeView, frontier: torch.Tensor, k: int | None = None, logprobs: bool = False):
        f = int(frontier.numel())
        c = self.cache
        p = c.length
        dev = self.engine.device
        scratch0 = self._base + self._chain
        n_slots = p - scratch0
        fr = frontier.numpy()
        mask = scratch_mask(self.mask, nodes.anc, fr, self._slot_node, scratch0, p)
        ids = torch.from_numpy(nodes.tokens.numpy()[fr][None]).to(dev)
        pos = torch.from_numpy(nodes.depth.numpy()[fr][None] + (scratch0 - 1)).to(dev)
        out = self._forward(ids, pos, mask, k, logprobs)
        self.mask.release()
        self._slot[fr] = np.arange(n_slots, n_slots + f)
        self._slot_node[n_slots : n_slots + f] = fr
        c.length = p + f
        return out[0] if k is None else TopK(out.values[0], out.indices[0])

    def start(self, root: int) -> torch.Tensor:
        return self._start(root)

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        return self._expand(nodes, frontier)

    def _fused(self, k: int) -> bool:
        """Whether the engine returns its own top-k (fused in the graph, or on its device)."""
        return getattr(self.engine, "max_topk", 0) >= k and hasattr(self.engine, "forward_topk")

    def start_topk(self, root: int, k: int, logprobs: bool = False) -> TopK:
        if not self._fused(k):
            return super().start_topk(root, k, logprobs)
        return self._start(root, k, logprobs)

    def expand_topk(self, nodes: NodeView, frontier: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
        if not self._fused(k):
            return super().expand_topk(nodes, frontier, k, logprobs)
        return self._expand(nodes, frontier, k, logprobs)

    def commit(self, tree: Tree, path: torch.Tensor, features=None) -> None:
        """Keep the chain and the accepted path's scratch rows; drop the rest."""
        c = self.cache
        c.length = self._base
        if path.numel():
            pth = path.numpy()
            slots = self._slot[tree.origin.numpy()[pth]]
            ran = slots >= 0
            src = list(range(self._chain)) + (slots[ran] + self._chain).tolist()
            # accepted nodes never run through the draft (leaves) are run at the next start
            self.pending = tree.tokens.numpy()[pth[~ran]].tolist()
        else:
            src, self.pending = list(range(self._chain)), []
        c.commit(src, 0)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close and self._owns_engine:
            close()
        self.cache = None


class BigramDraft(DraftSource):
    """The seed's table draft: next-token logits given only the previous token.

    `table` is either dense logits [V, V] or a sparse (indices [V, K], logits [V, K]) top-K;
    missing entries are -inf. Cost per level: a gather, no model call."""

    kind = "bigram"
    finite_logits = False

    def __init__(self, indices: torch.Tensor | None, logits: torch.Tensor, vocab_size: int):
        self.vocab_size = vocab_size
        self.indices, self.logits = indices, logits.float()

    def _rows(self, toks: torch.Tensor) -> torch.Tensor:
        if self.indices is None:
            return self.logits[toks]
        out = torch.full((toks.numel(), self.vocab_size), float("-inf"))
        return out.scatter_(1, self.indices[toks], self.logits[toks])

    def fork(self) -> "BigramDraft":
        return self  # stateless

    def start(self, root: int) -> torch.Tensor:
        return self._rows(torch.tensor([root]))[0]

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        return self._rows(nodes.tokens[frontier])


@torch.inference_mode()
def bigram_table_from_target(engine, top_k: int = 32, batch: int = 256, progress=None):
    """Derive the bigram table from the target itself: for every token v, the target's
    next-token logits given the one-token context [v] (position 0). Returns (indices [V, K],
    logits [V, K]) float32, or dense (None, logits [V, V]) when V <= top_k."""
    v = engine.info.vocab_size
    k = min(top_k, v)
    idx_out = torch.empty(v, k, dtype=torch.long)
    val_out = torch.empty(v, k, dtype=torch.float32)
    starts = range(0, v, batch)
    for s in progress(starts) if progress else starts:
        toks = torch.arange(s, min(s + batch, v))
        b = toks.numel()
        cache = KVCache(engine.info.cache, 1, b, engine.device)
        dev = engine.device
        logits = (
            engine.forward(
                toks[:, None].to(dev),
                torch.zeros(b, 1, dtype=torch.long, device=dev),
                torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
                cache,
            )[:, 0]
            .float()
            .cpu()
        )
        top = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
        idx_out[s : s + b], val_out[s : s + b] = top.indices, top.values
    if k == v:
        dense = torch.full((v, v), float("-inf"))
        return None, dense.scatter_(1, idx_out, val_out)
    return idx_out, val_out


def save_bigram_table(path, indices: torch.Tensor | None, logits: torch.Tensor, vocab_size: int) -> None:
    """Write a bigram table (the format `load_bigram_table` reads), atomically."""
    from safetensors.torch import save

    from .fileio import atomic_write_bytes

    tensors = {"logits": logits.contiguous()}
    if indices is not None:
        tensors["indices"] = indices.contiguous()
    atomic_write_bytes(path, save(tensors, metadata={"vocab_size": str(vocab_size), "top_k": str(logits.shape[1])}))


def load_bigram_table(path) -> BigramDraft:
    """A BigramDraft from an exported table file (safetensors: `logits`, optional `indices`)."""
    from safetensors import safe_open

    from .errors import ExportDirError

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            logits = f.get_tensor("logits")
            indices = f.get_tensor("indices") if "indices" in f.keys() else None
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ExportDirError(
            f"{path}: not a readable bigram table ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    vocab = int(meta.get("vocab_size", logits.shape[-1]))
    return BigramDraft(indices, logits, vocab)


def __getattr__(name):  # older import paths
    if name == "LookupDraft":
        from .lookup import LookupDraft

        return LookupDraft
    if name in ("draft_tree", "CANDIDATE_MODES"):
        from . import drafting

        return getattr(drafting, name)
    raise AttributeError(name)
