"""Prompt sets shared by bench, tune and distillation: the packaged prompts file, held-out splits,
calibration prompts, encoding through the tokenizer (chat template where asked).

Role in one decode step: none; this chooses what the measured decode steps run on.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import torch

from arborspec.runtime.errors import InputError, MissingFileError
from arborspec.runtime.fileio import read_text_file


# ---------------------------------------------------------------------------------- prompts
def default_prompts_path() -> Path:
    return Path(str(resources.files("arborspec.tools") / "data" / "prompts.json"))


def heldout_prompts_path() -> Path:
    """The held-out prompts no tuning or training reads (tools/train/eagle3_heldout.py)."""
    return default_prompts_path().with_name("heldout_prompts.json")


def read_prompts_file(path: str | os.PathLike | None) -> tuple[list[dict], str]:
    """-> raw prompt entries and the path read. The file is {"prompts": [...]} or a list; each
    entry has "id", "category" (or "kind") and either "text" (+ optional "chat": true, "system")
    or "ids". A file-level "chat": true sends every text prompt through the chat template
    (tools/data/heldout_prompts.json, the held-out set no tuning or training reads)."""
    p = Path(path) if path else default_prompts_path()
    text = read_text_file(p, "prompts file")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InputError(f"{p}: not valid JSON ({e})") from None
    entries = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise InputError(f'{p}: expected a non-empty list of prompts (or {{"prompts": [...]}})')
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or ("text" not in e and "ids" not in e):
            raise InputError(f'{p}: prompt #{i} needs a "text" or an "ids" entry')
    chat = isinstance(data, dict) and data.get("chat") is True
    entries = [
        {**e, **({"category": e["kind"]} if "category" not in e and "kind" in e else {})}
        | ({"chat": True} if chat and "chat" not in e and "text" in e else {})
        for e in entries
    ]
    return entries, str(p)


def select_prompts(entries: list[dict], limit: int | None) -> list[dict]:
    """The first `limit` prompts taken round-robin over the categories (in file order), so a
    short run still covers every category."""
    if not limit or limit >= len(entries):
        return list(entries)
    if limit < 1:
        raise InputError(f"--limit-prompts must be >= 1, got {limit}")
    by_cat: dict[str, list[dict]] = {}
    for e in entries:
        by_cat.setdefault(str(e.get("category", "other")), []).append(e)
    out, queues = [], [list(v) for v in by_cat.values()]
    while len(out) < limit:
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    order = {id(e): i for i, e in enumerate(entries)}
    return sorted(out, key=lambda e: order[id(e)])


def encode_prompts(entries: list[dict], tok) -> list[dict]:
    """-> [{"id", "category", "ids"}]. Text prompts need a tokenizer; "ids" prompts do not."""
    out = []
    for i, e in enumerate(entries):
        pid = str(e.get("id", f"p{i}"))
        if "ids" in e:
            ids = [int(t) for t in e["ids"]]
        else:
            if tok is None:
                raise InputError(
                    f'prompt {pid!r} is text but this model has no tokenizer: use a prompts file with "ids" entries'
                )
            text = e["text"]
            if e.get("chat"):
                msgs = [{"role": "system", "content": e["system"]}] if e.get("system") else []
                msgs.append({"role": "user", "content": text})
                ids = tok.encode(tok.apply_chat(msgs), add_bos=False)
            else:
                ids = tok.encode(text)
        if not ids:
            raise InputError(f"prompt {pid!r} is empty")
        out.append({"id": pid, "category": str(e.get("category", "other")), "ids": ids})
    return out


# Simple seeds: plain-text openings in a few registers (stories, facts, code, dialogue, lists).
SEEDS = [
    "Once upon a time",
    "The history of",
    "In this tutorial, we will",
    "def main():",
    "Here is a list of",
    "The weather today is",
    "Dear friend,",
    "Scientists have discovered",
    "The best way to learn",
    "Q: What is the capital of France?\nA:",
    "Chapter 1\n\n",
    "import numpy as np\n",
    "My favourite recipe is",
    "The meeting was",
    "In conclusion,",
    "How to write a good essay:",
    "The city of",
    "Water is",
    "Photosynthesis is the process",
    "The main idea of the story is",
    "She opened the door and",
    "Step 1:",
    "The president said",
    "An apple a day",
    "The quick brown fox",
    "There are three reasons why",
    "Machine learning is",
    "Yesterday I went to",
    "Summary:",
    "The following code",
    "It was a dark and stormy night",
    "A good friend is someone who",
]


# Held-out prompts used when no prompts file is given (never used to build the corpus).
EVAL_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a rainbow forms.",
    "The three most important inventions of the twentieth century are",
    "Give me a recipe for pancakes.",
    "Tell me a story about a robot who learns to paint.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle in simple terms.",
    "List five tips for studying effectively.",
]


def load_prompt_entries(path: str | Path | None) -> list[dict]:
    """Entries of a prompts file: a JSON list of strings or of dicts with "prompt"/"text"
    (optionally "chat": bool) or "ids"; or {"prompts": [...]}. Missing file -> []."""
    p = Path(path) if path else default_prompts_path()
    if not p.is_file():
        if path:
            raise MissingFileError(f"prompts file not found: {p}")
        return []
    try:
        data = json.loads(read_text_file(p, "prompts file"))
    except json.JSONDecodeError as e:
        raise InputError(f"{p}: not valid JSON ({e})") from None
    if isinstance(data, dict):
        data = data.get("prompts", data.get("items", []))
    out = []
    for e in data:
        if isinstance(e, str):
            out.append({"text": e})
        elif isinstance(e, dict):
            if "ids" in e:
                out.append({"ids": [int(i) for i in e["ids"]]})
            elif e.get("prompt") or e.get("text"):
                out.append({"text": e.get("prompt") or e.get("text"), "chat": bool(e.get("chat", False))})
    return out


def encode_entry(entry: dict, tok, chat: bool | None = None) -> list[int] | None:
    if "ids" in entry:
        return list(entry["ids"])
    if tok is None:
        return None
    use_chat = entry.get("chat", False) if chat is None else chat
    if use_chat and tok.meta.get("chat_template"):
        return tok.encode(tok.apply_chat([{"role": "user", "content": entry["text"]}]), add_bos=False)
    return tok.encode(entry["text"])


def split_prompts(entries: list[dict], n_eval: int = 8) -> tuple[list[dict], list[dict]]:
    """(train, held-out): even-indexed entries are held out (up to n_eval), the rest train."""
    if not entries:
        return [], [{"text": t} for t in EVAL_PROMPTS[:n_eval]]
    held = entries[0::2][:n_eval]
    held_ids = {id(e) for e in held}
    return [e for e in entries if id(e) not in held_ids], held


def random_seed_ids(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def calibration_prompts(
    tok, prompts_file=None, n: int = 8, chat: bool | None = None, vocab: int = 0, seed: int = 0
) -> list[list[int]]:
    """Calibration prompts: the prompts file's training split (tools/data/prompts.json by
    default; held-out entries are left for evaluation), then built-in seeds. chat: True/False
    for every text prompt, None for each entry's own `chat` flag (the built-in seeds: none)."""
    entries = load_prompt_entries(prompts_file)
    train, _ = split_prompts(entries) if entries else ([], [])
    out = []
    for e in train + [{"text": s} for s in SEEDS]:
        ids = encode_entry(e, tok, chat=chat if "text" in e else None)
        if ids:
            out.append(ids)
        if len(out) >= n:
            break
    if len(out) < n:
        out += random_seed_ids(vocab, n - len(out), seed)
    return out[:n]
