"""The one parser of draft specs (`--draft`), for the runtime, the CLI and the exporter.

Role: before any decode step, it says which draft source a spec names. Grammar:
  none                 no draft (vanilla decoding)
  export               an export folder's own draft (runtime/export_dir.open_export)
  lookup[:N]           prompt lookup, n-grams up to N (default 3): runtime/drafts/lookup.py
  layers:K             the target's first K layers (exported, or built in PyTorch)
  bigram               the target's bigram table: runtime/drafts/bigram.py
  eagle3 | eagle3:DIR  an EAGLE-3 head (the shipped one, or a checkpoint folder)
  NAME|PATH            another model with the target's vocabulary
  BASE+lookup[:N]      BASE (a model draft) mixed with lookup: runtime/drafts/mixed.py
Which kinds a caller accepts is the caller's business (an export folder's draft is fixed at
export time); a malformed spec is one InputError line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError

KINDS = ("none", "export", "lookup", "layers", "bigram", "eagle3", "model")


@dataclass(frozen=True)
class DraftSpec:
    """A parsed draft spec: `kind` (one of KINDS) and its argument (lookup: N; layers: K;
    eagle3: the spec text `eagle3[:DIR]`; model: the name or path), for the base draft when
    `mix` is set (BASE+lookup:N -> mix = N). `text`: the base's spec as given, stripped."""

    kind: str
    arg: Any = None
    mix: int | None = None
    text: str = ""


def parse_draft_spec(spec: str | None, default: str = "none") -> DraftSpec:
    """`spec` -> DraftSpec; None or "" means `default` ("none", or "export" for an export folder)."""
    s = (spec or "").strip() or default
    if "+" in s:
        base, _, look = s.rpartition("+")
        n = _lookup_n(look, spec)
        if n is None or not base.strip() or _lookup_n(base, spec) is not None:
            raise InputError(
                f"bad draft spec {spec!r}: a mixed draft is BASE+lookup[:N] with a model draft as BASE "
                "(e.g. eagle3+lookup, export+lookup:4)"
            )
        b = parse_draft_spec(base)
        return DraftSpec(b.kind, b.arg, n, b.text)
    low = s.lower()
    n = _lookup_n(s, spec)
    if n is not None:
        return DraftSpec("lookup", n, None, s)
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
