"""Acceptance measured and simulated: the draft's rank of the target's greedy token at every
position (teacher forcing), per-depth per-rank acceptance, and the exact number of greedy
steps a static-shaped tree would take.

Role in one decode step: none at run time; predicts what steps 1 and 4 accept, for `tune` and
the draft evaluation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from arborspec.runtime.errors import InputError


# ----------------------------------------------------------------------------- acceptance
def draft_topk_ranks(draft, seq: list[int], k: int, chunk: int = 128) -> torch.Tensor:
    """rank[j] (j >= 1) of seq[j] among the draft's top-k given seq[:j] (k when not in it)."""
    from arborspec.runtime.drafts import BigramDraft
    from arborspec.runtime.kvcache import KVCache

    n = len(seq)
    if not isinstance(draft, BigramDraft) and not (hasattr(draft, "forward") and hasattr(draft, "info")):
        raise InputError(
            f"tune measures model and bigram drafts; the {getattr(draft, 'kind', type(draft).__name__)} "
            "draft is not supported (give --tree explicitly)"
        )
    if isinstance(draft, BigramDraft):
        logits = draft._rows(torch.tensor(seq[:-1]))
    else:
        cache = KVCache(draft.info.cache, n, 1, draft.device)
        dev = draft.device
        limit = draft.info.max_tokens or chunk
        step = max(1, min(chunk, limit))
        parts = []
        with torch.inference_mode():
            for a in range(0, n - 1, step):
                b = min(n - 1, a + step)
                t = b - a
                ids = torch.tensor([seq[a:b]], device=dev)
                pos = torch.arange(a, b, device=dev)[None]
                mask = torch.ones(1, t, a + t, dtype=torch.bool)
                mask[0, :, a:] = torch.ones(t, t, dtype=torch.bool).tril()
                parts.append(draft.forward(ids, pos, mask.to(dev), cache)[0].float().cpu())
                cache.length = b
        logits = torch.cat(parts)
    top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices  # [n-1, k]
    nxt = torch.tensor(seq[1:])[:, None]
    hit = top == nxt
    rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full((n - 1,), k))
    return torch.cat([torch.tensor([k]), rank])


def measure_acceptance(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    k: int = 8,
    max_depth: int = 6,
    eos: Sequence[int] = (),
    min_count: int = 8,
    progress=None,
) -> dict:
    """Sequoia's positional acceptance vector, per depth, from greedy decoding of the prompts."""
    from arborspec.runtime.decode import SpeculativeDecoder

    dec = SpeculativeDecoder(target, mode="vanilla")
    hits = [[0] * k for _ in range(max_depth)]
    counts = [0] * max_depth
    it = progress(prompts) if progress else prompts
    for p in it:
        gen = dec.generate(list(p), max_new_tokens, eos).tokens
        seq = list(p) + gen
        if len(gen) < 1:
            continue
        rank = draft_topk_ranks(draft, seq, k).tolist()
        start = len(p)  # the first generated position
        for j in range(start, len(seq)):
            # depth d: the node is seq[j], the step's root seq[j-d]; the d-1 path tokens
            # seq[j-d+1..j-1] must be generated tokens matched within the draft's top-k
            for d in range(1, max_depth + 1):
                counts[d - 1] += 1
                if rank[j] < k:
                    hits[d - 1][rank[j]] += 1
                above = j - d
                if above < start or rank[above] >= k:
                    break
    q = []
    for d in range(max_depth):
        if counts[d] >= min_count or not q:
            c = max(1, counts[d])
            q.append([h / c for h in hits[d]])
        else:
            q.append(list(q[-1]))  # too few samples at this depth: reuse the shallower row
    return {"q": q, "counts": counts, "k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


def tree_children(paths: Sequence[Sequence[int]]) -> dict:
    """{parent path tuple: set of child ranks} of a static tree (the root is ())."""
    kids: dict = {}
    for p in paths:
        kids.setdefault(tuple(p[:-1]), set()).add(p[-1])
    return kids


def simulate_greedy_steps(rank: Sequence[int], start: int, end: int, paths: Sequence[Sequence[int]]) -> int:
    """Verify steps that greedy speculative decoding with this static tree takes to produce
    the target's tokens seq[start:end], given rank[j] = rank of seq[j] among the draft's
    candidates given seq[:j] (from `draft_topk_ranks`).

    Exact for drafts whose candidates depend only on the committed text plus the path (any
    model or table draft with `--candidates topk`): along an accepted path the draft saw
    exactly the target's tokens. `full:D,W` is the static tree of all rank paths < W, depth
    <= D; `chain:K` is [[0], [0,0], ...]."""
    kids = tree_children(paths)
    pos, steps = start, 0
    while pos < end:
        node: tuple = ()
        a = 0
        while pos + a < end and rank[pos + a] in kids.get(node, ()):
            node = node + (rank[pos + a],)
            a += 1
        steps += 1
        pos += a + 1
    return steps


def full_tree_paths(depth: int, width: int) -> list[list[int]]:
    out: list[list[int]] = []
    level = [()]
    for _ in range(depth):
        level = [p + (r,) for p in level for r in range(width)]
        out += [list(p) for p in level]
    return out


def spec_paths(spec: str) -> list[list[int]]:
    """Rank paths of a data-independent tree spec (chain:K, full:D,W, static:FILE)."""
    from arborspec.runtime.trees import ChainTree, FullTree, StaticTree, parse_tree_spec

    pol = parse_tree_spec(spec)
    if isinstance(pol, StaticTree):
        return [list(p) for p in pol.paths]
    if isinstance(pol, (ChainTree, FullTree)):
        return full_tree_paths(pol.depth, pol.w)
    raise InputError(f"tree {spec!r} depends on draft scores: it cannot be simulated, only run")
