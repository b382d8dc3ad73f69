"""The one parser of draft specs (`--draft`), for the runtime, the CLI and the exporter.

Role: before any decode step, it says which draft source a spec names. Grammar:
  none                 no draft (vanilla decoding)
  export               an export folder's own draft (runtime/export_dir.open_export)
  lookup[:N]           prompt lookup, n-grams up to N (default 3): runtime/drafts/lookup.py
  suffix[:K=V,...]     the suffix draft (runtime/drafts/suffix.py): options nodes, alpha, prob,
                       min, mem (SuffixOptions)
  layers:K             the target's first K layers (exported, or built in PyTorch)
  bigram               the target's bigram table: runtime/drafts/bigram.py
  eagle3 | eagle3:DIR  an EAGLE-3 head (the shipped one, or a checkpoint folder)
  NAME|PATH            another model with the target's vocabulary
  BASE+lookup[:N]      BASE (a model draft) mixed with lookup: runtime/drafts/mixed.py
  BASE+suffix[:...]    BASE's tree merged with the suffix draft's: runtime/drafts/suffix.py
Which kinds a caller accepts is the caller's business (an export folder's draft is fixed at
export time); a malformed spec is one InputError line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError

KINDS = ("none", "export", "lookup", "suffix", "layers", "bigram", "eagle3", "model")
TABLES = ("lookup", "suffix")  # the drafts a model draft can be mixed with (BASE+TABLE)


@dataclass(frozen=True)
class DraftSpec:
    """A parsed draft spec: `kind` (one of KINDS) and its argument (lookup: N; suffix:
    SuffixOptions; layers: K; eagle3: the spec text `eagle3[:DIR]`; model: the name or path), for
    the base draft when `mix` is set: the mixed table's argument (BASE+lookup:N -> mix = N;
    BASE+suffix -> mix = SuffixOptions), `mix_kind` which table. `text`: the base's spec as
    given, stripped."""

    kind: str
    arg: Any = None
    mix: Any = None
    text: str = ""
    mix_kind: str = "lookup"  # which table `mix` is for (read only when mix is set)


# the shortest match the suffix draft proposes from when `min` is not given: mixed with a model
# draft, matches of 1-3 tokens mostly add verify rows after the model's own node that the target
# rejects (4 measured fastest, every round); alone, a short match is its only draft (1 fastest).
# Figures: benchmarks/RESULTS.md, "The decode loop's tax, and the suffix draft's shortest match"
MIN_ALONE, MIN_MIXED = 1, 4


@dataclass(frozen=True)
class SuffixOptions:
    """The suffix draft's options (`suffix:nodes=24,alpha=1,prob=0.1,min=1|4,mem=0,paths=1,lead=3`):
    at most `nodes` proposed nodes a step, and at most alpha x the match's length; a node only
    where at least `prob` of the match's earlier occurrences continue that way; nothing for a
    match shorter than `min` tokens (None: MIN_ALONE for the suffix draft alone, MIN_MIXED mixed
    with a model draft); `mem`: tokens of earlier requests' outputs remembered (0: none); at most
    `paths` leaves (in a merged tree: beyond the model tree's own); mixed with a model draft, a
    proposal of >= `lead` nodes that would exceed `paths` replaces the model's tree (else the
    model's tree is kept alone)."""

    nodes: int = 24
    alpha: float = 1.0
    prob: float = 0.1
    min: int | None = None
    mem: int = 0
    paths: int = 1  # root-to-leaf paths a proposal keeps (1: a chain; a tree costs padded rows on the CPU)
    lead: int = 3  # a proposed chain this long displaces a model branch it disagrees with (paths exceeded)


def _suffix_options(s: str, spec) -> SuffixOptions | None:
    """`suffix` / `suffix:K=V,...` -> SuffixOptions; anything not starting with suffix -> None."""
    head, _, rest = s.strip().partition(":")
    if head.strip().lower() != "suffix":
        return None
    vals: dict = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        k, eq, v = item.partition("=")
        k = k.strip().lower()
        if not eq or k not in SuffixOptions.__dataclass_fields__:
            raise InputError(
                f"bad draft spec {spec!r}: suffix options are nodes=, alpha=, prob=, min=, mem=, paths=, lead= (got {item!r})"
            )
        try:
            vals[k] = float(v) if k in ("alpha", "prob") else int(v)
        except ValueError:
            raise InputError(f"bad draft spec {spec!r}: {k}= needs a number, got {v.strip()!r}") from None
    o = SuffixOptions(**vals)
    if (
        o.nodes < 1
        or o.alpha <= 0
        or not 0 < o.prob <= 1
        or (o.min is not None and o.min < 1)
        or o.mem < 0
        or o.paths < 1
        or o.lead < 1
    ):
        raise InputError(
            f"bad draft spec {spec!r}: suffix needs nodes, min, paths, lead >= 1, alpha > 0, 0 < prob <= 1, mem >= 0"
        )
    return o


def parse_draft_spec(spec: str | None, default: str = "none") -> DraftSpec:
    """`spec` -> DraftSpec; None or "" means `default` ("none", or "export" for an export folder)."""
    s = (spec or "").strip() or default
    if "+" in s:
        base, _, table = s.rpartition("+")
        n, opts = _lookup_n(table, spec), _suffix_options(table, spec)
        b = parse_draft_spec(base) if base.strip() else None
        if (n is None and opts is None) or b is None or b.kind in TABLES or b.mix is not None:
            raise InputError(
                f"bad draft spec {spec!r}: a mixed draft is BASE+lookup[:N] or BASE+suffix[:...] with a model "
                "draft as BASE (e.g. eagle3+lookup, export+suffix)"
            )
        return DraftSpec(b.kind, b.arg, n if opts is None else opts, b.text, "lookup" if opts is None else "suffix")
    low = s.lower()
    n = _lookup_n(s, spec)
    if n is not None:
        return DraftSpec("lookup", n, None, s)
    opts = _suffix_options(s, spec)
    if opts is not None:
        return DraftSpec("suffix", opts, None, s)
    if low in ("none", "export", "bigram"):
        return DraftSpec(low, None, None, s)
    if low.startswith("layers:"):
        try:
            k = int(s.split(":", 1)[1])
        except ValueError:
            raise InputError(f"bad draft spec {spec!r}: expected layers:K with an integer K") from None
        return DraftSpec("layers", k, None, s)
    if low == "eagle3" or low.startswith("eagle3:"):
        return DraftSpec("eagle3", s, None, s)
    return DraftSpec("model", s, None, s)


def _lookup_n(s: str, spec) -> int | None:
    """`lookup` / `lookup:N` -> N (default 3); anything not starting with lookup -> None."""
    if not s.strip().lower().startswith("lookup"):
        return None
    _, _, n = s.strip().partition(":")
    try:
        n = int(n) if n else 3
    except ValueError:
        raise InputError(f"bad draft spec {spec!r}: expected lookup or lookup:N") from None
    if n < 1:
        raise InputError(f"bad draft spec {spec!r}: N must be >= 1")
    return n
