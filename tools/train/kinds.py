"""Prompts of the kinds users send besides chat and code: translation, short factual QA, maths
word problems, summaries of long documents and answers grounded in given passages. Built with no
network from templates and from text that ships with Python and the packages on this machine
(the stdlib's docstrings and pydoc topics, installed packages' READMEs and licences, man pages,
the licence texts under /usr/share/common-licenses).

Role in one decode step: none; the EAGLE-3 corpus (`train-draft --prompt-source kinds`) asks the
target these requests, and the per-kind held-out set (eagle3_heldout.kinds_report) judges the
head on others.

Held out by source, not by row: every source item (a document, a sentence's verb phrase, a QA
entity, a maths template) belongs to the train split or the held-out split by a hash of its id
(`split_of`); training prompts come only from train-split items, the held-out set and
`benchmark_prompts` only from held-out ones. The held-out documents are stdlib module
docstrings only (the same on every machine with this Python; the pydoc topics fed earlier
corpora's template prompts, so they stay train-only). A training prompt that shares a 6-word
run with the held-out set or the benchmark prompts is replaced by the next draw (tested).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import random
import re
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

from arborspec.tools.train.text_sources import pydoc_topics, shingles

KINDS = ("translation", "qa", "math", "long_summary", "retrieval")
HELDOUT_SHARE = 6  # one source item in HELDOUT_SHARE is held out


def split_of(source_id: str) -> str:
    """ "heldout" or "train": the split a source item belongs to (a stable hash of its id)."""
    h = int.from_bytes(hashlib.sha256(source_id.encode()).digest()[:8], "big")
    return "heldout" if h % HELDOUT_SHARE == 0 else "train"


def in_split(ids, split: str) -> list:
    return [i for i in ids if split_of(i if isinstance(i, str) else i[0]) == split]


# ------------------------------------------------------------------------ translation
LANGUAGES = [
    "French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Polish",
    "Turkish", "Russian", "Chinese", "Japanese", "Korean", "Arabic", "Hindi", "Greek",
]  # fmt: skip
SUBJECTS = ["I", "We", "My brother", "The teacher", "Our neighbours", "The children", "My manager", "She",
            "He", "They", "The doctor", "Your friend", "The old man", "My parents"]  # fmt: skip
ACTIONS = [
    "visited the museum", "forgot the keys at home", "bought fresh bread at the market",
    "missed the last bus", "cooked dinner for the whole family", "painted the kitchen blue",
    "found a small cat in the garden", "wrote a letter to the mayor", "lost the map",
    "booked a table for four people", "watched a film about the sea", "planted tomatoes",
    "called the bank about the bill", "cleaned the windows", "fixed the broken chair",
    "read the newspaper on the train", "took the dog for a long walk", "sold the old car",
    "learned to play the guitar", "moved to a bigger flat", "waited at the station for an hour",
    "ordered a coffee and a slice of cake", "left the umbrella in the taxi", "opened a new shop",
    "finished the report", "climbed the hill behind the village", "borrowed three books",
    "paid the rent", "washed the dishes", "met an old friend at the airport",
    "broke a glass", "asked for directions to the hotel", "carried the boxes upstairs",
    "swam in the lake", "repaired the bicycle", "sent the package to Canada",
    "made a cake for the party", "turned off the lights", "called a taxi", "signed the contract",
]  # fmt: skip
WHEN = ["yesterday", "last week", "this morning", "on Sunday", "last summer", "before dinner",
        "after work", "two days ago", "in the evening", "during the holidays", ""]  # fmt: skip
PHRASES = [
    "Where is the nearest train station?", "Could you close the window, please?",
    "How much does this jacket cost?", "I would like a glass of water.",
    "The museum is closed on Mondays.", "Please speak more slowly.",
    "What time does the shop open?", "I am allergic to peanuts.",
    "Can I pay by card?", "The weather is very cold today.",
    "My phone battery is almost empty.", "Is breakfast included in the price?",
    "We need a room for two nights.", "Turn left at the second traffic light.",
    "I don't understand the question.", "The meeting has been moved to Thursday.",
    "Happy birthday, I hope you have a wonderful day!", "Thank you very much for your help.",
    "Where can I buy a ticket?", "The soup is too salty.",
    "How long does the journey take?", "Please call me when you arrive.",
    "Do you have this shirt in a larger size?", "The library is next to the post office.",
    "I have been learning to cook for a year.", "Our flight was delayed by three hours.",
    "Could you recommend a good restaurant nearby?", "The children are playing in the park.",
    "I left my wallet in the car.", "It is going to rain tomorrow afternoon.",
]  # fmt: skip
FOREIGN = [
    ("French", "Je voudrais réserver une table pour ce soir."),
    ("French", "Le train part à huit heures du matin."),
    ("French", "Nous avons passé nos vacances au bord de la mer."),
    ("French", "Pouvez-vous m'aider à porter ces valises ?"),
    ("French", "Il fait très beau aujourd'hui."),
    ("Spanish", "¿Dónde está la biblioteca?"),
    ("Spanish", "Mi hermana trabaja en un hospital."),
    ("Spanish", "Mañana vamos a visitar a mis abuelos."),
    ("Spanish", "No tengo tiempo para ver la televisión."),
    ("Spanish", "El restaurante está cerrado los lunes."),
    ("German", "Ich habe meinen Schlüssel verloren."),
    ("German", "Wir fahren am Wochenende in die Berge."),
    ("German", "Das Essen war sehr lecker."),
    ("German", "Kannst du mir bitte das Salz geben?"),
    ("German", "Der Bus kommt jeden Tag zu spät."),
    ("Italian", "Vorrei un caffè e un cornetto, per favore."),
    ("Italian", "La stazione è lontana da qui?"),
    ("Portuguese", "Eu gosto muito de ler livros de história."),
    ("Portuguese", "A reunião começa às dez horas."),
    ("Dutch", "Ik woon al vijf jaar in Amsterdam."),
]  # fmt: skip
TRANSLATE_TO = [
    'Translate into {lang}: "{s}"',
    'How do you say "{s}" in {lang}?',
    "Translate the following from English to {lang}.\n\n{s}",
    "{lang} translation, please: {s}",
    "Can you translate this to {lang}? {s}",
    'What is "{s}" in {lang}?',
    "Please translate this text into {lang} and keep the meaning:\n{s}",
    "I need this in {lang}: {s}",
]
TRANSLATE_FROM = [
    'Translate this {lang} sentence into English: "{s}"',
    "What does this mean in English? {s}",
    "Translate from {lang} to English:\n\n{s}",
]


def english_sentence(rnd: random.Random, split: str) -> tuple[str, str]:
    """-> (source id, an English sentence): a subject, an action of `split`, a time; or a phrase."""
    if rnd.random() < 0.4:
        s = rnd.choice(in_split(PHRASES, split))
        return s, s
    action = rnd.choice(in_split(ACTIONS, split))
    when = rnd.choice(WHEN)
    return action, f"{rnd.choice(SUBJECTS)} {action}{' ' + when if when else ''}."


def translation_prompt(rnd: random.Random, split: str) -> tuple[str, str, str]:
    if rnd.random() < 0.15:
        lang, s = rnd.choice([f for f in FOREIGN if split_of(f[1]) == split])
        return s, rnd.choice(TRANSLATE_FROM).format(lang=lang, s=s), s
    src, s = english_sentence(rnd, split)
    if rnd.random() < 0.25:  # two sentences
        s = f"{s} {english_sentence(rnd, split)[1]}"
    return src, rnd.choice(TRANSLATE_TO).format(lang=rnd.choice(LANGUAGES), s=s), s


# ------------------------------------------------------------------------ short factual QA
COUNTRIES = (
    "France Germany Spain Italy Portugal Norway Sweden Finland Poland Greece Turkey Egypt Kenya Nigeria "
    "Ghana Morocco Brazil Argentina Chile Peru Colombia Mexico Canada Japan China India Pakistan Vietnam "
    "Thailand Indonesia Australia Ireland Iceland Austria Switzerland Belgium Netherlands Denmark Hungary "
    "Romania Ukraine Iran Israel Ethiopia Tanzania Cuba Jamaica Nepal Mongolia Philippines Malaysia"
).split()
ELEMENTS = (
    "hydrogen helium lithium carbon nitrogen oxygen fluorine neon sodium magnesium aluminium silicon "
    "phosphorus sulfur chlorine argon potassium calcium iron copper zinc silver tin iodine gold mercury "
    "lead uranium titanium nickel cobalt platinum tungsten krypton xenon radon"
).split()
PEOPLE = [
    "Marie Curie", "Isaac Newton", "Ada Lovelace", "Leonardo da Vinci", "Albert Einstein", "Charles Darwin",
    "Nelson Mandela", "Cleopatra", "Galileo Galilei", "William Shakespeare", "Mahatma Gandhi", "Frida Kahlo",
    "Ludwig van Beethoven", "Nikola Tesla", "Jane Austen", "Alan Turing", "Rosalind Franklin",
    "Wolfgang Amadeus Mozart", "Confucius", "Julius Caesar", "Florence Nightingale", "Napoleon Bonaparte",
    "Johannes Gutenberg", "Louis Pasteur", "Pablo Picasso", "Vincent van Gogh", "Grace Hopper",
    "Nicolaus Copernicus", "Genghis Khan", "Martin Luther King Jr.", "Amelia Earhart", "Sigmund Freud",
]  # fmt: skip
INVENTIONS = [
    "telephone", "light bulb", "printing press", "steam engine", "telescope", "microscope", "airplane",
    "radio", "television", "World Wide Web", "bicycle", "camera", "refrigerator", "compass", "vaccine",
    "transistor", "typewriter", "helicopter", "calculator", "paper", "wheel", "battery", "thermometer",
]  # fmt: skip
ANIMALS = [
    "koala", "octopus", "penguin", "giraffe", "dolphin", "honey bee", "bat", "elephant", "tiger", "owl",
    "camel", "shark", "kangaroo", "panda", "sloth", "crocodile", "salmon", "hedgehog", "wolf", "swan",
    "chameleon", "platypus", "polar bear", "ant", "whale",
]  # fmt: skip
QA_TEMPLATES = {
    "country": ["What is the capital of {x}?", "Which continent is {x} in?", "What language is spoken in {x}?",
                "What currency does {x} use?", "Name the largest city in {x}.", "Which countries border {x}?"],
    "element": ["What is the chemical symbol of {x}?", "What is the atomic number of {x}?", "Is {x} a metal?",
                "What is {x} used for?", "At room temperature, is {x} a solid, a liquid or a gas?"],
    "person": ["Who was {x}?", "What is {x} best known for?", "When did {x} live?", "Which country was {x} from?"],
    "invention": ["Who invented the {x}?", "When was the {x} invented?", "How does a {x} work, in one sentence?"],
    "animal": ["What does a {x} eat?", "Where does the {x} live in the wild?", "How long does a {x} live?",
               "Is the {x} a mammal?"],
    "city": ["Which country is {x} in?", "What is {x} famous for?", "Roughly how many people live in {x}?"],
    "module": ["What is the Python module {x} used for?", "Give a one-line description of Python's {x} module.",
               "Is {x} part of the Python standard library, and what does it do?"],
}  # fmt: skip
QA_SUFFIXES = ["", "", "", " Answer in one sentence.", " Keep it short.", " Just the answer, please."]


def cities() -> list[str]:
    """City names from the time zone database (the stdlib's zoneinfo; none without tzdata)."""
    try:
        import zoneinfo

        zones = zoneinfo.available_timezones()
    except Exception:  # no tzdata on this machine
        return []
    out = {z.split("/")[-1].replace("_", " ") for z in zones if z.count("/") == 1 and z.split("/")[0] in
           ("Europe", "Asia", "Africa", "America", "Australia")}  # fmt: skip
    return sorted(c for c in out if c.isascii() and c[:1].isupper())


def qa_entities(split: str) -> list[tuple[str, str]]:
    """(kind, entity) pairs of `split`; cities and stdlib modules only for training (they depend
    on the machine's tzdata and Python)."""
    fixed = (
        [("country", x) for x in COUNTRIES]
        + [("element", x) for x in ELEMENTS]
        + [("person", x) for x in PEOPLE]
        + [("invention", x) for x in INVENTIONS]
        + [("animal", x) for x in ANIMALS]
    )
    if split == "train":
        mods = sorted(m for m in getattr(sys, "stdlib_module_names", ()) if not m.startswith("_"))
        fixed += [("city", c) for c in cities()] + [("module", m) for m in mods]
    return [(k, x) for k, x in fixed if split_of(f"qa:{x}") == split]


def qa_prompt(rnd: random.Random, split: str) -> tuple[str, str, str]:
    kind, x = rnd.choice(qa_entities(split))
    return f"qa:{x}", rnd.choice(QA_TEMPLATES[kind]).format(x=x) + rnd.choice(QA_SUFFIXES), x


# ------------------------------------------------------------------------ maths word problems
NAMES = ["Amira", "Ben", "Chen", "Dana", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemi", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Yuki"]  # fmt: skip
ITEMS = ["apples", "pencils", "stickers", "cookies", "marbles", "books", "oranges", "cupcakes", "stamps", "eggs"]


def _n(rnd, a, b):
    return rnd.randint(a, b)


# each template: (id, lambda rnd -> text); the id decides the split (held out by template)
def _math_templates():
    return [
        ("buy", lambda r, p, q, i: f"{p} buys {_n(r, 2, 9)} {i} at ${_n(r, 2, 12)} each and pays with a "
         f"${r.choice([50, 100])} note. How much change does {p} get?"),
        ("share", lambda r, p, q, i: f"{p} has {_n(r, 24, 120)} {i} and shares them equally among {_n(r, 3, 8)} "
         "friends. How many does each friend get, and how many are left over?"),
        ("speed", lambda r, p, q, i: f"A train travels {_n(r, 60, 480)} km in {_n(r, 2, 6)} hours. What is its "
         "average speed in km per hour?"),
        ("discount", lambda r, p, q, i: f"A jacket costs ${_n(r, 40, 200)}. It is on sale for {r.choice([10, 15, 20, 25, 30])}% "
         "off. What is the sale price?"),
        ("age", lambda r, p, q, i: f"{p} is {_n(r, 3, 9)} years older than {q}. In {_n(r, 2, 10)} years their ages "
         f"will add up to {_n(r, 40, 90)}. How old is {q} now?"),
        ("area", lambda r, p, q, i: f"A rectangular garden is {_n(r, 4, 30)} m long and {_n(r, 3, 20)} m wide. What is "
         "its area, and how much fencing goes around it?"),
        ("average", lambda r, p, q, i: f"{p} scored {_n(r, 50, 100)}, {_n(r, 50, 100)}, {_n(r, 50, 100)} and "
         f"{_n(r, 50, 100)} on four tests. What is the average score?"),
        ("work", lambda r, p, q, i: f"{p} can paint a fence in {_n(r, 2, 8)} hours and {q} in {_n(r, 3, 9)} hours. "
         "How long does it take them working together?"),
        ("interest", lambda r, p, q, i: f"{p} puts ${_n(r, 5, 50) * 100} in a savings account at {_n(r, 2, 6)}% simple "
         f"interest a year. How much interest is earned after {_n(r, 2, 5)} years?"),
        ("recipe", lambda r, p, q, i: f"A recipe for {_n(r, 2, 4)} people needs {_n(r, 150, 600)} g of flour. How much "
         f"flour is needed for {_n(r, 5, 12)} people?"),
        ("time", lambda r, p, q, i: f"A film starts at {_n(r, 1, 9)}:{r.choice(['05', '15', '30', '45'])} pm and lasts "
         f"{_n(r, 85, 175)} minutes. When does it end?"),
        ("equation", lambda r, p, q, i: f"Solve for x: {_n(r, 2, 9)}x + {_n(r, 1, 30)} = {_n(r, 31, 120)}. Show your steps."),
        ("arith", lambda r, p, q, i: f"What is {_n(r, 12, 99)} times {_n(r, 12, 99)}?"),
        ("arith2", lambda r, p, q, i: f"Calculate {_n(r, 100, 999)} + {_n(r, 100, 999)} - {_n(r, 10, 99)}."),
        ("fraction", lambda r, p, q, i: f"{p} eats {_n(r, 1, 3)}/8 of a pizza and {q} eats {_n(r, 1, 4)}/8. What fraction "
         "of the pizza is left?"),
        ("fuel", lambda r, p, q, i: f"A car uses {_n(r, 5, 9)} litres of fuel per 100 km. How much fuel does it need "
         f"for a {_n(r, 120, 900)} km trip?"),
        ("wage", lambda r, p, q, i: f"{p} earns ${_n(r, 12, 30)} an hour and works {_n(r, 15, 40)} hours a week. How much "
         f"does {p} earn in {_n(r, 2, 6)} weeks?"),
        ("boxes", lambda r, p, q, i: f"A shop packs {i} in boxes of {_n(r, 6, 24)}. It has {_n(r, 100, 900)} {i}. How many "
         "full boxes can it fill, and how many are left?"),
        ("percent", lambda r, p, q, i: f"In a class of {_n(r, 20, 35)} students, {_n(r, 5, 19)} walk to school. What "
         "percentage of the class walks to school?"),
        ("convert", lambda r, p, q, i: f"How many minutes are there in {_n(r, 2, 9)} hours and {_n(r, 5, 55)} minutes?"),
    ]  # fmt: skip


MATH_SUFFIXES = ["", "", " Explain your reasoning step by step.", " Show the calculation.", " Give just the number."]


def math_prompt(rnd: random.Random, split: str) -> tuple[str, str, str]:
    tid, make = rnd.choice([t for t in _math_templates() if split_of(f"math:{t[0]}") == split])
    p, q = rnd.sample(NAMES, 2)
    problem = make(rnd, p, q, rnd.choice(ITEMS))
    return f"math:{tid}", problem + rnd.choice(MATH_SUFFIXES), problem


# ------------------------------------------------------------------------ documents
SKIP_MODULES = {"this", "antigravity", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data", "site-packages"}


def _clean(text: str) -> str:
    """Paragraphs kept, each one line of single-spaced words."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paras if p)


def prose(text: str, share: float = 0.8) -> str:
    """The paragraphs of `text` that read as prose: letters and spaces at least `share` of them
    and not markup (a README's badges, HTML and link lists are dropped)."""
    keep = []
    for p in text.split("\n\n"):
        letters = sum(c.isalpha() or c == " " for c in p)
        if p and letters >= share * len(p) and not p.startswith(("<", "..", "|", "[!", "![")):
            keep.append(p)
    return "\n\n".join(keep)


def stdlib_doc(path: Path) -> str:
    """A stdlib module as a document: its docstring, then each public top-level class or
    function's docstring under its name (parsed, not imported)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError):
        return ""
    parts = [ast.get_docstring(tree) or ""]
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(f"{node.name}: {doc}")
    return _clean("\n\n".join(p for p in parts if p))


def _stdlib_paths() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[0] not in SKIP_MODULES and not any(x.startswith(("_", "test")) for x in parts):
            out.append((f"stdlib:{'.'.join(parts)}", p))
    return out


def _man_text(path: Path) -> str:
    """A man page's prose, troff requests and font escapes dropped (crude, for training only)."""
    try:
        raw = gzip.open(path, "rt", errors="replace").read() if path.suffix == ".gz" else path.read_text()
    except (OSError, EOFError, ValueError):
        return ""
    lines = []
    for line in raw.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith("."):
            req, _, rest = line.partition(" ")
            line = "\n" if req in (".PP", ".P", ".LP", ".SH", ".SS", ".TP", ".IP") else ""
            line += re.sub(r'"', "", rest) if req in (".SH", ".SS", ".B", ".I", ".BR", ".IR") else ""
        lines.append(re.sub(r"\\f[A-Z1-9P]|\\\(..|\\[-e&|^]", "", line).replace("\\", ""))
    return _clean("\n".join(lines))


def _package_texts() -> list[tuple[str, object]]:
    """(id, loader) of installed distributions' READMEs (METADATA body) and licence files."""
    from importlib import metadata

    out = []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower()):
        name = (dist.metadata.get("Name") or "").lower()
        if not name:
            continue
        out.append((f"readme:{name}", lambda d=dist: d.metadata.get_payload() or ""))
        for f in dist.files or []:
            if re.match(r"(LICEN[CS]E|COPYING)", Path(str(f)).name, re.I):
                out.append((f"pkglicense:{name}:{Path(str(f)).name}", lambda d=dist, f=f: d.read_text(str(f)) or ""))
    return out


FAMILY_WEIGHTS = {"stdlib": 0.35, "pydoc": 0.2, "readme": 0.2, "license": 0.1, "man": 0.15}


@lru_cache(maxsize=2)
def document_sources(split: str) -> dict:
    """{family: ((id, loader), ...)} of the documents of `split`, loaded when drawn. Held out:
    stdlib modules only; training: those plus pydoc topics, licences (/usr/share/common-licenses
    and installed packages'), package READMEs and man pages."""
    fams = {"stdlib": [(i, lambda p=p: stdlib_doc(p)) for i, p in _stdlib_paths()]}
    if split == "train":
        topics = pydoc_topics()
        fams["pydoc"] = [(f"pydoc:{k}", lambda k=k: _clean(topics[k])) for k in sorted(topics)]
        fams["license"] = [
            (f"license:{p.name}", lambda p=p: _clean(p.read_text(errors="replace")))
            for p in sorted(Path("/usr/share/common-licenses").glob("*"))
            if p.is_file() and not p.is_symlink()
        ]
        pkg = _package_texts()
        fams["readme"] = [(i, lambda f=f: prose(_clean(f()))) for i, f in pkg if i.startswith("readme:")]
        fams["license"] += [(i, lambda f=f: _clean(f())) for i, f in pkg if i.startswith("pkglicense:")]
        fams["man"] = [
            (f"man:{p.name}", lambda p=p: _man_text(p))
            for sec in ("man1", "man5", "man7", "man8")
            for p in sorted(Path("/usr/share/man", sec).glob("*"))
        ]
    return {f: tuple((i, g) for i, g in items if split_of(i) == split) for f, items in fams.items() if items}


@lru_cache(maxsize=512)
def load_document(split: str, source_id: str) -> str:
    family = source_id.split(":")[0].replace("pkglicense", "license")
    return dict(document_sources(split)[family])[source_id]()


def draw_document(rnd: random.Random, split: str, min_chars: int) -> tuple[str, str]:
    """-> (id, text) of a document of `split` with at least `min_chars` characters: a family by
    FAMILY_WEIGHTS (among those this machine has), then a document of it (shorter draws are
    skipped; at most 200 tries)."""
    fams = document_sources(split)
    names = sorted(fams)
    for _ in range(200):
        fam = rnd.choices(names, weights=[FAMILY_WEIGHTS[f] for f in names])[0]
        i, _f = rnd.choice(fams[fam])
        text = load_document(split, i)
        if len(text) >= min_chars:
            return i, text
    raise RuntimeError(f"no {split} document of {min_chars}+ characters on this machine")


def excerpt(text: str, rnd: random.Random, lo: int, hi: int) -> str:
    """Whole paragraphs of `text` from a random one on, up to about `hi` characters (>= lo where
    the text has it; a paragraph longer than hi is cut at a sentence end)."""
    paras = text.split("\n\n")
    tail = [sum(len(p) for p in paras[k:]) for k in range(len(paras))]
    starts = [k for k in range(len(paras)) if tail[k] >= lo] or [0]  # from there on it has lo
    start = rnd.choice(starts) if tail[0] > hi else 0
    out, size = [], 0
    for p in paras[start:]:
        if size + len(p) > hi and size >= lo:
            break
        if len(p) > hi:
            cut = p[:hi]
            p = cut[: cut.rfind(". ") + 1] or cut
        out.append(p)
        size += len(p) + 2
    return "\n\n".join(out)


SUMMARY_TASKS = [
    "Summarise the following document.\n\n{d}",
    "Write a summary of this text in one paragraph:\n\n{d}",
    "{d}\n\nSummarise the text above in five bullet points.",
    "Give me a TL;DR of this:\n\n{d}",
    "Read the following and summarise its main ideas for a newcomer.\n\n{d}",
    "Here is a document:\n\n{d}\n\nWhat are the key points? Be concise.",
    "Summarize this article in three sentences.\n\n---\n{d}\n---",
    "Write an executive summary of the document below, then list any warnings it gives.\n\n{d}",
]


def long_summary_prompt(rnd: random.Random, split: str) -> tuple[str, str, str]:
    """A long document (~1,500-4,200 characters: ~400-1,100 tokens) to summarise."""
    i, text = draw_document(rnd, split, 1500)
    doc = excerpt(text, rnd, 1500, rnd.randint(2500, 4200))
    return i, rnd.choice(SUMMARY_TASKS).format(d=doc), doc


# ------------------------------------------------------------------------ grounded answers
STOP = set(
    "about above after again against also because been before being below between both could does doing "
    "during each from further have having here into itself more most must only other over same should "
    "some such than that their them then there these they this those through under until very what when "
    "where which while will with would your returns return value values function object objects".split()
)
QUESTIONS = [
    "What do the passages say about {t}?",
    "According to the context, how is {t} used?",
    "Based only on the documents above, explain what {t} is.",
    "Which passage mentions {t}? Quote the relevant sentence and explain it.",
    "Using the text provided, what is the role of {t}?",
    "What does the source say happens with {t}?",
]
GROUNDED = [
    "Answer the question using only the passages below.\n\n{p}\n\nQuestion: {q}",
    "Context:\n{p}\n\nQuestion: {q}\nAnswer from the context only; say so if it does not contain the answer.",
    "Here are some search results:\n\n{p}\n\n{q} Cite the document you used.",
    "Read these excerpts and answer the question that follows.\n\n{p}\n\n{q}",
    "{q}\n\nUse the following retrieved passages:\n\n{p}",
]


def key_term(passage: str, others: list[str], rnd: random.Random) -> str:
    """A word of `passage` (5+ letters, not a common word) that the other passages lack, frequent
    in it; falls back to any long word."""
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_.]{4,}", passage)
    rest = " ".join(others).lower()
    cands = [w.strip(".") for w in words if w.lower() not in STOP and w.lower() not in rest]
    pool = cands or [w for w in words if w.lower() not in STOP] or ["this"]
    counts = {w: pool.count(w) for w in pool}
    top = sorted(counts, key=lambda w: (-counts[w], w))[:5]
    return rnd.choice(top)


def retrieval_prompt(rnd: random.Random, split: str) -> tuple[str, str, str]:
    """3-5 passages (paragraphs of 2-3 documents of `split`, shuffled), a question about a term of
    one of them."""
    docs = [draw_document(rnd, split, 800) for _ in range(rnd.randint(2, 3))]
    passages = []
    for _i, text in docs:
        paras = [p for p in text.split("\n\n") if 200 <= len(p) <= 900] or [text[:900]]
        passages += rnd.sample(paras, min(len(paras), rnd.randint(1, 2)))
    passages = passages[:5]
    rnd.shuffle(passages)
    answer = rnd.randrange(len(passages))
    term = key_term(passages[answer], passages[:answer] + passages[answer + 1 :], rnd)
    style = rnd.randrange(3)
    if style == 0:
        block = "\n\n".join(f"[{k + 1}] {p}" for k, p in enumerate(passages))
    elif style == 1:
        block = "\n\n".join(f"Document {k + 1}:\n{p}" for k, p in enumerate(passages))
    else:
        block = "\n---\n".join(passages)
    q = rnd.choice(QUESTIONS).format(t=term)
    return docs[0][0], rnd.choice(GROUNDED).format(p=block, q=q), "\n\n".join(passages)


# ------------------------------------------------------------------------ the streams
MAKERS = {
    "translation": translation_prompt,
    "qa": qa_prompt,
    "math": math_prompt,
    "long_summary": long_summary_prompt,
    "retrieval": retrieval_prompt,
}


def make_prompt(kind: str, rnd: random.Random, split: str) -> dict:
    """{kind, source (the item that decides the split), text (the request), content (the text
    the item put in it: a sentence, an entity, a problem, a document or passages)}."""
    source, text, content = MAKERS[kind](rnd, split)
    return {"kind": kind, "source": source, "text": text, "content": content}


def heldout_set(per_kind: int = 10, seed: int = 0) -> list[dict]:
    """The per-kind held-out prompts: `per_kind` of each kind, from held-out sources only, none
    repeated; ids `KIND-N`."""
    out = []
    for kind in KINDS:
        rnd, seen = random.Random(f"heldout:{seed}:{kind}"), set()
        while len([p for p in out if p["kind"] == kind]) < per_kind:
            p = make_prompt(kind, rnd, "heldout")
            if p["text"] not in seen:
                seen.add(p["text"])
                out.append({"id": f"{kind}-{len(seen) - 1}", **p})
    return out


def benchmark_prompts(per_kind: int = 4, seed: int = 1) -> list[dict]:
    """Prompts for an end-to-end benchmark of these kinds, never in a training corpus (held-out
    sources; seed 1: other draws than the held-out set's)."""
    return heldout_set(per_kind, seed)


@lru_cache(maxsize=1)
def kept_apart() -> frozenset:
    """6-word runs no training prompt may share: the content of the per-kind held-out set and
    benchmark prompts (their sentences, problems, documents and passages: the request frames are
    shared by both splits, the items are not), the whole chat held-out set and the packaged and
    long benchmark prompts."""
    from arborspec.tools.prompts import heldout_prompts_path, read_prompts_file

    texts = [p["content"] for p in heldout_set() + benchmark_prompts()]
    paths = [heldout_prompts_path(), None, Path(__file__).resolve().parents[2] / "benchmarks" / "long_prompts.json"]
    for path in paths:
        if path is None or Path(path).is_file():
            texts += [e.get("text", "") for e in read_prompts_file(path)[0]]
    return frozenset().union(*(shingles(t) for t in texts))


SHARES = {"translation": 0.2, "qa": 0.2, "math": 0.2, "long_summary": 0.2, "retrieval": 0.2}


def train_prompt(i: int, seed: int = 0) -> dict:
    """The i-th training prompt of the kinds stream (a function of i and the seed alone, so a
    resumed corpus continues it): a kind drawn by SHARES, then a prompt of that kind from
    train-split sources that shares no 6-word run with `kept_apart()` (redrawn until it does not)."""
    rnd = random.Random(f"kinds:{seed}:{i}")
    kind = rnd.choices(list(SHARES), weights=list(SHARES.values()))[0]
    apart = kept_apart()
    for _ in range(50):
        p = make_prompt(kind, rnd, "train")
        if not shingles(p["text"]) & apart:
            return p
    raise RuntimeError(f"kinds: no training prompt of kind {kind} clear of the held-out set at index {i}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.train.kinds",
        description="Print prompts of the kinds stream (training), the per-kind held-out set or benchmark prompts.",
        epilog="examples:\n  python -m arborspec.tools.train.kinds train --first 0 -n 5\n"
        "  python -m arborspec.tools.train.kinds heldout --out /tmp/heldout_kinds.json\n"
        "  python -m arborspec.tools.train.kinds benchmark --per-kind 4 --out /tmp/bench_kinds.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("what", choices=("train", "heldout", "benchmark"))
    p.add_argument("--first", type=int, default=0, help="train: the first prompt index (default 0)")
    p.add_argument("-n", type=int, default=10, help="train: how many prompts (default 10)")
    p.add_argument("--per-kind", type=int, default=None, help="heldout/benchmark: prompts per kind (10 / 4)")
    p.add_argument("--seed", type=int, default=0, help="the stream's seed (default 0)")
    p.add_argument("--out", type=Path, default=None, help="write a prompts file (JSON, chat: true) here")
    a = p.parse_args(argv)
    if a.n < 1 or a.first < 0 or (a.per_kind is not None and a.per_kind < 1):
        print("error: -n and --per-kind must be >= 1, --first >= 0", file=sys.stderr)
        return 2
    if a.what == "train":
        rows = [{"id": f"train-{i}", **train_prompt(i, a.seed)} for i in range(a.first, a.first + a.n)]
    elif a.what == "heldout":
        rows = heldout_set(a.per_kind or 10, a.seed)
    else:
        rows = benchmark_prompts(a.per_kind or 4, a.seed + 1)
    doc = {"chat": True, "prompts": rows}
    if a.out is None:
        print(json.dumps(doc, indent=1, ensure_ascii=False))
    else:
        from arborspec.runtime.fileio import atomic_write_json

        atomic_write_json(a.out, doc)
        print(f"wrote {a.out} ({len(rows)} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
