"""How a decoder speculates: one frozen `DecoderConfig` for SpeculativeDecoder, BatchDecoder and
Generator.

Role in one decode step: none of its own. It fixes, once per decoder, what step 1 drafts (mode,
tree, candidates, the node limit), whether a prompt's prefill reuses a kept start (prefix_cache)
and how many sequences decode together. Each of the three takes `config=DecoderConfig(...)` or
its fields as keywords (`DecoderConfig.of`: the keyword shorthand, options over the config).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from . import settings
from .errors import InputError
from .trees import CANDIDATE_MODES, TreePolicy

MODES = ("vanilla", "chain", "tree")
DEFAULT_TREE = "full:3,2"


@dataclass(frozen=True)
class DecoderConfig:
    """Defaults are the decoders' own; None where each resolves it (said per field)."""

    mode: str | None = None  # vanilla | chain | tree; None: tree (a Generator: tree with a draft, else vanilla)
    tree: str | TreePolicy | None = None  # a spec or TreePolicy; None: full:3,2 (from_export: tuned / export's)
    candidates: str | None = None  # topk | sample | sample-unique when sampling; None: the tree's choice, else topk
    max_tree_nodes: int | None = None  # a tree that may have more nodes is refused (an export's limit)
    sampled_tree: str | None = None  # a Generator's tree for unbatched calls at temperature > 0 (None: `tree`)
    # reuse the K/V of a prompt's start that the previous prompt shared; None: where exact (a
    # row-invariant target); False also starts the drafts cold (a benchmark)
    prefix_cache: bool | None = None
    max_batch: int | None = None  # sequences decoded together; None: a Generator 1 (unbatched), a BatchDecoder 8
    speculate_max_batch: int | None = None  # BatchDecoder: trees only up to this many active sequences
    # SpeculativeDecoder: run vanilla steps where its own measurements say the tree stops paying
    # (runtime/governor.py); None: on unless ARBORSPEC_ADAPTIVE=0
    adaptive: bool | None = None

    def __post_init__(self):
        if self.mode is not None and self.mode not in MODES:
            raise InputError(f"unknown mode {self.mode!r} (expected one of {', '.join(MODES)})")
        if self.candidates is not None and self.candidates not in CANDIDATE_MODES:
            raise InputError(
                f"unknown candidate mode {self.candidates!r} (expected one of {', '.join(CANDIDATE_MODES)})"
            )
        for name in ("max_batch", "speculate_max_batch"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InputError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def governed(self) -> bool:
        """Whether the single-sequence decoder's steps are governed (`adaptive`, else the setting)."""
        if self.adaptive is not None:
            return bool(self.adaptive)
        return settings.switch("ARBORSPEC_ADAPTIVE") is not False

    @property
    def tree_spec(self) -> str | TreePolicy:
        """The tree to draft: `tree`, or DEFAULT_TREE."""
        return DEFAULT_TREE if self.tree is None else self.tree

    @classmethod
    def of(cls, config: DecoderConfig | None, options: dict, caller: str) -> DecoderConfig:
        """`config` (None: the defaults) with the keyword shorthand `options` over it."""
        return with_options(config if config is not None else cls(), options, caller)


def with_options(obj, options: dict, caller: str):
    """The frozen dataclass `obj` with `options` (its fields as keywords: the shorthand of a
    call that takes it) replaced; an unknown keyword is a TypeError naming it, as Python's own."""
    known = {f.name for f in fields(obj)}
    for name in options:
        if name not in known:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    return replace(obj, **options) if options else obj

