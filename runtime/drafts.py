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
in runtime/lookup.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .kvcache import KVCache
from .tree_plan import MaskBuffer
from .trees import Tree, TreePolicy


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

    def commit(self, tree: Tree, path: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Keep the accepted path (node indices, root excluded); `features` are the verify
        call's target features over [root, nodes...] when `needs_target_features`."""

    def close(self) -> None:
        """Release engines and buffers."""


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
    return sum(w ** lvl for lvl in range(1, policy.depth + 1))


class ModelDraft(DraftSource):
    """A neural draft behind the engine protocol, with its own preallocated cache.

    Cache layout: committed tokens [0, base), then this step's chain (the pending tokens and
    the root) [base, base + chain), then one scratch row per expanded node. Node -> scratch row
    bookkeeping lives here (`_slot`), keyed by the node's drafted index (`Tree.origin`)."""

    kind = "model"

    def __init__(self, engine, max_len: int | None = None):
        self.engine = engine
        self.vocab_size = engine.info.vocab_size
        self.cache = KVCache(engine.info.cache, max_len, 1, engine.device) if max_len else None
        self.mask = MaskBuffer(engine.device, 1 << 12)
        self._sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
        self.pending: list[int] = []
        self._base = 0  # committed length before this step's chain
        self._chain = 0  # tokens of the first call (pending + root)
        self._slot = torch.full((64,), -1, dtype=torch.long)  # node -> scratch row
        self._slot_node = torch.zeros(64, dtype=torch.long)  # scratch row -> node
        self._eye: dict[int, torch.Tensor] = {}
        self.model_s = 0.0

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        cap = tree_capacity(policy, self.vocab_size)
        need = max_len + cap + 2
        if self.cache is None or self.cache.max_len < need:
            self.cache = KVCache(self.engine.info.cache, need, 1, self.engine.device)
        if self._slot.numel() < cap:
            self._slot = torch.full((cap,), -1, dtype=torch.long)
            self._slot_node = torch.zeros(cap, dtype=torch.long)

    def reset(self, committed: list[int], features=None) -> None:
        if self.cache is None:
            raise RuntimeError("ModelDraft.prepare() must run before reset()")  # a caller bug
        self.cache.reset()
        self.pending = list(committed)

    def _forward(self, ids, pos, mask):
        t0 = time.perf_counter()
        out = self.engine.forward(ids, pos, mask, self.cache)
        if self._sync:
            self._sync()
        self.model_s += time.perf_counter() - t0
        return out

    def start(self, root: int) -> torch.Tensor:
        """Run the pending tokens and the root as a causal chain; return the root's logits."""
        chain = self.pending + [root]
        m = len(chain)
        c = self.cache
        p = c.length
        dev = self.engine.device
        ids = torch.tensor([chain], dtype=torch.long, device=dev)
        pos = torch.arange(p, p + m, device=dev)[None]
        mask = self.mask.view(m, p)
        mask[0, :, p:] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        logits = self._forward(ids, pos, mask)
        self.mask.release()
        self._base, self._chain = p, m
        c.length = p + m
        self._slot.fill_(-1)
        return logits[0, -1]

    def _eye_block(self, f: int) -> torch.Tensor:
        e = self._eye.get(f)
        if e is None:
            e = self._eye[f] = torch.eye(f, dtype=torch.bool, device=self.engine.device)
        return e

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        f = int(frontier.numel())
        c = self.cache
        p = c.length
        dev = self.engine.device
        scratch0 = self._base + self._chain
        n_slots = p - scratch0
        mask = self.mask.view(f, p, col0=scratch0)
        block = mask[0, :, scratch0:]
        if n_slots:
            block[:, :n_slots].copy_(nodes.anc[frontier][:, self._slot_node[:n_slots]])
        block[:, n_slots:].copy_(self._eye_block(f))
        ids = nodes.tokens[frontier][None].to(dev)
        pos = (nodes.depth[frontier] + (scratch0 - 1))[None].to(dev)
        logits = self._forward(ids, pos, mask)
        self.mask.release()
        self._slot[frontier] = torch.arange(n_slots, n_slots + f)
        self._slot_node[n_slots:n_slots + f] = frontier
        c.length = p + f
        return logits[0]

    def commit(self, tree: Tree, path: torch.Tensor, features=None) -> None:
        """Keep the chain and the accepted path's scratch rows; drop the rest."""
        c = self.cache
        c.length = self._base
        if path.numel():
            slots = self._slot[tree.origin[path]]
            ran = slots >= 0
            src = list(range(self._chain)) + (slots[ran] + self._chain).tolist()
            # accepted nodes never run through the draft (leaves) are run at the next start
            self.pending = tree.tokens[path[~ran]].tolist()
        else:
            src, self.pending = list(range(self._chain)), []
        c.commit(src, 0)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close:
            close()


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
    for s in (progress(starts) if progress else starts):
        toks = torch.arange(s, min(s + batch, v))
        b = toks.numel()
        cache = KVCache(engine.info.cache, 1, b, engine.device)
        dev = engine.device
        logits = engine.forward(toks[:, None].to(dev), torch.zeros(b, 1, dtype=torch.long, device=dev),
                                torch.ones(b, 1, 1, dtype=torch.bool, device=dev), cache)[:, 0].float().cpu()
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
    atomic_write_bytes(path, save(tensors, metadata={"vocab_size": str(vocab_size),
                                                     "top_k": str(logits.shape[1])}))


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
        raise ExportDirError(f"{path}: not a readable bigram table ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
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
