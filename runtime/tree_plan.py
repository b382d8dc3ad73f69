"""Tree plans and the call inputs: the flatten step, verify buffers, the chunked prefill.

Role in one decode step: steps 1-3. For policies whose structure never changes (chain, full,
static) with deterministic top-k candidates, a `TreePlan` holds the node layout (parents,
depths, ancestor matrix, which frontier row and rank each node comes from, what is expanded
next), the position offsets and the [T, T] mask block of the verify call, built once per
(policy, vocabulary) and reused every step, as Medusa and TensorRT-LLM do. Per step only the
drafted tokens change.

`MaskBuffer` keeps one preallocated boolean buffer on the engine's device for the verify (or a
draft level's) attention mask [1, T, P+T]. Its invariant is "all True except the current
block", so the cache-prefix columns are never rewritten: each call writes only the block over
the new tokens' columns and puts it back to True afterwards (O(T^2) per step, not O(T*(P+T))).
`VerifyBuffers` adds the input-id and position buffers.

`write_tree` is THE flatten step (2): one tree into one row of a verify call, used by the
decoder (VerifyBuffers.fill), by batched decoding (one row per sequence, `padded_call` frames)
and by `verify_inputs` (compare's feeds). `run_chain` is the one chunked causal chain: the
target's prefill (`causal_prefill`) and the model / EAGLE-3 drafts' start calls run on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kvcache import KVCache
from .trees import TreePolicy

PLANNED_KINDS = ("chain", "full", "static")


@dataclass
class PlanLevel:
    k: int  # candidates per frontier node
    rows: torch.Tensor  # [m] frontier row of each new node
    ranks: torch.Tensor  # [m] candidate rank of each new node
    start: int  # new nodes are [start, end)
    end: int
    frontier: torch.Tensor  # node indices expanded at the next level (one draft call)


class TreePlan:
    """A fixed-shape tree: built by running the policy's selection once, on no scores."""

    def __init__(self, policy: TreePolicy, vocab: int):
        if policy.kind not in PLANNED_KINDS:
            raise ValueError(f"tree policy {policy.kind} has no fixed shape")
        self.spec = policy.spec
        parents: list[int] = []
        depth: list[int] = []
        self.levels: list[PlanLevel] = []
        frontier = [-1]
        for level in range(1, policy.depth + 1):
            k = min(policy.width(level), vocab)
            keep = policy.select(level, np.zeros((len(frontier), k), dtype=np.float32))
            rows, ranks = (torch.from_numpy(a.astype(np.int64)) for a in np.nonzero(keep))
            start = len(parents)
            parents += [frontier[r] for r in rows.tolist()]
            depth += [level] * int(rows.numel())
            end = len(parents)
            expand = policy.expand(level, np.zeros(end - start, dtype=np.float32))
            frontier = [start + int(i) for i in np.nonzero(expand)[0]]
            self.levels.append(PlanLevel(k, rows, ranks, start, end, torch.tensor(frontier, dtype=torch.long)))
            if not frontier:
                break
        n = len(parents)
        self.n = n
        self.parents = torch.tensor(parents, dtype=torch.long)
        self.depth = torch.tensor(depth, dtype=torch.long)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        self.anc = anc
        self.origin = torch.arange(n)
        self.children: list[list[int]] = [[] for _ in range(n + 1)]  # index 0: the root
        for i, p in enumerate(parents):
            self.children[p + 1].append(i)
        self._device_cache: dict = {}

    def verify_block(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(position offsets [T], mask block [T, T]) of the verify call over [root, nodes...],
        on `device`, built once."""
        key = str(device)
        if key not in self._device_cache:
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), self.depth])
            self._device_cache[key] = (offsets.to(device), verify_block(self.anc).to(device))
        return self._device_cache[key]


def plan_for(policy: TreePolicy, vocab: int) -> TreePlan:
    """The policy's plan for this vocabulary size, built on first use and kept on the policy."""
    plans = policy.__dict__.setdefault("_plans", {})
    if vocab not in plans:
        plans[vocab] = TreePlan(policy, vocab)
    return plans[vocab]


def verify_block(anc: torch.Tensor) -> torch.Tensor:
    """[T, T] mask block over [root, nodes...]: every row sees the root, nodes see their
    ancestors and themselves."""
    n = anc.shape[0]
    block = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=anc.device)
    block[:, 0] = True
    block[1:, 1:] = anc
    return block


_CAUSAL: dict = {}


def causal_block(m: int, device="cpu") -> torch.Tensor:
    """A lower-triangular [m, m] bool block, a view of one cached per device (grown by doubling):
    chain and prefill masks copy it instead of building `ones(m, m).tril()` every call (measured
    in the decode loop on 2 busy cores: ~2 ms per tril call between ONNX Runtime calls, vs
    microseconds for the copy)."""
    dev = torch.device(device)
    c = _CAUSAL.get(dev)
    if c is None or c.shape[0] < m:
        n = max(m, 64, 2 * (c.shape[0] if c is not None else 0))
        c = _CAUSAL[dev] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    return c[:m, :m]


class MaskBuffer:
    """A [1, T, P+T] bool mask over a preallocated buffer that is True outside the block."""

    def __init__(self, device, capacity: int = 1 << 16):
        self.device = torch.device(device)
        self.buf = torch.ones(capacity, dtype=torch.bool, device=self.device)
        self._open: tuple[int, int, int] | None = None

    def view(self, t: int, p: int, col0: int | None = None) -> torch.Tensor:
        """The mask [1, T, P+T]; all True, except the block columns [col0, P+T) which the
        caller writes (col0 defaults to P). Call `release()` after the engine call."""
        need = t * (p + t)
        if need > self.buf.numel():
            self.buf = torch.ones(max(need, 2 * self.buf.numel()), dtype=torch.bool, device=self.device)
        col0 = p if col0 is None else col0
        self._open = (t, p, col0)
        return self.buf[:need].view(1, t, p + t)

    def release(self) -> None:
        """Restore the invariant: the block columns of the last view back to True."""
        if self._open is not None:
            t, p, col0 = self._open
            self.buf[: t * (p + t)].view(t, p + t)[:, col0:].fill_(True)
            self._open = None


def run_chain(call, masks: MaskBuffer, n: int, cache, chunk: int):
    """Append a causal chain of `n` entries to a draft's cache as calls of at most `chunk` rows
    (a 4k-token prompt in one call would build a 4k x 4k attention; in chunks each call attends
    CHUNK x P). `call(s, r, mask)` runs entries [s, s + r) at cache.length with the
    [1, r, cache.length + r] mask; the cache grows by r after each call. -> the last call's
    output (the chain's last row is its last row)."""
    out = None
    for s in range(0, n, max(1, int(chunk))):
        q, r = cache.length, min(int(chunk), n - s)
        mask = masks.view(r, q)
        mask[0, :, q:] = causal_block(r, masks.device)
        try:
            out = call(s, r, mask)
        finally:
            masks.release()
        cache.length = q + r
    return out


class VerifyBuffers:
    """Input ids, positions and the mask of the target's verify call, preallocated on the
    target's device and reused every step."""

    def __init__(self, device, max_tokens: int = 1024):
        self.device = torch.device(device)
        self.ids = torch.empty(max_tokens, dtype=torch.long, device=self.device)
        self.pos = torch.empty(max_tokens, dtype=torch.long, device=self.device)
        self.mask = MaskBuffer(self.device)

    def _grow(self, t: int) -> None:
        if t > self.ids.numel():
            self.ids = torch.empty(2 * t, dtype=torch.long, device=self.device)
            self.pos = torch.empty(2 * t, dtype=torch.long, device=self.device)

    def fill(self, root: int, tree, past: int):
        """-> input_ids [1, T], position_ids [1, T], mask [1, T, P+T] for [root, nodes...] of
        `tree` over `past` cached positions (write_tree fills them)."""
        t = tree.n + 1
        self._grow(t)
        ids, pos = self.ids[:t], self.pos[:t]
        mask = self.mask.view(t, past)
        write_tree(ids, pos, mask[0, :, past:], root, tree, past)
        return ids.view(1, t), pos.view(1, t), mask

    def release(self) -> None:
        self.mask.release()


def write_tree(ids: torch.Tensor, pos: torch.Tensor, block: torch.Tensor, root: int, tree, past: int) -> None:
    """THE flatten step (2): [root, nodes...] of `tree` into one row of a verify call, n = tree.n + 1:
    ids[:n] the tokens, pos[:n] past + depth (siblings share a position), block [n, n] the mask
    over the new tokens' columns (every row sees the root, a node its ancestors and itself).
    The cache columns are the caller's (all visible in VerifyBuffers, the row's own length in a
    batch). Used by VerifyBuffers.fill (the decoder), BatchDecoder (one row per sequence) and
    verify_inputs (compare's feeds, tests)."""
    n = tree.n + 1
    ids[0] = root
    if n > 1:
        ids[1:n].copy_(tree.tokens)
    if tree.plan is not None:  # a fixed shape: offsets and block built once, on the device
        offsets, blk = tree.plan.verify_block(ids.device)
        torch.add(offsets, past, out=pos[:n])
        block.copy_(blk)
        return
    pos[0] = past
    block[:, 0] = True
    block[0, 1:] = False
    if n > 1:
        pos[1:n].copy_(tree.depth)
        pos[1:n] += past
        block[1:, 1:].copy_(tree.anc)


def verify_inputs(root: int, tree, past: int, device="cpu"):
    """Fresh input_ids [1, T], position_ids [1, T], mask [1, T, P+T] of the verify call over
    [root, nodes...] (the decoder's own path, VerifyBuffers.fill, copied out of its buffers)."""
    vb = VerifyBuffers(device, tree.n + 1)
    return tuple(x.clone() for x in vb.fill(root, tree, past))


def padded_call(n_rows: int, t: int, p: int):
    """ids / positions / mask of a call of T tokens per row over P cached columns; every row
    starts as padding that sees only itself (callers fill the rows in use)."""
    ids = torch.zeros(n_rows, t, dtype=torch.long)
    pos = torch.zeros(n_rows, t, dtype=torch.long)
    mask = torch.zeros(n_rows, t, p + t, dtype=torch.bool)
    d = torch.arange(t)
    mask[:, d, p + d] = True
    return ids, pos, mask


@dataclass(frozen=True)
class Prefill:
    """How `causal_prefill` runs: calls of at most `chunk` tokens (None or 0: one call), the
    engine's features of the tokens returned or not, a MaskBuffer on the engine's device to
    reuse (None: a new one)."""

    chunk: int | None = 512
    features: bool = False
    masks: MaskBuffer | None = None


def causal_prefill(engine, tokens: list[int], cache: KVCache, how: Prefill = Prefill(), on_logits=None):
    """Append `tokens` to a one-row cache with causal calls of at most `how.chunk` tokens
    (run_chain: the one chunked prefill); -> (the engine's features of those tokens [n, F] with
    `how.features`, else None; calls made). on_logits(s, rows): called after each call with its
    logits [r, V] (row j predicts the token after tokens[s + j])."""
    dev, features = engine.device, how.features
    n = len(tokens)
    chunk = max(1, int(how.chunk or n))
    feats = []

    def call(s, r, mask):
        ids = torch.tensor([tokens[s : s + r]], dtype=torch.long, device=dev)
        pos = torch.arange(cache.length, cache.length + r, device=dev)[None]
        if features:
            logits, f = engine.forward_features(ids, pos, mask, cache)
            feats.append(f[0])
        else:
            logits = engine.forward(ids, pos, mask, cache)
        if on_logits is not None:
            on_logits(s, logits[0])

    run_chain(call, how.masks or MaskBuffer(dev, 1 << 12), n, cache, chunk)
    return (torch.cat(feats) if feats else None), len(range(0, n, chunk))
