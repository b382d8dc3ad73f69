"""Row-invariant verify layout for ONNX Runtime's GroupQueryAttention (CPU): where each row of a
call goes so that its logits and K/V are bit-identical to vanilla decoding's.

Role in one decode step: the ONNX Runtime engine (backends/ort_layouts.py) passes every target
call through this layout before running it; vanilla steps, prefills and verify calls then all take
the same arithmetic path, so greedy tree == vanilla holds by construction, not by luck.

Measured on ONNX Runtime 1.32's CPU kernel (tools/bench/row_invariance.py; the int8-activation
int4 export turns any last-bit difference into whole logits, the fp32 export shows ~1e-5):

* a one-row call takes another path than a call of two or more rows (the 1-row matrix-vector
  kernels), so a one-row call gets a dummy second row that sees only the cache and itself;
* the attention's sum of exponentials runs in 16 fp32 lanes (MLAS's softmax kernel), so a key's
  contribution depends on its column modulo 16: a node verified g rows after its parent gets
  other logits than the same token decoded right after its parent unless g = 0 (mod 16). So
  each node sits at a row s with P + s = its position (mod 16). Rows come in bands of 16: a
  node at depth d takes row 16 b + d (mod 16) in the lowest free band b at or after its
  parent's (heavier subtrees first); the free rows are dummy rows. A chain needs none; a tree
  whose widest level has w nodes needs about 16 (w - 1) + depth + 1 rows;
* the product of the probabilities with V is cut into chunks of CHUNK = 256 keys (MLAS SGEMM's
  K stride for N = head size 64), so a node also stays in the 256-block of its committed
  position. Where no layout does (a 256 boundary inside the tree's rows) or it does not fit
  the cache, the engine verifies the tree as one chain call per root-to-leaf path instead.

The engine runs the padded call, returns the logits of the node rows in the caller's order and
moves each node's K/V from its slot to P + its index (what the caller expects).
"""

from __future__ import annotations

import torch

LANES = 16
CHUNK = 256


def ancestors(mask: torch.Tensor, p: int) -> torch.Tensor:
    """The new-token block [T, T] of a one-sequence mask [1, T, P+T]."""
    return mask[0, :, p:]


def parents(anc: torch.Tensor) -> torch.Tensor | None:
    """Each node's parent (-1 for a root) when `anc` [T, T] is a tree mask in topological order
    (row j = j's ancestors and itself, each ancestor set a chain), else None."""
    t = anc.shape[0]
    eye = torch.eye(t, dtype=torch.bool, device=anc.device)
    if not bool(anc.diagonal().all()) or bool((anc & ~eye).triu().any()):
        return None
    strict = (anc & ~eye).to(torch.int64)
    idx = torch.arange(t, device=anc.device)
    par = torch.where(strict.any(1), (strict * idx).argmax(1), torch.full_like(idx, -1))
    expect = torch.where((par >= 0)[:, None], anc[par.clamp(min=0)], torch.zeros_like(anc)) | eye
    return par if bool(torch.equal(expect, anc)) else None


def is_chain(pos: torch.Tensor, anc: torch.Tensor, p: int) -> bool:
    """Whether the T new rows are a causal chain at their own positions P..P+T-1 (vanilla's
    one row, a chain's verify): every row then already sits where it commits."""
    t = len(pos)
    if pos.tolist() != list(range(p, p + t)):
        return False
    return bool(torch.equal(anc, torch.ones(t, t, dtype=torch.bool, device=anc.device).tril()))


def slots(pos: torch.Tensor, anc: torch.Tensor, p: int, par: torch.Tensor | None = None) -> list[int] | None:
    """Row of each node (caller order) in the padded call, or None when no layout keeps every
    node's column congruent to its position and inside its CHUNK block. pos: [T] position ids;
    anc: [T, T] bool, row j = j's ancestors and itself (parents before children); par: its
    `parents`, when the caller has them."""
    t = len(pos)
    pos_l = pos.tolist()
    if is_chain(pos, anc, p):
        return list(range(t))  # a causal chain at its own positions: every row is where it commits
    par = parents(anc) if par is None else par
    if par is None:
        return None
    parent = par.tolist()
    heavy = anc.sum(0).tolist()  # 1 + descendants: heavier subtrees take the lower bands
    band = [0] * t
    taken: dict[int, set] = {}  # residue -> bands in use
    out = [0] * t
    for j in sorted(range(t), key=lambda j: (pos_l[j], -heavy[j])):  # parents first
        r = (pos_l[j] - p) % LANES
        b = 0
        if parent[j] >= 0:  # the parent's row must come first
            b = band[parent[j]] + (out[parent[j]] % LANES >= r)
        used = taken.setdefault(r, set())
        while b in used:
            b += 1
        used.add(b)
        band[j], out[j] = b, b * LANES + r
        if (p + out[j]) // CHUNK != pos_l[j] // CHUNK:
            return None
    return out


def padded_call(input_ids, position_ids, mask, p: int, rows: list[int]):
    """The padded call's (ids, positions, mask) [1, R, ...] for node rows `rows` (R = max + 1,
    at least 2): node j at row rows[j] with its mask columns moved with it; the dummy rows see
    the cache and themselves (token 0 at position P)."""
    r = max(max(rows) + 1, 2)
    dev = input_ids.device
    idx = torch.as_tensor(rows, dtype=torch.long, device=dev)
    ids = torch.zeros(1, r, dtype=input_ids.dtype, device=dev)
    ids[0, idx] = input_ids[0]
    pos = torch.full((1, r), p, dtype=position_ids.dtype, device=dev)
    pos[0, idx] = position_ids[0]
    m = torch.zeros(1, r, p + r, dtype=torch.bool, device=dev)
    m[0, :, :p] = True
    m[0, torch.arange(r, device=dev), p + torch.arange(r, device=dev)] = True  # every row sees itself
    new = torch.zeros(len(rows), r, dtype=torch.bool, device=dev)
    new[:, idx] = ancestors(mask, p)
    m[0, idx, p:] = new
    m[0, idx, :p] = mask[0, :, :p]
    return ids, pos, m


def move_kv(cache, p: int, rows: list[int]) -> None:
    """Node j's K/V from column P + rows[j] to P + j (bhsd cache, batch row 0), all layers."""
    t = len(rows)
    if rows == list(range(t)):
        return
    src = torch.as_tensor(rows, dtype=torch.long, device=cache.k.device) + p
    for x in (cache.k, cache.v):
        x[:, :, :, p : p + t] = x.index_select(3, src)


def paths(anc: torch.Tensor) -> list[list[int]]:
    """Root-to-leaf paths (node indices, root first) covering every node of the tree [T, T], in
    depth-first order (consecutive paths share their longest common prefix)."""
    t = anc.shape[0]
    leaf = (anc.sum(0) == 1).tolist()  # an ancestor of nobody but itself
    return sorted(anc[j].nonzero().flatten().tolist() for j in range(t) if leaf[j])


# a call's fixed cost in rows (weights read once per call): c(T) ~ a + b T with a ~ 12-19 b in
# the tune cost curves of SmolLM2 on this CPU (int4 and fp32 exports)
CALL_ROWS = 12


def path_rows(anc: torch.Tensor) -> list[int]:
    """Rows of each chain call when the tree is verified path by path (`paths` order; a path
    carries its nodes below where it leaves the previous one, one-row calls padded to two)."""
    out, prev = [], []
    for path in paths(anc):
        b = next((i for i, (x, y) in enumerate(zip(path, prev)) if x != y), min(len(path), len(prev)))
        out.append(max(len(path) - b, 2))
        prev = path
    return out


def prefer_paths(rows: list[int], anc: torch.Tensor) -> bool:
    """Whether one chain call per path is expected to cost less than the band layout's one call
    (each call costs CALL_ROWS + its rows)."""
    calls = path_rows(anc)
    return CALL_ROWS * len(calls) + sum(calls) < CALL_ROWS + max(rows) + 1


def verify_calls(anc: torch.Tensor) -> list[int]:
    """Rows of the calls the engine makes to verify this tree [T, T] (root first, positions
    P + depth) where no 256-block boundary is near: what a step's verify costs under the layout."""
    t = anc.shape[0]
    depth = anc.sum(1) - 1
    rows = slots(depth, anc, 0)
    if rows is not None and t > 1 and rows == list(range(t)):
        return [t]
    if rows is None or (t > 1 and prefer_paths(rows, anc)):
        return path_rows(anc)
    return [max(max(rows) + 1, 2)]


def row_view(cache, row: int, length: int):
    """Batch row `row` of a bhsd cache as a one-row cache with `length` committed positions,
    sharing its storage (each layer's slab stays contiguous, so an engine binds it by address)."""
    view = object.__new__(type(cache))
    view.spec, view.max_len, view.batch, view.seq_dim = cache.spec, cache.max_len, 1, cache.seq_dim
    view.k, view.v = cache.k.narrow(1, row, 1), cache.v.narrow(1, row, 1)
    view.length = length
    return view
