"""Text already on this machine and the n-gram runs that keep training text apart from held-out
text (tools/train/eagle3_corpus.py, kinds.py).

Role in one decode step: none; corpus building only.
"""

from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def pydoc_topics() -> dict:
    """Python's documentation topics on this machine ({topic: text}; {} without pydoc_data)."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    if not path.is_file():
        return {}
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)  # a dict literal: {topic: text}
    return ns.get("topics", {})


def shingles(text: str, n: int = 6) -> set:
    words = text.lower().split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
