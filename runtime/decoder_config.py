"""How a decoder speculates: one frozen `DecoderConfig` for SpeculativeDecoder, BatchDecoder and
Generator.

Role in one decode step: none of its own. It fixes, once per decoder, what step 1 drafts (mode,
tree, candidates, the node limit), whether a prompt's prefill reuses a kept start (prefix_cache)
and how many sequences decode together. Each of the three takes `config=DecoderConfig(...)` or
its fields as keywords (`DecoderConfig.of`: the keyword shorthand, options over the config).

`resolve_config` is the one road from what the caller asked (a DecoderConfig with None where it
named nothing) and what was opened (the draft, the export's default tree, its node limit) to the
concrete configuration: generate, chat, serve, bench, tune and `Generator` all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from . import settings
from .errors import InputError
from .tuned_tree import ModelsKey, tuned_spec

if TYPE_CHECKING:
    from .trees import TreePolicy

MODES = ("vanilla", "chain", "tree")
DEFAULT_TREE = "full:3,2"  # the tree of a decoder that names none, where neither `tune` nor the export chose one
DEFAULT_CHAIN = "chain:4"  # the chain of chain mode that names none


@dataclass(frozen=True)
class DecoderConfig:
    """Defaults are the decoders' own; None where each resolves it (said per field)."""

    mode: str | None = None  # vanilla | chain | tree; None: tree with a draft, else vanilla (resolve_config)
    # a spec, "auto" (the tuned tree) or a TreePolicy; None: resolve_config's default (tuned, the export's, DEFAULT_TREE)
    tree: str | TreePolicy | None = None
    candidates: str | None = None  # topk | sample | sample-unique when sampling; None: the tree's choice, else topk
    max_tree_nodes: int | None = None  # a tree that may have more nodes is refused (an export's limit)
    sampled_tree: str | None = None  # a Generator's tree for unbatched calls at temperature > 0 (None: `tree`)
    # reuse the K/V of a prompt's start that the previous prompt shared; None: where exact (a
    # row-invariant target); False also starts the drafts cold (a benchmark)
    prefix_cache: bool | None = None
    max_batch: int | None = None  # sequences decoded together; None: a Generator 1 (unbatched), a BatchDecoder 8
    speculate_max_batch: int | None = None  # BatchDecoder: trees only up to this many active sequences
    # SpeculativeDecoder: run vanilla steps where its own measurements say the tree stops paying
    # (runtime/governor.py); None: off unless ARBORSPEC_ADAPTIVE=1 (opt-in: see docs/drafts-and-trees.md)
    adaptive: bool | None = None

    def __post_init__(self):
        from .trees import CANDIDATE_MODES  # (torch: not at import, so that --help texts can read the defaults)

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
        return settings.switch("ARBORSPEC_ADAPTIVE") is True

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



@dataclass(frozen=True)
class Opened:
    """What was opened, as far as the resolver cares: whether there is a draft, the export's
    default tree (OpenedExport.tree_default) and its node limit."""

    has_draft: bool = False
    tree_default: str | None = None
    max_tree_nodes: int | None = None

    @classmethod
    def of(cls, models) -> Opened:
        """From anything with `draft`, `tree_default` and `limits` (an OpenedExport, the CLI's
        opened models), or None."""
        if models is None or isinstance(models, Opened):
            return models or cls()
        limits = getattr(models, "limits", None) or {}
        return cls(models.draft is not None, getattr(models, "tree_default", None), limits.get("max_tree_nodes"))


def resolve_config(
    asked: DecoderConfig | None, opened=None, key: ModelsKey | None = None, temperature: float = 0.0
) -> DecoderConfig:
    """The concrete configuration of a decoder: `asked` (None fields: not named) over `opened`
    (Opened.of: an OpenedExport, the CLI's models, or None: engines alone); `key`: where the
    tree `arborspec tune` chose for these models lives (runtime/tuned_tree.py; None: nowhere).
    mode: asked, else tree with a draft, else vanilla. tree: asked; "auto" (and, in tree mode,
    no tree when `tune` wrote one for `key`): the tuned tree (at temperature > 0 the one tuned
    for sampling, where `tune --temperature` wrote it; one error line when there is none);
    else chain mode DEFAULT_CHAIN, others the export's default tree, else DEFAULT_TREE.
    sampled_tree: the tuned sampled tree beside an auto tree. max_tree_nodes: the lower of the
    asked and the export's limit. Resolving a resolved config changes nothing."""
    asked = asked if asked is not None else DecoderConfig()
    opened = Opened.of(opened)
    mode = asked.mode or ("tree" if opened.has_draft else "vanilla")
    tree, sampled = _resolved_tree(asked, mode, opened, key, temperature)
    limits = [n for n in (opened.max_tree_nodes, asked.max_tree_nodes) if n is not None]
    return replace(asked, mode=mode, tree=tree, sampled_tree=sampled, max_tree_nodes=min(limits) if limits else None)


def is_auto(tree) -> bool:
    return isinstance(tree, str) and tree.strip().lower() == "auto"


def _resolved_tree(asked: DecoderConfig, mode: str, opened: Opened, key, temperature: float):
    """(tree, sampled_tree) of resolve_config."""
    tree = None if mode == "vanilla" and is_auto(asked.tree) else asked.tree  # vanilla drafts no tree
    auto = is_auto(tree) or (tree is None and mode == "tree" and key is not None and key.path().is_file())
    if not auto:
        if tree is None:
            tree = DEFAULT_CHAIN if mode == "chain" else (opened.tree_default or DEFAULT_TREE)
        return tree, asked.sampled_tree
    if mode != "tree":
        raise InputError("--tree auto picks a static tree: use it with --mode tree")
    if key is None:
        raise InputError("--tree auto needs the model arguments to find the tuned tree")
    sampled = tuned_spec(key, sampled=True) if key.path(sampled=True).is_file() else None
    if temperature > 0 and sampled is not None:
        return sampled, sampled
    return tuned_spec(key), sampled or asked.sampled_tree
