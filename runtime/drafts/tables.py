"""Table drafts from a parsed spec: `lookup[:N]` and `suffix[:...]`, alone or mixed with a model
draft (`BASE+lookup`, `BASE+suffix`): the one place that builds them from a DraftSpec (the
export folder opener and the CLI's engine opener call it)."""

from __future__ import annotations

from .base import DraftSource


def table_draft(kind: str, arg, vocab_size: int) -> DraftSource:
    """The table draft of `kind` ("lookup": arg N; "suffix": arg SuffixOptions) over a target
    vocabulary of `vocab_size`."""
    if kind == "suffix":
        from .suffix import SuffixDraft

        return SuffixDraft(vocab_size, arg)
    from .lookup import LookupDraft

    return LookupDraft(vocab_size, max_ngram=arg)


def mixed_draft(base: DraftSource, kind: str, arg, vocab_size: int) -> DraftSource:
    """`base` (a model draft) mixed with the table draft of `kind` (spec.DraftSpec's mix_kind, mix)."""
    if kind == "suffix":
        from .suffix import SuffixMixDraft

        return SuffixMixDraft(base, table_draft(kind, arg, vocab_size))
    from .mixed import LookupMixDraft

    return LookupMixDraft(base, table_draft(kind, arg, vocab_size))
