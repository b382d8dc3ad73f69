"""Acceptance measured and simulated: the draft's rank of the target's token at every
position (teacher forcing), per-depth per-rank acceptance, and the exact number of steps a
static-shaped tree would take, on greedy text or on text sampled at the temperature decoding
will use.

Role in one decode step: none at run time; predicts what steps 1 and 4 accept, for `tune` and
the draft evaluation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from arborspec.runtime.errors import InputError


# ----------------------------------------------------------------------------- acceptance
def causal_chunks(n: int, step: int):
    """(a, b, mask [1, b-a, b]) for a causal pass over positions 0..n-1 in calls of `step`
    rows, each over the cache the earlier calls filled."""
    for a in range(0, n, step):
        b = min(n, a + step)
        mask = torch.ones(1, b - a, b, dtype=torch.bool)
        mask[0, :, a:] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        yield a, b, mask


def draft_topk_ranks(draft, seq: list[int], k: int, chunk: int = 128) -> torch.Tensor:
    """rank[j] (j >= 1) of seq[j] among the draft's top-k given seq[:j] (k when not in it)."""
    from arborspec.runtime.drafts.bigram import BigramDraft
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
            for a, b, mask in causal_chunks(n - 1, step):
                ids = torch.tensor([seq[a:b]], device=dev)
                pos = torch.arange(a, b, device=dev)[None]
                parts.append(draft.forward(ids, pos, mask.to(dev), cache)[0].float().cpu())
                cache.length = b
        logits = torch.cat(parts)
    top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices  # [n-1, k]
    nxt = torch.tensor(seq[1:])[:, None]
    hit = top == nxt
    rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full((n - 1,), k))
    return torch.cat([torch.tensor([k]), rank])


@torch.inference_mode()
def target_features(target, seq: list[int], chunk: int = 128) -> torch.Tensor:
    """The target's features [n, F] for every position of `seq`: one causal pass, in calls of
    at most `chunk` tokens (and the engine's own limit), on the CPU."""
    from arborspec.runtime.kvcache import KVCache

    n = len(seq)
    dev = target.device
    cache = KVCache(target.info.cache, n, 1, dev)
    step = max(1, min(chunk, target.info.max_tokens or chunk))
    parts = []
    for a, b, mask in causal_chunks(n, step):
        ids, pos = torch.tensor([seq[a:b]], device=dev), torch.arange(a, b, device=dev)[None]
        parts.append(target.forward_features(ids, pos, mask.to(dev), cache)[1][0].float().cpu())
        cache.length = b
    return torch.cat(parts)


@torch.inference_mode()
def eagle3_depth_ranks(
    target, draft, seq: list[int], k: int, max_depth: int, chunk: int = 128, block: int = 256, start: int | None = None
) -> torch.Tensor:
    """[max_depth, n] ranks for an EAGLE-3 draft: ranks[d-1, j] is the rank of seq[j] among the
    draft's top-k target ids at depth d of a step rooted at seq[j-d] whose path is the true
    tokens seq[j-d+1..j-1], the head reading the target's features at depth 1 and its own
    hidden states below, as in decoding (k: not in the top-k, or no such step). One target
    pass for the features, then head calls over many positions at once: depth 1 causal over the
    whole context (in chunks), then per block of rows one call per depth, whose rows attend to
    the depth-1 rows up to their own position and to their own chain's rows (the cache holds
    the context plus (max_depth - 1) blocks, whatever the length). `start` (the prompt's length)
    with a draft whose `context` limits the prompt entries it reads: the entries decoding drops
    are masked out here too (RoPE attention: the same distances, so the same ranks)."""
    from arborspec.runtime.kvcache import KVCache

    n = len(seq)
    ranks = torch.full((max_depth, n), k, dtype=torch.long)
    m = n - 2  # head entries i = 0..m-1 pair seq[i+1] with the features f[i]; depth 1 predicts seq[i+2]
    if m < 1:
        return ranks
    feats = target_features(target, seq, chunk)
    head = draft.engine
    dev = head.device
    hid0 = head.project(feats[:m]).float().cpu()  # [m, H]
    ctx = getattr(draft, "context", None)
    # decoding prefills the prompt but its last token (the first root): it queues entries
    # 0 .. start - 3 and keeps the last `context` of them
    s0 = max(0, start - 2 - ctx) if ctx is not None and start is not None else 0
    seen = torch.arange(m) >= s0  # the entries a row past s0 may attend to
    ids_all = torch.tensor(seq + [0] * (max_depth + 2))  # padded: rows past the end are ignored
    tmap = draft.token_map
    cache = KVCache(head.info.cache, m + (max_depth - 1) * block + 1, 1, dev)
    # the rows of a block's chains leave gaps that the mask hides; zeros there, not whatever the
    # allocator left (a masked NaN still poisons the attention's weighted sum)
    cache.k.zero_()
    cache.v.zero_()

    def call(i, d, hidden, length, mask):
        cache.length = length
        logits, out = head.forward_hidden(
            ids_all[i + 1 + d][None].to(dev), hidden[None].to(dev), (i + d)[None].to(dev), mask[None].to(dev), cache
        )
        top = tmap[torch.topk(logits[0].float().cpu(), min(k, logits.shape[-1]), -1).indices]  # [t, k] target ids
        hit = top == ids_all[i + 2 + d][:, None]
        ok = i + 2 + d < n
        ranks[d, (i + 2 + d)[ok]] = torch.where(hit.any(-1), hit.float().argmax(-1).long(), torch.full((len(i),), k))[
            ok
        ]
        return out[0].float().cpu()

    # depth 1: the committed context itself, causal, in chunks; its rows stay in the cache at [0, m)
    out0 = []
    for a, b, mask in causal_chunks(m, chunk):
        i = torch.arange(a, b)
        if s0:
            mask[0, i >= s0, :b] &= seen[:b]
        out0.append(call(i, 0, hid0[i], a, mask[0]))
    out0 = torch.cat(out0)
    # depths 2..: per block of rows, each row's chain at m + (e-1)*block + row
    for a in range(0, m, block):
        i = torch.arange(a, min(m, a + block))
        r = i - a
        hidden = out0[i]
        for d in range(1, max_depth):
            if a + 2 + d >= n:
                break
            length = m + (d - 1) * block
            mask = torch.zeros(len(i), length + len(i), dtype=torch.bool)
            mask[:, :m] = (torch.arange(m)[None, :] <= i[:, None]) & (seen[None, :] | (i[:, None] < s0))
            for e in range(1, d + 1):
                mask[r, m + (e - 1) * block + r] = True
            hidden = call(i, d, hidden, length, mask)
    return ranks


@torch.inference_mode()
def source_depth_ranks(target, draft, seq: list[int], start: int, k: int, max_depth: int) -> torch.Tensor:
    """[max_depth, n] ranks for ANY draft source, through the draft-source interface itself
    (reset / start_topk / expand_topk / commit, as decoding calls them): for every root
    position r >= start - 1, the rank of seq[r+d] among the top-k target ids at depth d of a
    chain of the true tokens seq[r+1..r+d-1] (k: not in the top-k, or no such step). A chain
    stops at the first miss (deeper ranks cannot be accepted), and each root is committed with
    no path, so the source's state after root r is the state decoding has there. Exact for
    sources whose candidates depend on the path (lookup, a mixed draft); one draft call per
    depth per position, so it is for calibration-sized runs (a few hundred positions)."""
    from arborspec.runtime.drafts.base import NodeView, to_target
    from arborspec.runtime.trees import ChainTree, Tree

    n = len(seq)
    ranks = torch.full((max_depth, n), k, dtype=torch.long)
    feats = target_features(target, seq) if getattr(draft, "needs_target_features", False) else None
    tmap = draft.token_map
    tril = torch.ones(max_depth, max_depth, dtype=torch.bool).tril()
    none = torch.zeros(0, dtype=torch.long)
    draft.prepare(ChainTree(max_depth), n + max_depth + 2)
    draft.reset(seq[: start - 1], feats[: start - 1] if feats is not None else None)
    for r in range(start - 1, n - 1):
        out = draft.start_topk(seq[r], k)
        for d in range(1, max_depth + 1):
            j = r + d
            hit = (to_target(out.indices[-1], tmap) == seq[j]).nonzero()
            ranks[d - 1, j] = int(hit[0, 0]) if hit.numel() else k
            if not hit.numel() or d == max_depth or j + 1 >= n:
                break
            toks = torch.tensor(seq[r + 1 : j + 1])
            nodes = NodeView(toks, torch.arange(1, d + 1), torch.arange(-1, d - 1), tril[:d, :d])
            out = draft.expand_topk(nodes, torch.tensor([d - 1]), k)
        root_only = Tree.empty()
        draft.commit(root_only, none, feats[r : r + 1] if feats is not None else None)
    return ranks


def _count_ranks(rank_at, start: int, end: int, k: int, hits: list, counts: list) -> None:
    """Add one text's positions start..end-1 (the generated ones) to the per-depth counts and
    per-rank hits, for every depth their path allows."""
    max_depth = len(counts)
    for j in range(start, end):
        # depth d: the node is seq[j], the step's root seq[j-d]; the d-1 path tokens
        # seq[j-d+1..j-1] must be generated tokens, each matched within the draft's top-k
        # at its own depth
        for d in range(1, max_depth + 1):
            r = j - d
            if r < start - 1 or any(rank_at(r + m, m) >= k for m in range(1, d)):
                break
            counts[d - 1] += 1
            if rank_at(j, d) < k:
                hits[d - 1][rank_at(j, d)] += 1


def _acceptance_vector(hits: list, counts: list, min_count: int) -> list[list[float]]:
    """q[d][r] = hits / count at depth d; a depth with fewer than min_count samples reuses the
    shallower row."""
    q = []
    for d in range(len(counts)):
        if counts[d] >= min_count or not q:
            c = max(1, counts[d])
            q.append([h / c for h in hits[d]])
        else:
            q.append(list(q[-1]))  # too few samples at this depth: reuse the shallower row
    return q


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
    sampling=None,
    seed: int = 0,
) -> dict:
    """Sequoia's positional acceptance vector, per depth, from vanilla decoding of the prompts:
    greedy, or sampled with `sampling` (a SamplingParams with temperature > 0; prompt i drawn
    with seed + i). Sampled, the same counts measure the sampled accept rule of static trees
    (`topk` candidates, runtime/accept.py): at a node whose target distribution is p, that rule
    moves to the child holding token x with probability exactly p(x), which is the probability
    that the sampled text's next token is x. So q[d][r] estimates P(the rank-r child is accepted
    at depth d), and replaying the loop over the sampled text (`simulated_tokens_per_step`) is
    the sampled decoding's tokens per step, in distribution.
    `runs` (not JSON: tune drops it) keeps each prompt's ranks for `simulated_tokens_per_step`."""
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.drafts.bigram import BigramDraft

    sampled = sampling is not None and not sampling.greedy
    dec = SpeculativeDecoder(target, mode="vanilla", sampling=sampling if sampled else None)
    # fast paths: an EAGLE-3 head (many positions per head call), a model engine or a bigram
    # table (one causal pass); anything else goes through the draft-source interface
    eagle3 = getattr(draft, "needs_target_features", False) and getattr(draft, "lookup", None) is None
    text_model = isinstance(draft, BigramDraft) or (hasattr(draft, "forward") and hasattr(draft, "info"))
    generic = not (eagle3 or text_model)
    hits = [[0] * k for _ in range(max_depth)]
    counts = [0] * max_depth
    runs = []
    it = progress(prompts) if progress else prompts
    for i, p in enumerate(it):
        gen = dec.generate(list(p), max_new_tokens, eos, seed=seed + i).tokens
        seq = list(p) + gen
        if len(gen) < 1:
            continue
        if generic:  # lookup, a mixed draft, any other source: ranks depend on the path
            by_depth = source_depth_ranks(target, draft, seq, len(p), k, max_depth).tolist()
            rank_at = lambda j, d: by_depth[d - 1][j]  # noqa: E731
            runs.append({"by_depth": by_depth, "start": len(p), "end": len(seq)})
        elif getattr(draft, "needs_target_features", False):  # EAGLE-3: ranks depend on the depth
            by_depth = eagle3_depth_ranks(target, draft, seq, k, max_depth, start=len(p)).tolist()
            rank_at = lambda j, d: by_depth[d - 1][j]  # noqa: E731
            runs.append({"by_depth": by_depth, "start": len(p), "end": len(seq)})
        else:  # the draft sees only text: a token's rank is the same at every depth
            rank = draft_topk_ranks(draft, seq, k).tolist()
            rank_at = lambda j, d: rank[j]  # noqa: E731
            runs.append({"rank": rank, "start": len(p), "end": len(seq)})
        _count_ranks(rank_at, len(p), len(seq), k, hits, counts)
    return {
        "q": _acceptance_vector(hits, counts, min_count),
        "counts": counts,
        "k": k,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "text": "sampled" if sampled else "greedy",
        "runs": runs,
    }


def tree_children(paths: Sequence[Sequence[int]]) -> dict:
    """{parent path tuple: set of child ranks} of a static tree (the root is ())."""
    kids: dict = {}
    for p in paths:
        kids.setdefault(tuple(p[:-1]), set()).add(p[-1])
    return kids


def simulate_greedy_steps(rank, start: int, end: int, paths: Sequence[Sequence[int]], by_depth=None) -> int:
    """Verify steps that greedy speculative decoding with this static tree takes to produce
    the target's tokens seq[start:end], given rank[j] = rank of seq[j] among the draft's
    candidates given seq[:j] (from `draft_topk_ranks`), or by_depth[d-1][j] = its rank when
    drafted at depth d (EAGLE-3: the head's own hidden states below the first level, from
    `eagle3_depth_ranks`; then `rank` is ignored).

    Exact for drafts whose candidates depend only on the committed text plus the path (any
    model or table draft with `--candidates topk`, and EAGLE-3 up to near-ties of its float
    sums): along an accepted path the draft saw exactly the target's tokens. `full:D,W` is the
    static tree of all rank paths < W, depth <= D; `chain:K` is [[0], [0,0], ...]."""
    kids = tree_children(paths)
    if by_depth is not None:
        rank_at = lambda j, d: by_depth[d - 1][j] if d <= len(by_depth) else -1  # noqa: E731
    else:
        rank_at = lambda j, d: rank[j]  # noqa: E731
    pos, steps = start, 0
    while pos < end:
        node: tuple = ()
        a = 0
        while pos + a < end and rank_at(pos + a, a + 1) in kids.get(node, ()):
            node = node + (rank_at(pos + a, a + 1),)
            a += 1
        steps += 1
        pos += a + 1
    return steps


def simulated_tokens_per_step(runs, paths: Sequence[Sequence[int]]) -> float:
    """Tokens per verify step of greedy decoding with this static tree over `measure_acceptance`'s
    runs: the loop itself replayed, so what the independence model behind `q` leaves out (a
    draft that just failed tends to fail again: the step after a rejection starts on a harder
    token) is in it. SmolLM2 + the shipped EAGLE-3 head, tune's 8 calibration prompts, tree
    [[0],[1],[0,0]]: the replay took the same steps as real decoding on every prompt (194 in
    all, 1.81 tokens per step); the DP's estimate under q was 1.84."""
    tokens = steps = 0
    for r in runs:
        tokens += r["end"] - r["start"]
        steps += simulate_greedy_steps(r.get("rank"), r["start"], r["end"], paths, r.get("by_depth"))
    return tokens / steps if steps else 1.0


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
