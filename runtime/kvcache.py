"""The KV cache the runtime owns: one preallocated slab per kind for all layers.

Role in one decoding step: engines read the committed prefix [0, P) of every layer and write
the new T tokens' K/V onto [P, P+T) (the contract's sequence-major layout makes both dense);
after acceptance, `commit` moves the accepted path's entries to P..P+n-1 with one gather
over all layers, so the cache keeps exactly the committed tokens.

Layouts (runtime/contract.py KV_LAYOUTS): "sbhd", keys and values each [L, S_max, B, Hkv, D]
(a layer's past is the dense prefix [0, P) of its slab); "bhsd", each [L, B, Hkv, S_max, D] (the
engine reads and writes the layer's whole slab in place). Either way the committed tokens are
positions [0, length) and a commit is one gather along the sequence axis.

`PrefixCache` (before step 1 of a new sequence, and after each commit): which tokens a one-row
cache still holds from the last request, so that a prompt that starts with them (a chat's next
turn) prefills only the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import DeviceError, InputError


@dataclass(frozen=True)
class CacheSpec:
    """What an engine needs from a cache: shapes and dtype (read from a config or manifest)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    layout: str = "sbhd"  # or "bhsd"
    spare: int = 0  # columns past max_len the graph writes (a padded graph's dummy row: export/row_pad.py)


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` as a tensor made there reports it: "cuda" -> cuda:N (the current device). Engines
    keep their device this way, so that `cache.device == engine.device` holds for a cache they
    made: torch.device("cuda") != torch.device("cuda:0"), and comparing them made every
    generate() on a GPU allocate a new cache (and capture new CUDA graphs for it)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {device!r}: not a device torch knows (cpu, cuda, cuda:N)") from None
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():  # else the engine says why not
        return torch.device("cuda", torch.cuda.current_device())
    return d


def torch_device(device: str | torch.device) -> torch.device:
    """`resolve_device` for tensors torch itself computes on (the torch backend's engines): a CUDA
    device where torch sees none is one line here, before any weights move (not torch's
    AssertionError)."""
    d = resolve_device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"device {device}: torch {torch.__version__} ({built}) sees no CUDA GPU; use --device cpu")
    return d


class KVCache:
    def __init__(self, spec: CacheSpec, max_len: int, batch: int = 1, device: str | torch.device = "cpu"):
        if max_len < 1:
            raise InputError("max_len must be >= 1")
        self.spec, self.max_len, self.batch = spec, max_len, batch
        cols = max_len + spec.spare  # the spare columns are the engine's scratch, never committed
        if spec.layout == "bhsd":
            shape = (spec.n_layers, batch, spec.n_kv_heads, cols, spec.head_dim)
            self.seq_dim = 3
        else:
            shape = (spec.n_layers, cols, batch, spec.n_kv_heads, spec.head_dim)
            self.seq_dim = 1
        # uninitialised: engines read only the committed prefix, which was written first
        self.k = torch.empty(shape, dtype=spec.dtype, device=device)
        self.v = torch.empty(shape, dtype=spec.dtype, device=device)
        self.length = 0  # committed positions [0, length)
        self.finite = 0  # a batch cache's columns [0, finite) are finite in every row (ensure_finite)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def reset(self) -> None:
        self.length = 0

    def fits(self, spec: CacheSpec, max_len: int, batch: int, device) -> bool:
        """Whether this cache can serve a sequence of max_len (reuse instead of reallocating)."""
        return (
            self.spec == spec
            and self.max_len >= max_len
            and self.batch == batch
            and self.device == resolve_device(device)
        )

    def room(self, t: int) -> None:
        """Raise if T new tokens do not fit after the committed prefix."""
        if self.length + t > self.max_len:
            raise InputError(f"KV cache full: {self.length} committed + {t} new > capacity {self.max_len}")

    def _seq(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return x[:, a:b] if self.seq_dim == 1 else x[:, :, :, a:b]

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's committed K/V [P, B, Hkv, D] (views, no copy; strided for "bhsd")."""
        p = self.length
        if self.seq_dim == 1:
            return self.k[layer, :p], self.v[layer, :p]
        return self.k[layer, :, :, :p].permute(2, 0, 1, 3), self.v[layer, :, :, :p].permute(2, 0, 1, 3)

    def tail(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [T, B, Hkv, D] where an engine writes the new tokens' K/V."""
        p = self.length
        if self.seq_dim == 1:
            return self.k[layer, p : p + t], self.v[layer, p : p + t]
        return (self.k[layer, :, :, p : p + t].permute(2, 0, 1, 3), self.v[layer, :, :, p : p + t].permute(2, 0, 1, 3))

    def write_tail(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Write all layers' new K/V [L, T, B, Hkv, D] at [P, P+T)."""
        t, p = new_k.shape[1], self.length
        if self.seq_dim == 1:
            self.k[:, p : p + t] = new_k
            self.v[:, p : p + t] = new_v
        else:
            self.k[:, :, :, p : p + t] = new_k.permute(0, 2, 3, 1, 4)
            self.v[:, :, :, p : p + t] = new_v.permute(0, 2, 3, 1, 4)

    def commit(self, src, n_written: int) -> None:
        """Keep the new entries at offsets `src` (a list or tensor of offsets relative to the
        committed length, in order) and drop the rest of the n_written scratch entries. One
        gather over all layers for keys and one for values; none when `src` is 0..n-1 (a chain
        accepted from its start). `src=None` keeps all n_written entries (a prefill)."""
        p = self.length
        if src is None:
            self.length = p + n_written
            return
        if isinstance(src, torch.Tensor):
            src = src.tolist()
        n = len(src)
        if n == 0:
            return
        if src[-1] == n - 1 and src == list(range(n)):
            self.length = p + n
            return
        idx = torch.tensor(src, dtype=torch.long, device=self.device) + p
        d = self.seq_dim
        self._seq(self.k, p, p + n).copy_(self.k.index_select(d, idx))
        self._seq(self.v, p, p + n).copy_(self.v.index_select(d, idx))
        self.length = p + n

    # ------------------------------------------------------------------ batched decoding
    # With B sequences in one cache, every row shares the column space: row b's committed
    # tokens are [0, len_b), `length` is max(len_b) (the engines' P), and the mask hides the
    # gap [len_b, P) of shorter rows. runtime/batch_decode.py keeps the per-row lengths.

    def _row(self, x: torch.Tensor, row: int, a: int, b: int) -> torch.Tensor:
        return x[:, a:b, row] if self.seq_dim == 1 else x[:, row, :, a:b]

    def rows(self, n: int) -> "KVCache":
        """A cache over the first n batch rows, sharing this one's storage (no copy). For
        "bhsd" each layer's slab stays contiguous, so engines that bind a layer by address can
        run n rows of a larger cache."""
        view = object.__new__(KVCache)
        view.spec, view.max_len, view.batch, view.seq_dim = self.spec, self.max_len, n, self.seq_dim
        b = 2 if self.seq_dim == 1 else 1
        view.k, view.v = self.k.narrow(b, 0, n), self.v.narrow(b, 0, n)
        view.length = self.length
        return view

    def load_row(self, row: int, src: "KVCache", length: int) -> None:
        """Copy the first `length` positions of a one-row cache `src` into batch row `row`."""
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            self._row(mine, row, 0, length).copy_(src._row(theirs, 0, 0, length))

    def take_row(self, src: "KVCache", row: int, length: int) -> None:
        """Copy the first `length` positions of batch row `row` of `src` into this one-row cache."""
        for mine, theirs in ((self.k, src.k), (self.v, src.v)):
            self._row(mine, 0, 0, length).copy_(src._row(theirs, row, 0, length))

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` positions onto row dst (compaction when a row leaves)."""
        for x in (self.k, self.v):
            self._row(x, dst, 0, length).copy_(self._row(x, src, 0, length))

    def commit_rows(self, moves) -> None:
        """moves: (row, dst0, src positions) per row: row's entries at `src` (absolute positions)
        go to dst0, dst0+1, ... Every moved row at once: one gather and one scatter per cache, the
        indices copied to the device once (a gather per row cost a small copy and two kernels per
        row, 128 rows a step in batched decoding); a row whose entries are already in place (a
        vanilla step of the longest row) is left out."""
        rows: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        for row, dst0, s in moves:
            n = len(s)
            if n == 0 or (s[0] == dst0 and s == list(range(dst0, dst0 + n))):
                continue
            rows += [row] * n
            dst += range(dst0, dst0 + n)
            src += s
        if not rows:
            return
        r, d, s = torch.tensor([rows, dst, src], dtype=torch.long).to(self.device)
        for x in (self.k, self.v):  # the right side is gathered (a copy) before the write
            if self.seq_dim == 1:  # [L, S, B, H, D]
                x[:, d, r] = x[:, s, r]
            else:  # [L, B, H, S, D]
                x[:, r, :, d] = x[:, r, :, s]

    def zero_(self) -> "KVCache":
        """Zero both slabs (every column finite)."""
        self.k.zero_()
        self.v.zero_()
        self.finite = self.max_len
        return self

    def ensure_finite(self, upto: int) -> None:
        """A batch cache: zero columns [finite, upto) of every row, so that a call reading
        columns below `upto` reads finite numbers. A row's masked gap columns are still read
        (weight 0), and 0 x NaN from uninitialised memory would be NaN. Columns are zeroed as
        calls come to them, never written before (every write lands below `finite`: the batch
        decoders size the cache with sized_cache before each call and each join), not the
        whole slab at allocation: a long prompt joining 8 rows grew the cache to 2,864
        positions, 1 GB zeroed in ~2 s on this CPU, most of it never read."""
        upto = min(upto, self.max_len)
        if upto > self.finite:
            for x in (self.k, self.v):
                self._seq(x, self.finite, upto).zero_()
            self.finite = upto

    def grown(self, max_len: int) -> "KVCache":
        """A larger cache holding this one's first `length` positions of every row (finite up
        to there; ensure_finite zeroes the rest as it comes into use)."""
        new = KVCache(self.spec, max_len, self.batch, self.device)
        for old, fresh in ((self.k, new.k), (self.v, new.v)):
            new._seq(fresh, 0, self.length).copy_(self._seq(old, 0, self.length))
        new.length = new.finite = self.length
        return new


# ---------------------------------------------------------------------- batch caches: shared by the
# target's (runtime/batch_decode.py) and the batched draft's (runtime/drafts/batched.py); owners have `.row`
# and `.length`
def release_row(owners: list, owner, cache: KVCache) -> None:
    """Drop `owner` from `owners` (owners[i].row == i): the last row moves into its place (its
    first `length` positions copied) and the cache's P becomes the longest remaining row's."""
    i = owner.row
    last = owners.pop()
    if last is not owner:
        cache.move_row(last.row, i, last.length)
        last.row = i
        owners[i] = last
    owner.row = -1
    cache.length = max((o.length for o in owners), default=0)


def sized_cache(cache: KVCache | None, spec, need: int, batch: int, device, top: int) -> KVCache:
    """A batch cache with room for `need` positions, finite up to there (ensure_finite): the
    one call the batch decoders make before every engine call and every join. Allocated at
    max(need, 256), then grown to twice the need or the capacity, whichever is larger, up to
    `top` (the model's context) unless `need` asks for more."""
    if cache is None:
        cache = KVCache(spec, max(need, 256), batch, device)
    elif cache.max_len < need:
        cache = cache.grown(max(need, min(2 * max(cache.max_len, need), top)))
    cache.ensure_finite(need)
    return cache


# ---------------------------------------------------------------------- a prompt's prefix, kept
def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    """The tokens whose K/V a one-row cache holds at [0, n): the last prompt's (but its last
    token) and what the decoding committed after it; with the target's features of those tokens
    when the draft reads them. A prompt that starts with the same tokens (the next turn of a
    chat: the earlier turns and the answer; a shared system prompt) prefills only the rest.
    Exact where the engine is row-invariant (a row's K/V do not depend on the call that carried
    it: `caps.row_invariant`); a float engine's K/V may differ in the last bits from one prefill."""

    def __init__(self):
        self.cache: KVCache | None = None
        self.tokens: list[int] = []
        self._feats: list[torch.Tensor] = []  # chunks, rows in token order

    @property
    def n_feats(self) -> int:
        return sum(len(f) for f in self._feats)

    def room(self, cache: KVCache | None, spec: CacheSpec, need: int, device, top: int) -> KVCache:
        """A one-row cache with room for `need` positions: `cache` where it has it, else a new
        one (twice the old, up to `top`, the model's context) that keeps what this prefix holds
        in the old (a longer next prompt still reuses it)."""
        if cache is not None and cache.fits(spec, need, 1, device):
            return cache
        size = max(need, min(2 * cache.max_len, top)) if cache is not None else need
        if cache is None or cache is not self.cache or not cache.fits(spec, 1, 1, device):
            return KVCache(spec, size, 1, device)
        cache.length = len(self.tokens)
        self.cache = cache.grown(size)
        return self.cache

    def match(self, tokens: list[int]) -> int:
        """How many of `tokens`' first ones this prefix holds."""
        return common_prefix(tokens, self.tokens)

    def begin(self, cache: KVCache, tokens: list[int], enabled: bool, features: bool = False) -> int:
        """Before a prefill of `tokens` into `cache`: -> how many of them its rows already hold
        (0 when disabled or another cache); the cache's length is set there. Until `end` the
        cache holds only those (a prefill that fails keeps what it kept). features: the caller
        needs the kept tokens' features too."""
        keep = 0
        if enabled and cache is self.cache:
            keep = min(self.match(tokens), self.n_feats) if features else self.match(tokens)
        feats = torch.cat(self._feats)[:keep] if self._feats and keep else None
        self.cache, self.tokens, self._feats = cache, list(tokens[:keep]), [feats] if feats is not None else []
        cache.length = keep
        return keep

    def end(self, tokens: list[int], new_feats: torch.Tensor | None) -> torch.Tensor | None:
        """After the prefill of `tokens[keep:]` -> the features of all `tokens` (kept + new), or
        None when the draft reads none."""
        self.tokens = list(tokens)
        if new_feats is not None:
            self._feats.append(new_feats)
        feats = torch.cat(self._feats) if self._feats else None
        self._feats = [feats] if feats is not None else []
        return feats

    def head(self, n: int) -> tuple[list[int], list[torch.Tensor]]:
        """The first n tokens held and their features (chunks; [] when none are kept)."""
        feats = [torch.cat(self._feats)[:n]] if self._feats else []
        return self.tokens[:n], feats

    def adopt(self, cache: KVCache, tokens: list[int], feats: list[torch.Tensor]) -> None:
        """`cache` now holds `tokens` at [0, n) (a finished batch row copied into it), with these
        features (chunks; [] when the draft reads none)."""
        self.cache, self.tokens, self._feats = cache, list(tokens), list(feats)

    def extend(self, tokens: list[int], feats: torch.Tensor | None) -> None:
        """A decode step committed `tokens` after these (their K/V, and features, in the rows after)."""
        self.tokens += tokens
        if feats is not None:
            self._feats.append(feats)
