"""Draft sources and the level-by-level tree drafting loop.

Role in one decoding step: step 1. `draft_tree` asks a draft source for the root's
distribution (one call over the tokens committed since the last step, ending with the root),
then expands the tree level by level under a policy: each level is ONE draft call over the
frontier, with a tree mask over the draft's own scratch cache (each frontier node sees the
committed context, its ancestors and itself). After acceptance, `commit` keeps the accepted
path's draft K/V with one gather, exactly like the target's cache.

Sources: `ModelDraft` (any contract engine with the target's vocabulary: a smaller model, or
a `layers:K` truncated copy of the target) and `BigramDraft` (the seed's table draft, here a
table of the target's own next-token top-k given one token; no cache).

Candidates: `topk` (deterministic: the policy's top children), `sample` (i.i.d. draws from the
draft, with replacement) or `sample-unique` (draws without replacement, by the Gumbel-top-k
trick). The accept rule must match (runtime/accept.py).
"""
from __future__ import annotations


import torch

from .kvcache import KVCache
from .sampling import SamplingParams, warp_logits
from .trees import Tree, TreePolicy

CANDIDATE_MODES = ("topk", "sample", "sample-unique")


class ModelDraft:
    """A neural draft behind the engine protocol, with its own preallocated cache."""

    kind = "model"

    def __init__(self, engine, max_len: int):
        self.engine = engine
        self.vocab_size = engine.info.vocab_size
        self.cache = KVCache(engine.info.cache, max_len, 1, engine.device)
        self.pending: list[int] = []
        self._base = 0  # committed length before this step's scratch
        self._chain = 0  # tokens of the first call (pending + root), in cache after _base

    def reset(self, committed: list[int]) -> None:
        """Start a sequence: `committed` are the tokens before the first root (run lazily)."""
        self.cache.reset()
        self.pending = list(committed)

    def start(self, root: int) -> torch.Tensor:
        """Run the pending tokens and the root as a causal chain; return the root's logits [V]."""
        chain = self.pending + [root]
        m = len(chain)
        p = self.cache.length
        dev = self.engine.device
        ids = torch.tensor([chain], dtype=torch.long, device=dev)
        pos = torch.arange(p, p + m, device=dev)[None]
        mask = torch.ones(1, m, p + m, dtype=torch.bool, device=dev)
        mask[0, :, p:] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        logits = self.engine.forward(ids, pos, mask, self.cache)
        self._base, self._chain = p, m
        self.cache.length = p + m
        return logits[0, -1]

    def expand(self, tree_anc: torch.Tensor, slot: torch.Tensor, frontier: torch.Tensor,
               tokens: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """One draft call over the frontier nodes; returns their logits [F, V].

        tree_anc: ancestor matrix over the nodes so far; slot: each node's scratch slot (-1
        when not run yet); frontier: node indices to run now."""
        f = int(frontier.numel())
        c = self.cache
        p = c.length
        dev = self.engine.device
        scratch0 = self._base + self._chain
        n_slots = p - scratch0
        mask = torch.zeros(1, f, p + f, dtype=torch.bool)
        mask[0, :, :scratch0] = True
        if n_slots:
            slot_node = torch.empty(n_slots, dtype=torch.long)
            run = slot >= 0
            slot_node[slot[run]] = run.nonzero().flatten()
            mask[0, :, scratch0:p] = tree_anc[frontier][:, slot_node]
        mask[0, :, p:] = torch.eye(f, dtype=torch.bool)
        root_pos = self._base + self._chain - 1
        ids = tokens[frontier][None].to(dev)
        pos = (depth[frontier] + root_pos)[None].to(dev)
        logits = self.engine.forward(ids, pos, mask.to(dev), c)
        slot[frontier] = torch.arange(n_slots, n_slots + f)
        c.length = p + f
        return logits[0]

    def commit(self, tree: Tree, path: torch.Tensor) -> None:
        """Keep the chain and the accepted path's scratch entries; drop the rest."""
        c = self.cache
        c.length = self._base
        slots = tree.slot[path] if path.numel() else path
        ran = slots >= 0
        src = torch.cat([torch.arange(self._chain), slots[ran] + self._chain])
        c.commit(src, 0)
        # accepted nodes never run through the draft (a leaf) are run at the next start
        self.pending = tree.tokens[path[~ran]].tolist() if path.numel() else []


class BigramDraft:
    """The seed's table draft: next-token logits given only the previous token.

    `table` is either dense logits [V, V] or a sparse (indices [V, K], logits [V, K]) top-K;
    missing entries are -inf. Cost per level: a gather, no model call."""

    kind = "bigram"

    def __init__(self, indices: torch.Tensor | None, logits: torch.Tensor, vocab_size: int):
        self.vocab_size = vocab_size
        self.indices, self.logits = indices, logits.float()

    def _rows(self, toks: torch.Tensor) -> torch.Tensor:
        if self.indices is None:
            return self.logits[toks]
        out = torch.full((toks.numel(), self.vocab_size), float("-inf"))
        return out.scatter_(1, self.indices[toks], self.logits[toks])

    def reset(self, committed: list[int]) -> None:
        pass

    def start(self, root: int) -> torch.Tensor:
        return self._rows(torch.tensor([root]))[0]

    def expand(self, tree_anc, slot, frontier, tokens, depth) -> torch.Tensor:
        return self._rows(tokens[frontier])

    def commit(self, tree: Tree, path: torch.Tensor) -> None:
        pass


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


def _gumbel(shape, rng) -> torch.Tensor:
    u = torch.rand(shape, generator=rng).clamp_(1e-20, 1.0)
    return -torch.log(-torch.log(u))


@torch.inference_mode()
def draft_tree(draft, policy: TreePolicy, root: int, sp: SamplingParams,
               candidates: str = "topk", rng: torch.Generator | None = None,
               keep_q: bool = False) -> Tree:
    """Build one step's tree: D levels, one draft call per level over the frontier.

    keep_q: also keep the draft distributions for top-k candidates (analysis and tests; the
    sampled modes always keep them, the accept rule needs them)."""
    if candidates not in CANDIDATE_MODES:
        raise ValueError(f"unknown candidate mode {candidates!r} (expected one of {', '.join(CANDIDATE_MODES)})")
    sampled = candidates != "topk" and not sp.greedy
    if sampled and policy.data_dependent:
        raise ValueError(f"tree policy {policy.kind} ranks candidates by score: use --candidates topk with it")
    mode = candidates if sampled else "topk"
    vocab = draft.vocab_size
    cap = tree_capacity(policy, vocab)
    tokens = torch.zeros(cap, dtype=torch.long)
    parents = torch.zeros(cap, dtype=torch.long)
    depth = torch.zeros(cap, dtype=torch.long)
    score = torch.zeros(cap, dtype=torch.float32)
    qrow = torch.full((cap,), -1, dtype=torch.long)
    slot = torch.full((cap,), -1, dtype=torch.long)
    anc = torch.zeros(cap, cap, dtype=torch.bool)
    qs: list[torch.Tensor] = []
    n_q = 0
    n = 0
    logits = draft.start(root)[None].float().cpu()
    calls = 1
    frontier = torch.tensor([-1])
    f_score = torch.zeros(1)
    for level in range(1, policy.depth + 1):
        k = min(policy.width(level), vocab)
        if mode == "topk":
            # deterministic candidates: the draft's top-k by raw logits (the ranking does not
            # depend on the temperature; top-k/top-p only mask a tail that the accept rule
            # handles). Normalise to log-probs only where a policy ranks by cumulative score.
            vals, toks = torch.topk(logits, k, dim=-1)
            if policy.data_dependent or keep_q:
                lse = torch.logsumexp(logits, -1, keepdim=True)
                vals = vals - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            if keep_q:
                qs.append(torch.softmax(warp_logits(logits, sp), -1))
        else:
            warped = warp_logits(logits, sp)
            # a table draft may have no opinion at a node (every logit -inf): no candidates there
            empty = ~torch.isfinite(warped).any(-1, keepdim=True)
            q = torch.softmax(warped.masked_fill(empty, 0.0), -1)
            logq = torch.log(q)
            if mode == "sample":
                toks = torch.multinomial(q, k, replacement=True, generator=rng)
            else:  # without replacement: Gumbel-top-k == sequential draws without replacement
                toks = torch.topk(logq + _gumbel(logq.shape, rng), k, dim=-1).indices
            vals = logq.gather(1, toks).masked_fill(empty, float("-inf"))
            qs.append(q.masked_fill(empty, 0.0))
        scores = f_score[:, None] + vals
        keep = policy.select(level, scores)
        if policy.kind != "static":  # a fixed structure keeps its shape; others drop q = 0
            keep = keep & torch.isfinite(vals)
        fi, ci = keep.nonzero(as_tuple=True)
        m = int(fi.numel())
        new = torch.arange(n, n + m)
        par = frontier[fi]
        tokens[new], parents[new], depth[new], score[new] = toks[fi, ci], par, level, scores[fi, ci]
        if qs:
            qrow[new] = n_q + fi
            n_q += int(frontier.numel())
        has_par = par >= 0
        anc[new[has_par]] = anc[par[has_par]]
        anc[new, new] = True
        n += m
        expand = policy.expand(level, scores[fi, ci]) if m else torch.zeros(0, dtype=torch.bool)
        frontier, f_score = new[expand], scores[fi, ci][expand]
        if level == policy.depth or frontier.numel() == 0:
            break
        logits = draft.expand(anc[:n, :n], slot[:n], frontier, tokens[:n], depth[:n]).float().cpu()
        calls += 1
    tree = Tree(tokens[:n].clone(), parents[:n].clone(), depth[:n].clone(), score[:n].clone(),
                anc[:n, :n].clone(), slot[:n].clone(), qrow[:n].clone(),
                torch.cat(qs) if qs else None, mode, calls)
    keep = policy.finalize(tree.score, tree.depth)
    return tree.prune(keep) if keep is not None else tree


def tree_capacity(policy: TreePolicy, vocab: int) -> int:
    """Upper bound on nodes before final pruning."""
    kind = policy.kind
    if kind == "dynamic":
        k = min(policy.k, vocab)
        return k + (policy.depth - 1) * k * k
    if kind == "beam":
        return sum(policy.widths)
    if kind == "static":
        return len(policy.paths)
    w = min(policy.w, vocab)
    return sum(w ** l for l in range(1, policy.depth + 1))


def save_bigram_table(path, indices: torch.Tensor | None, logits: torch.Tensor, vocab_size: int) -> None:
    """Write a bigram table (the format `load_bigram_table` reads), atomically."""
    import os

    from safetensors.torch import save_file

    tensors = {"logits": logits.contiguous()}
    if indices is not None:
        tensors["indices"] = indices.contiguous()
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata={"vocab_size": str(vocab_size), "top_k": str(logits.shape[1])})
    os.replace(tmp, path)


def load_bigram_table(path) -> BigramDraft:
    """A BigramDraft from an exported table file (safetensors: `logits`, optional `indices`)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        logits = f.get_tensor("logits")
        indices = f.get_tensor("indices") if "indices" in f.keys() else None
    vocab = int(meta.get("vocab_size", logits.shape[-1]))
    return BigramDraft(indices, logits, vocab)


class LookupDraft:
    """Prompt-lookup (n-gram) draft: proposes the tokens that followed earlier occurrences of
    the current suffix in the sequence itself (prompt lookup decoding, Saxena 2023), as a tree:
    several earlier continuations become sibling branches, ranked by how often they occurred.

    No model and no cache: an index from each n-gram (n = min_ngram..max_ngram) of the
    committed tokens to the counts of the tokens that followed it is updated as tokens are
    committed. A node's distribution comes from the longest n-gram of its own context (the
    committed tokens + its tree path) found in the index; tokens never seen there get -inf,
    or, with a `fallback` draft (e.g. a BigramDraft), the fallback's log-probs shifted far
    below every lookup candidate."""

    kind = "lookup"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, fallback=None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("lookup draft needs 1 <= min_ngram <= max_ngram")
        self.vocab_size, self.max_n, self.min_n, self.fallback = vocab_size, max_ngram, min_ngram, fallback
        self.ctx: list[int] = []
        self.index: dict[tuple, dict[int, int]] = {}
        self._root: list[int] = []

    def _append(self, t: int) -> None:
        ctx = self.ctx
        j = len(ctx)
        for n in range(self.min_n, self.max_n + 1):
            if j >= n:
                nxt = self.index.setdefault(tuple(ctx[j - n:]), {})
                nxt[t] = nxt.get(t, 0) + 1
        ctx.append(t)

    def reset(self, committed: list[int]) -> None:
        self.ctx, self.index = [], {}
        for t in committed:
            self._append(int(t))
        if self.fallback is not None:
            self.fallback.reset(committed)

    def _rows(self, tails: list[list[int]]) -> torch.Tensor:
        out = torch.full((len(tails), self.vocab_size), float("-inf"))
        if self.fallback is not None:
            last = torch.tensor([t[-1] for t in tails])
            out = torch.log_softmax(self.fallback._rows(last), -1) - 1e4
        for r, tail in enumerate(tails):
            for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
                hit = self.index.get(tuple(tail[-n:]))
                if hit:
                    toks = torch.tensor(list(hit.keys()))
                    cnt = torch.tensor(list(hit.values()), dtype=torch.float32)
                    out[r, toks] = torch.log(cnt / cnt.sum())
                    break
        return out

    def start(self, root: int) -> torch.Tensor:
        self._root = self.ctx[-(self.max_n - 1):] + [int(root)] if self.max_n > 1 else [int(root)]
        return self._rows([self._root])[0]

    def expand(self, tree_anc, slot, frontier, tokens, depth) -> torch.Tensor:
        tails = []
        for f in frontier.tolist():
            path = tokens[tree_anc[f].nonzero().flatten()].tolist()  # ancestors in level order
            tails.append((self._root + path)[-self.max_n:])
        return self._rows(tails)

    def commit(self, tree: Tree, path: torch.Tensor) -> None:
        for t in [self._root[-1]] + (tree.tokens[path].tolist() if path.numel() else []):
            self._append(int(t))
