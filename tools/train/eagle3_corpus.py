"""The EAGLE-3 training corpus: the target's own responses to a varied prompt mix, the draft
vocabulary chosen from their token frequencies (FR-Spec), and the target's features and
next-token distributions over them. Built in shards that are appended, never rebuilt: a run
adds shards until it has the tokens asked for or its time is up, and the next run continues
where it stopped (a killed run loses at most the shard it was building).

Role in one decode step: none; it makes the data `arborspec train-draft` trains a head on.

Layout of a corpus (a folder in the user cache, keyed by the target and the settings that
shape its rows; the corpus size is not in the key: a later run with more tokens grows it):
    settings.json                    the key's settings
    vocab.npy      int64 [Vd]        draft id -> target id (given, or FR-Spec over shard 0)
    target_features.onnx             the target's graph with features (kept for the next run)
    corpus.json    progress: shards, windows, tokens, next prompt index, timings (atomic)
    shards/NNNNN/  one shard, written into a temp folder and renamed:
      tokens.npy     int32 [N, W]      windows of W tokens (documents joined by EOS)
      features.npy   float16 [N, W, F] the target's hidden states entering the aux layers
      top_ids.npy    int32 [N, W, K]   the target's top-K next tokens per row, draft ids (-1:
                                       the token is outside the draft vocabulary)
      top_lp.npy     float16 [N, W, K] their log-probs (normalised over the full vocabulary)
      top1.npy       int32 [N, W]      the target's greedy next token (target ids)
      shard.json     prompts [first, end) (the seed base of "self" shards), prompt_source,
                     prompt_texts (the requests the target wrote), tokens, timings
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import PartialFolder, atomic_write, atomic_write_json
from arborspec.tools.train.text_sources import pydoc_topics, shingles  # noqa: F401

# ------------------------------------------------------------------------ prompt mix
# Kept apart from the packaged benchmark prompts (tools/data/prompts.json) and from the held-out
# prompts (tools/data/heldout_prompts.json; tests/tools/test_eagle3_train.py checks both).
TOPICS = [
    "photosynthesis",
    "the water cycle",
    "volcanoes",
    "black holes",
    "the French Revolution",
    "compound interest",
    "machine learning",
    "the immune system",
    "plate tectonics",
    "jazz music",
    "the printing press",
    "climate change",
    "honey bees",
    "the Roman Empire",
    "electric cars",
    "sleep",
    "the internet",
    "coffee",
    "chess openings",
    "recycling",
    "the moon landing",
    "vaccines",
    "earthquakes",
    "the stock market",
    "renewable energy",
    "ancient Egypt",
    "coral reefs",
    "public libraries",
    "bicycles",
    "the human heart",
    "rainforests",
    "glaciers",
    "solar panels",
    "democracy",
    "the Olympic Games",
    "origami",
    "volunteering",
    "gardening",
    "time management",
    "learning a new language",
    "bread baking",
    "marathon training",
    "submarines",
    "the periodic table",
    "lighthouses",
    "urban planning",
    "migratory birds",
    "the Silk Road",
    "nuclear fusion",
    "tea ceremonies",
    "wind turbines",
    "the human brain",
    "podcasts",
    "personal budgeting",
    "desert ecosystems",
    "the theory of evolution",
    "3D printing",
    "mountain climbing",
    "the Renaissance",
    "antibiotics",
    "remote work",
    "board games",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "merges two sorted lists",
    "counts the words in a text",
    "computes the factorial of n",
    "finds the largest element of a list",
    "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit",
    "reads a CSV file and prints the average of a column",
    "implements binary search",
    "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number",
    "flattens a nested list",
    "counts the vowels in a string",
    "sorts a dictionary by value",
    "validates an email address with a regular expression",
    "computes the GCD of two integers",
    "transposes a matrix",
    "generates all permutations of a list",
    "parses a date string",
    "counts how often each character occurs in a string",
    "rotates a list by k positions",
    "checks whether two strings are anagrams",
    "computes the running average of a stream of numbers",
    "converts a Roman numeral to an integer",
    "finds the longest common prefix of a list of strings",
    "implements a stack with push and pop",
    "splits a list into chunks of size n",
]
LANGS = ["Python", "JavaScript", "C", "Rust", "Go", "a shell script"]
CHAT_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Give me a list of five tips related to {t}.",
    "Write a haiku about {t}.",
    "What is the history of {t}?",
    "Describe the advantages and disadvantages of {t}.",
    "Write a short story that involves {t}.",
    "How would you teach {t} to a beginner?",
    "Write an email to a friend about {t}.",
    "Summarize what you know about {t} in two sentences.",
    "Write a blog post introduction about {t}.",
    "What are common misconceptions about {t}?",
    "Compare {t} and {u} in a few sentences.",
    "Write a short dialogue between two people discussing {t}.",
    "Give a one-paragraph explanation of {t} for a busy manager.",
    "Write three quiz questions about {t}, with answers.",
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Show me how to write code in {lang} that {task}, with comments.",
    "Explain step by step how a program that {task} works, then write it in {lang}.",
]


INSTRUCTION_TEMPLATES = [
    'Rewrite this sentence in a more formal tone: "{s}"',
    'Translate into simple English for a child: "{s}"',
    'Turn this note into a polite email: "{s}"',
    'Give three ways to say this more concisely: "{s}"',
    'Fix the grammar of this sentence and explain the changes: "{s}"',
]
NOTES = [
    "we gotta move the meeting cause the room is booked",
    "the report is late again and nobody told me why",
    "pls send me the slides before friday thx",
    "i think the new design looks kinda cluttered",
    "cant make it tonight, my car broke down",
    "the printer on floor two is out of paper again",
    "can u check if the invoice got paid",
    "this app keeps crashing when i open the camera",
]
PASSAGE_TEMPLATES = [
    "Summarize the following text in two sentences:\n\n{p}",
    "Summarize this paragraph as three bullet points:\n\n{p}",
    "What is the main point of this text?\n\n{p}",
    "List every technical term that appears in the following text:\n\n{p}",
    "Extract the rules this text states, one per line:\n\n{p}",
    "Write one question that this text answers, and answer it:\n\n{p}",
]


@lru_cache(maxsize=1)
def passages() -> tuple[str, ...]:
    """Prose paragraphs already on this machine (Python's documentation topics), 250-700
    characters, for the summarisation and extraction prompts."""
    topics = pydoc_topics()
    out = []
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            s = " ".join(para.split())
            letters = sum(c.isalpha() or c == " " for c in s)
            if 250 <= len(s) <= 700 and "::=" not in s and letters > 0.9 * len(s):
                out.append(s)
    return tuple(out)


def prompt_at(i: int, seed: int) -> str:
    """The i-th training prompt (a function of i alone, so a resumed corpus continues the
    stream): explanations, lists, stories, comparisons, rewrites, code, summaries, extraction."""
    rnd = random.Random(seed * 1_000_003 + i)
    kind = rnd.random()
    paras = passages()
    if kind < 0.45:
        t, u = rnd.sample(TOPICS, 2)
        return rnd.choice(CHAT_TEMPLATES).format(t=t, u=u)
    if kind < 0.7:
        return rnd.choice(CODE_TEMPLATES).format(lang=rnd.choice(LANGS), task=rnd.choice(CODE_TASKS))
    if kind < 0.8 or not paras:
        return rnd.choice(INSTRUCTION_TEMPLATES).format(s=rnd.choice(NOTES))
    return rnd.choice(PASSAGE_TEMPLATES).format(p=rnd.choice(paras))


# The prompt sources a shard may draw from (not a key setting: runs may differ; shard.json names
# its source). "templates": prompt_at's stream. "self": requests the target writes itself.
# "kinds": translation, short QA, maths, long-document summaries, grounded answers (kinds.py's
# train_prompt stream, a function of the prompt index like prompt_at's).
PROMPT_SOURCES = ("self", "templates", "kinds")
PROMPT_ROOM = 1280  # prompt tokens a features graph holds besides a response (long documents)
_MARK = "\u2063QUERY\u2063"  # a placeholder no template contains


def query_prefix(tok) -> list[int] | None:
    """The chat template's tokens up to where a user's message starts (system turn included), or
    None for a target without a chat template. Sampled from there, an instruction-tuned target
    writes a user's request (Magpie, Xu et al. 2024)."""
    if not tok.meta.get("chat_template"):
        return None
    text = tok.apply_chat([{"role": "user", "content": _MARK}])
    if _MARK not in text:
        return None
    return tok.encode(text.split(_MARK)[0], add_bos=False)


@lru_cache(maxsize=1)
def kept_apart_shingles() -> frozenset:
    """6-word runs (lowercased) of the held-out prompts and the benchmark prompts: a request the
    target writes that shares one is not used for training."""
    from arborspec.tools.prompts import heldout_prompts_path, read_prompts_file

    texts = [e.get("text", "") for path in (heldout_prompts_path(), None) for e in read_prompts_file(path)[0]]
    return frozenset().union(*(shingles(t) for t in texts))


# What half of the self-written requests start with (the target continues each, Magpie-style):
# the kinds users send that the target rarely writes unprompted. Its free requests are nearly all
# advice questions ("I'm considering a career change..."), while users also send code, texts to
# summarise and data to extract (2/3 of the held-out set). Passage openers end in a blank line:
# the target writes the passage too. None shares a 6-word run with the held-out or benchmark
# prompts (tested); a request whose continuation does is dropped like any other.
OPENER_SHARE = 0.5
CODE_LANGS = ["Python", "JavaScript", "TypeScript", "Java", "C++", "Go", "Rust", "C#"]
REQUEST_OPENERS = [
    "Write a {lang} function to",
    "Implement in {lang} a",
    "I have this {lang} code and it does not work:\n\n",
    "What does this {lang} snippet do?\n\n",
    "Refactor this {lang} code to be more readable:\n\n",
    "Write tests in {lang} for",
    "Write a SQL query to",
    "Write a shell command that",
    "How do I use a regular expression to",
    "Summarise this article for me:\n\n",
    "Give me a short summary of this email:\n\n",
    "Condense the following report into three bullet points:\n\n",
    "Pull out every name and date from this text:\n\n",
    "Convert this information into a JSON object:\n\n",
    "Make a table from the following data:\n\n",
    "Here are my meeting notes. What are the next steps?\n\n",
    "Rewrite this email so it sounds friendlier:\n\n",
    "Proofread this paragraph:\n\n",
    "Is this customer review positive or negative?\n\n",
    "Answer the question using only this passage:\n\n",
]


# What a quarter of a self-prompted shard's requests are: one of these tasks over a passage, the
# passage one of the target's own greedy responses of the shard before (`shard.json`
# "passages"; one cut at gen_len up to its last whole sentence). Users send texts to summarise,
# rewrite and extract from, and the answers copy from them: on the held-out set 19% of the
# response tokens continue a bigram of the prompt, and the head agreed with the target on only
# 0.33 of those where the target itself was >= 0.9 sure (0.74 on the others); the corpus's
# responses copied 8% (free requests) to 16% (openers).
PASSAGE_SHARE = 0.25
PASSAGE_MIN_WORDS = 40
PASSAGE_TASKS = [
    "Sum up this text in two or three sentences:",
    "Give the main points of the text below as a bulleted list:",
    "Rewrite the following so that it is shorter and clearer:",
    "Pull every name, number and date out of this text and say what each one is:",
    "Fix the grammar and spelling in this text and return it corrected:",
    "Turn this into a short email to a colleague:",
    "What is this text about? Answer in one sentence, then quote the sentence that matters most:",
    "Make a two-column table of the terms in this text and what they mean:",
    "Explain this text to a twelve-year-old:",
    "Write three questions a reader could answer from this text, with the answers:",
    "Convert the key facts of this text into JSON:",
    "Which claims in this text would need a source? List them word for word:",
]


def whole_sentences(text: str, ended: bool) -> str:
    """`text` stripped; one that did not end (cut at a length) up to its last sentence end (. ! or
    ? before white space or the end), or "" if it has none."""
    text = text.strip()
    if ended:
        return text
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[: ends[-1]] if ends else ""


def passage_requests(answers: list[str], n: int, seed: int) -> list[str]:
    """Up to n requests, each a PASSAGE_TASKS line, a blank line and one of `answers` (drawn
    with `seed`; those under PASSAGE_MIN_WORDS words, or sharing a 6-word run with the held-out or
    benchmark prompts, are not used; none used twice)."""
    apart = kept_apart_shingles()
    rnd = random.Random(seed)
    usable = sorted({t for t in answers if len(t.split()) >= PASSAGE_MIN_WORDS})
    requests = [f"{rnd.choice(PASSAGE_TASKS)}\n\n{t}" for t in rnd.sample(usable, len(usable))]
    return [r for r in requests if not shingles(r) & apart][:n]


def request_openers() -> list[str]:
    """Every opener with every language filled in (what the tests check against the held-out set)."""
    return sorted({o.format(lang=lang) for o in REQUEST_OPENERS for lang in CODE_LANGS})


def self_prompts(generate, tok, n: int, seed: int, max_len: int = 160) -> list[str]:
    """Up to n user requests written by the target itself: 1.5n samples (temperature 1, top-p
    0.95) from the chat template's user turn (query_prefix), an OPENER_SHARE of them continuing a
    REQUEST_OPENERS line (the request is the opener + what the target wrote), kept when the target
    ended the turn (EOS within max_len tokens), the text has 3 words or more, repeats none kept
    before, and shares no 6-word run with the held-out or benchmark prompts. `generate`: a
    ResponseGenerator."""
    prefix = query_prefix(tok)
    eos = set(tok.meta.get("eos_token_ids") or [])
    if prefix is None or not eos:
        return []
    rnd = random.Random(seed)
    starts = []
    for _ in range(n + (n + 1) // 2):
        opener = rnd.choice(REQUEST_OPENERS).format(lang=rnd.choice(CODE_LANGS)) if rnd.random() < OPENER_SHARE else ""
        starts.append(tok.encode(opener, add_bos=False) if opener else [])
    outs = generate([prefix + s for s in starts], max_len, eos, 1.0, seed, top_p=0.95)
    apart, kept = kept_apart_shingles(), []
    for s, o in zip(starts, outs):
        if not o or o[-1] not in eos:
            continue  # cut off: not a whole request
        text = tok.decode(s + o[:-1], skip_special_tokens=True).strip()
        if len(text.split()) >= 3 and text not in kept and not shingles(text) & apart:
            kept.append(text)
    return kept[:n]


def chat_ids(tok, text: str) -> list[int]:
    """A user message in the target's chat template (plain text without one)."""
    if tok.meta.get("chat_template"):
        return tok.encode(tok.apply_chat([{"role": "user", "content": text}]), add_bos=False)
    return tok.encode(text)


def ort_options(threads: int | None):
    """Session options for the corpus's own ONNX Runtime sessions: `threads` intra-op threads
    (None: ONNX Runtime's default, all cores)."""
    import onnxruntime as ort

    from arborspec.runtime.backends.ort_loader import new_session_options

    so = new_session_options(ort)
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    return so


def log(msg: str) -> None:
    """One progress line on stderr (with the time): what a background run's log file shows."""
    print(time.strftime("%H:%M:%S ") + msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ generation
def feature_engine(loaded, aux_layers: list[int], device: str, cuda_graphs: bool = False):
    """The target in PyTorch on `device` (a GPU: `train-draft --device cuda`), returning the hidden
    states entering `aux_layers` as its features: the same numbers as the ONNX Runtime features
    graph (tested), for machines where that graph does not run (its fp32 GroupQueryAttention has
    no CUDA kernel). cuda_graphs: calls of up to 128 tokens (the generator's batched steps)
    replayed as CUDA graphs; the 512-token feature windows run eagerly."""
    import copy

    from arborspec.runtime.backends.torch_backend import TorchEngine

    m = copy.deepcopy(loaded.module).float().eval()
    m.feature_layers = list(aux_layers)
    return TorchEngine(m, device=device, cuda_graphs=cuda_graphs)


def open_engine(source, threads: int | None):
    """-> (engine, owned): a features graph's path opens an ONNX Runtime engine on the CPU (closed
    by the caller of this function); an engine (feature_engine) is used as it is."""
    if isinstance(source, (str, Path)):
        from arborspec.runtime.backends.onnxruntime import OrtEngine

        return OrtEngine(Path(source), session_options=ort_options(threads) if threads else None), True
    return source, False


class ResponseGenerator:
    """The target's continuations of many prompts, batched: the runtime's `BatchDecoder` over the
    target (continuous batching, one verify call per step for up to `batch` sequences), vanilla
    decoding. `source`: the ONNX Runtime features graph (each row over its own length; about 15x
    the tokens/s of a padded torch loop on 2 cores, SmolLM2-135M: 280 tok/s at 32 rows) or an
    engine (feature_engine on a GPU)."""

    def __init__(self, source, batch: int, threads: int | None = None):
        from arborspec.runtime.batch_decode import BatchDecoder

        self.engine, self._owned = open_engine(source, threads)
        self.decoder = BatchDecoder(self.engine, None, mode="vanilla", max_batch=batch)

    def __call__(
        self, prompts: list[list[int]], max_new: int, eos: set[int], temperature, seed: int, top_p=1.0
    ) -> list[list[int]]:
        """temperature 0: greedy; else sampled (seed + row; top_p < 1: nucleus); one for every
        prompt or a list, one per prompt (greedy and sampled rows then share the batch: one wave
        of continuous batching instead of two). -> the new tokens per prompt (up to and
        including EOS)."""
        from arborspec.runtime.sampling import SamplingParams

        temps = list(temperature) if isinstance(temperature, (list, tuple)) else [temperature] * len(prompts)
        sp = [SamplingParams(temperature=t, top_p=top_p) if t > 0 else None for t in temps]
        seqs = self.decoder.generate_many(prompts, max_new, sorted(eos), sp, [seed + i for i in range(len(prompts))])
        return [list(s.tokens) for s in seqs]

    def close(self) -> None:
        self.decoder.close()
        if self._owned:
            self.engine.close()


def target_graph(module, cfg, window: int, aux_layers: list[int], path: Path) -> Path:
    """The target's GQA graph with the `hidden_states` output (generates the responses and
    computes the features; written to a temp name and renamed, so a cached one is whole)."""
    from arborspec.export.gqa_graph import build_gqa_model, save_model
    from arborspec.export.onnx_export import _finalize, contract_metadata
    from arborspec.runtime.contract import META_RAGGED_ROWS

    tmp = path.with_name(f".{path.stem}.{os.getpid()}.onnx")  # onnx writes by path: renamed when whole
    save_model(build_gqa_model(module.float(), window, feature_layers=aux_layers), tmp)
    meta = contract_metadata(cfg, "fp32", None, "target", "gqa", "bhsd")
    meta[META_RAGGED_ROWS] = "1"  # seqlens_k from the mask: batched rows each over their own length
    _finalize(tmp, meta, False)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------ features
def draft_vocabulary(stream: np.ndarray, vocab_size: int, draft_vocab: int, always: list[int]) -> np.ndarray:
    """FR-Spec: the draft predicts over the `draft_vocab` most frequent tokens of the corpus
    (ties by id), plus `always` (EOS); returns target ids sorted by frequency."""
    return most_frequent(np.bincount(stream, minlength=vocab_size), draft_vocab, always)


def most_frequent(counts: np.ndarray, n: int, always: list[int] = ()) -> np.ndarray:
    """The `n` ids of largest count (ties by id), `always` first; target ids by frequency."""
    counts = np.asarray(counts, dtype=np.int64).copy()
    for t in always:
        counts[t] = counts.max() + 1
    return np.lexsort((np.arange(len(counts)), -counts))[:n].astype(np.int64)


def count_tokens(windows, vocab_size: int = 0) -> np.ndarray:
    """How often each token id occurs in `windows` (arrays of token ids, e.g. a corpus's shards)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for w in windows:
        c = np.bincount(np.asarray(w, dtype=np.int64).ravel())
        counts = np.pad(counts, (0, max(0, len(c) - len(counts))))
        counts[: len(c)] += c
    return counts


def token_counts(folder: Path, vocab_size: int = 0) -> np.ndarray:
    """How often each token id occurs in a corpus's windows (every finished shard)."""
    return count_tokens((np.load(d / "tokens.npy") for d in shard_dirs(folder)), vocab_size)


def revocabulary(counts: np.ndarray, n: int, tokenizer) -> np.ndarray:
    """A re-chosen draft vocabulary (`train-draft --revocab N`, `corpus_ids unpack --draft-vocab
    N`): the `n` most frequent tokens of a corpus's `counts`, the tokenizer's EOS always in."""
    return most_frequent(counts, n, list(tokenizer.meta.get("eos_token_ids") or []))


def build_features(
    source,
    windows: np.ndarray,
    vocab: np.ndarray,
    out: Path,
    topk: int,
    threads: int | None = None,
    rows: int | None = None,
) -> dict:
    """Run every window through the target (`source`: its ONNX Runtime graph with the
    `hidden_states` output, or a feature_engine); write features, the target's top-K over the
    draft vocabulary and its greedy token. rows: windows a call (default 8 on a GPU, where one
    512-token window a call left it launch-bound at ~22k tokens/s; 1 on the CPU)."""
    from arborspec.runtime.kvcache import KVCache

    eng, owned = open_engine(source, threads)
    dev = eng.device
    rows = rows or (8 if dev.type == "cuda" else 1)
    n, w = windows.shape
    f = eng.info.n_features
    feats = np.lib.format.open_memmap(out / "features.npy", "w+", np.float16, (n, w, f))
    top_ids = np.lib.format.open_memmap(out / "top_ids.npy", "w+", np.int32, (n, w, topk))
    top_lp = np.lib.format.open_memmap(out / "top_lp.npy", "w+", np.float16, (n, w, topk))
    top1 = np.lib.format.open_memmap(out / "top1.npy", "w+", np.int32, (n, w))
    vocab_t = torch.from_numpy(vocab).to(dev)
    caches = {}  # one cache per batch size (the last call of a shard may be smaller)
    mask = torch.ones(w, w, dtype=torch.bool, device=dev).tril()[None]
    pos = torch.arange(w, device=dev)[None]
    t0 = time.perf_counter()
    for i in range(0, n, rows):
        b = min(rows, n - i)
        if b not in caches:
            caches[b] = KVCache(eng.info.cache, w, b, dev)
        cache = caches[b]
        cache.reset()
        ids = torch.from_numpy(windows[i : i + b].astype(np.int64)).to(dev)
        logits, fe = eng.forward_features(ids, pos.expand(b, w), mask.expand(b, w, w), cache)
        lp = torch.log_softmax(logits.float(), -1)
        top1[i : i + b] = lp.argmax(-1).cpu().numpy()
        v, ix = torch.topk(lp[..., vocab_t], topk, dim=-1)
        top_ids[i : i + b] = ix.int().cpu().numpy()
        top_lp[i : i + b] = v.half().cpu().numpy()
        feats[i : i + b] = fe.half().cpu().numpy()
    for a in (feats, top_ids, top_lp, top1):
        a.flush()
    del feats, top_ids, top_lp, top1
    if owned:
        eng.close()
    return {"features_s": round(time.perf_counter() - t0, 1), "feature_size": f}


# ------------------------------------------------------------------------ corpus
def corpus_key(target_id: str, settings: dict) -> str:
    h = hashlib.sha256(json.dumps({"target": target_id, **settings}, sort_keys=True).encode())
    return h.hexdigest()[:20]


def target_id_of(loaded) -> str:
    src = getattr(loaded, "source", {}) or {}
    return str(src.get("sha256") or (src.get("checksums") or {}) or loaded.config.to_json())


def read_progress(folder: Path) -> dict:
    """corpus.json of a corpus folder ({} before its first shard)."""
    try:
        return json.loads((folder / "corpus.json").read_text())
    except (OSError, ValueError):
        return {}


def grow_lock(folder: Path):
    """The right to add shards to a corpus: (open lock file, None) for the one run that holds it
    (an exclusive flock on `grow.lock`, released when the file closes or the process dies), else
    (None, pid of the holder). Two runs may share a corpus (one growing it, one training on its
    finished shards), but only one adds shards and only that one sweeps unfinished shard folders:
    a run that swept another's folder in flight published a shard with nothing but its
    shard.json (measured 2026-11-26 with a corpus run and a training run side by side)."""
    import fcntl

    f = open(folder / "grow.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        return None, holder
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f, None


def corpus_settings(folder: Path) -> dict:
    """An existing corpus folder's settings (`train-draft --corpus`); one-line InputError if the
    folder is not a corpus (no settings.json / vocab.npy)."""
    try:
        settings = json.loads((folder / "settings.json").read_text())
        if not (folder / "vocab.npy").is_file():
            raise FileNotFoundError
        keys = ("gen_len", "window", "draft_vocab", "topk", "seed", "aux")
        if not all(k in settings for k in keys):
            raise ValueError
    except (OSError, ValueError):
        raise InputError(
            f"--corpus {folder}: not a train-draft corpus (it needs settings.json and vocab.npy, as "
            "~/.cache/arborspec/eagle3-corpus/<key>/ holds)"
        ) from None
    return settings


def shard_dirs(folder: Path) -> list[Path]:
    """The finished shards, in order (temp folders of a killed build are not among them)."""
    d = folder / "shards"
    return sorted(p for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []


FEATURE_FILES = ("features.npy", "top_ids.npy", "top_lp.npy", "top1.npy")  # what build_features writes


def featurised(shard: Path) -> bool:
    """Whether a finished shard holds its features, top-K and greedy tokens (a shard grown with
    `train-draft --defer-features`, or unpacked with `corpus_ids unpack --ids-only`, holds its
    token ids only until `featurise`)."""
    return all((shard / f).is_file() for f in FEATURE_FILES)


OPEN_END = 10**9  # the stop of `--shards N:` (to the end)


def shard_range(text: str) -> range:
    """`N:M` (shards N..M-1), `N:` (N to the end) or `N` (that shard alone) as a range of shard
    numbers; one-line InputError otherwise (`corpus_ids featurise --shards`, `train-draft --shards`)."""
    first, sep, last = text.partition(":")
    try:
        a = int(first)
        b = (int(last) if last else OPEN_END) if sep else a + 1
    except ValueError:
        a, b = -1, -1
    if a < 0 or b <= a:
        raise InputError(f"--shards {text!r}: give N:M (shards N to M-1), N: (N to the end) or N, with 0 <= N < M")
    return range(a, b)


def shards_text(shards: range) -> str:
    """A range of shard numbers as `--shards` takes it (`N:M`, or `N:` to the end)."""
    return f"{shards.start}:" if shards.stop >= OPEN_END else f"{shards.start}:{shards.stop}"


def in_shards(shard: Path, shards: range | None) -> bool:
    """Whether a shard folder (named by its number) is among `shards` (None: all)."""
    return shards is None or int(shard.name) in shards


def featurise(
    loaded,
    folder: Path,
    device: str = "cpu",
    threads: int | None = None,
    verbose: bool = True,
    lock=None,
    shards: range | None = None,
):
    """Give every shard of corpus `folder` that holds token ids only its features, top-K and
    greedy tokens (the target run again over its windows: ONNX Runtime on the CPU, PyTorch on a
    GPU), each shard republished whole and the progress written after each: an interrupted run
    resumes. lock: the caller's grow_lock (else taken here: a corpus one run grows is not
    featurised by another). shards: only these shard numbers (a CPU featurises the newest text
    a head has not seen in an hour, the whole corpus in several). -> how many shards it featurised."""
    own = lock is None
    if own:
        lock, holder = grow_lock(folder)
        if lock is None:
            raise InputError(f"another run (pid {holder}) is adding shards to {folder}: featurise it when it is done")
    settings, engine, done = corpus_settings(folder), None, 0
    try:
        todo = [d for d in shard_dirs(folder) if not featurised(d) and in_shards(d, shards)]
        if todo:
            vocab = np.load(folder / "vocab.npy")
            source = corpus_source(loaded, folder, settings["aux"], device)
            engine = None if isinstance(source, Path) else source
        for d in todo:
            info = json.loads((d / "shard.json").read_text())
            windows = np.load(d / "tokens.npy")
            with PartialFolder(d) as tmp:
                np.save(tmp / "tokens.npy", windows)
                feat = build_features(source, windows, vocab, tmp, settings["topk"], threads)
                atomic_write_json(tmp / "shard.json", {**info, **feat})
            prog = read_progress(folder)
            prog.update(
                features_s=round(prog.get("features_s", 0.0) + feat["features_s"], 1), feature_size=feat["feature_size"]
            )
            atomic_write_json(folder / "corpus.json", prog)
            done += 1
            if verbose:
                log(f"corpus: shard {d.name} featurised ({done}/{len(todo)}, {feat['features_s']} s; {folder})")
    finally:
        if engine is not None:
            engine.close()
        if own:
            lock.close()
    return done


def corpus_source(loaded, folder: Path, aux_layers: list[int], device: str, cuda_graphs: bool = False):
    """What runs the target over corpus `folder` (its windows, its generation, its held-out set):
    the folder's ONNX Runtime features graph on the CPU (a path), else one feature_engine on
    `device` (an engine: the caller closes it)."""
    if device == "cpu":
        return corpus_graph(loaded, folder)
    return feature_engine(loaded, aux_layers, device, cuda_graphs)


def corpus_graph(loaded, folder: Path) -> Path:
    """The target's features graph of a corpus folder (built on first use, then kept): context
    for a window or a chat prompt plus a response, whichever is longer."""
    path = folder / "target_features.onnx"
    if not path.is_file():
        s = json.loads((folder / "settings.json").read_text())
        loaded.module.eval()
        target_graph(loaded.module, loaded.config, graph_context(loaded.config, s), s["aux"], path)
    return path


def graph_context(cfg, settings: dict) -> int:
    """Positions the features graph holds: a window, or a chat prompt (up to PROMPT_ROOM tokens,
    a long document to summarise; longer prompts are skipped) plus a response, whichever is
    longer (the graph's RoPE tables: a longer context costs no time on shorter rows)."""
    return min(cfg.max_position, max(settings["window"], settings["gen_len"] + PROMPT_ROOM))


class Corpus:
    """A corpus folder being grown: `add_shard` generates the next `shard_prompts` responses,
    computes their features and appends them as one shard (atomically), then records the
    progress. Everything a later run needs to continue is on disk after each shard."""

    def __init__(
        self,
        loaded,
        aux_layers,
        root: Path,
        settings: dict,
        vocab,
        threads,
        batch,
        shard_prompts,
        device="cpu",
        first=0,
        cuda_graphs=False,
        prompt_source="templates",
        folder: Path | None = None,
        features: bool = True,
    ):
        self.loaded, self.aux, self.settings, self.threads, self.batch = loaded, aux_layers, settings, threads, batch
        self.device = device  # cpu: the ONNX Runtime features graph; else PyTorch on that device
        self.cuda_graphs = cuda_graphs  # that PyTorch target's calls replayed as CUDA graphs
        self.first = first  # the prompt index a new corpus starts at
        self._engine = None
        self.shard_prompts = shard_prompts  # not a setting: runs may differ
        self.prompt_source = prompt_source  # nor is this (PROMPT_SOURCES)
        self.features = features  # False: shards of token ids only, featurised later (featurise)
        # folder: an existing corpus given by path (its own settings.json), else the key's folder
        self.folder = folder if folder is not None else root / corpus_key(target_id_of(loaded), settings)
        self.folder.mkdir(parents=True, exist_ok=True)
        if folder is None:
            atomic_write_json(self.folder / "settings.json", settings)
        self.fixed_vocab = vocab
        self.generator = None

    def progress(self) -> dict:
        p = read_progress(self.folder)
        return p or {
            "shards": 0,
            "windows": 0,
            "tokens": 0,
            "generated_tokens": 0,
            "generated_responses": 0,
            "next_prompt": self.first,
            "generation_s": 0.0,
            "features_s": 0.0,
            "settings": self.settings,
        }

    def _source(self):
        """What runs the target: the corpus's features graph (CPU) or one feature_engine (GPU)."""
        if self._engine is None:
            self._engine = corpus_source(self.loaded, self.folder, self.aux, self.device, self.cuda_graphs)
        return self._engine

    def vocab(self, stream: np.ndarray | None = None) -> np.ndarray:
        """The draft vocabulary: fixed at the corpus's first shard (given, or FR-Spec over it)."""
        path = self.folder / "vocab.npy"
        if path.is_file():
            return np.load(path)
        cfg, tok = self.loaded.config, self.loaded.tokenizer
        eos = list(tok.meta.get("eos_token_ids") or [])
        if self.fixed_vocab is not None:
            v = np.asarray(self.fixed_vocab, dtype=np.int64)
        else:
            v = draft_vocabulary(stream, cfg.vocab_size, self.settings["draft_vocab"], eos)
        atomic_write(path, lambda f: np.save(f, v))
        return v

    def previous_passages(self, index: int) -> list[str]:
        """The greedy responses shard `index - 1` recorded as passages (none before it, or in a
        shard from before passages)."""
        if index == 0:
            return []
        try:
            info = json.loads((self.folder / "shards" / f"{index - 1:05d}" / "shard.json").read_text())
        except (OSError, ValueError):
            return []
        return [t for t in info.get("passages", []) if isinstance(t, str)]

    def _prompt_texts(self, index: int, first: int, n_prompts: int) -> tuple[str, list[str], list[str], int]:
        """Shard `index`'s prompts, prompt indices first.. (first + n_prompts): (their source, the
        texts, their kinds (kinds only), how many ask about the previous shard's passages (self only))."""
        s, tok = self.settings, self.loaded.tokenizer
        texts, n_passage = [], 0
        if self.prompt_source == "self":
            rseed = s["seed"] * 1_000_003 + first
            on_passages = passage_requests(self.previous_passages(index), int(n_prompts * PASSAGE_SHARE), rseed)
            texts = self_prompts(self.generator, tok, n_prompts - len(on_passages), rseed)
            if not texts:
                log("corpus: the target wrote no usable request (no chat template?): this shard uses the templates")
            elif on_passages:
                n_passage = len(on_passages)
                texts += on_passages
                random.Random(rseed).shuffle(texts)  # greedy and sampled halves both get some
        source = "self" if texts else "templates"
        kinds_of = []
        if self.prompt_source == "kinds":
            from arborspec.tools.train.kinds import train_prompt

            drawn = [train_prompt(i, s["seed"]) for i in range(first, first + n_prompts)]
            source, texts, kinds_of = "kinds", [p["text"] for p in drawn], [p["kind"] for p in drawn]
        if not texts:
            texts = [prompt_at(i, s["seed"]) for i in range(first, first + n_prompts)]
        return source, texts, kinds_of, n_passage

    def _responses(self, texts: list[str], kinds_of: list[str], first: int) -> dict:
        """The target's responses to `texts`, the first half greedy, the rest sampled at T = 0.7
        (row i's seed: seed + first + i), decoded together; prompts the graph cannot hold with
        gen_len more tokens are left out. Returns the token stream (prompt, response, separator per
        row), which prompts fitted, the greedy answers (the next shard's passages), the tokens each
        kind put in the stream, and the generated tokens and responses."""
        s, tok = self.settings, self.loaded.tokenizer
        eos = list(tok.meta.get("eos_token_ids") or [])
        sep = eos[0] if eos else 0
        limit = graph_context(self.loaded.config, s)
        half = len(texts) // 2
        rows = [(chat_ids(tok, t), 0.0 if i < half else 0.7) for i, t in enumerate(texts)]
        fits = [len(p) + s["gen_len"] <= limit for p, _ in rows]  # what the graph holds
        ids, temps = [p for (p, _), f in zip(rows, fits) if f], [t for (_, t), f in zip(rows, fits) if f]
        stream, gen_tokens, responses = [], 0, 0
        answers = []  # this shard's greedy responses: the next shard's passages
        outs = self.generator(ids, s["gen_len"], set(eos), temps, s["seed"] + first)
        row_kinds = [k for k, f in zip(kinds_of, fits) if f]  # the kinds of the rows asked
        kind_tokens: dict = {}  # tokens (prompt, response, separator) a kind put in the stream
        for r, (p_ids, temp, o) in enumerate(zip(ids, temps, outs)):
            stream += p_ids + o + [sep]
            if row_kinds:
                kind_tokens[row_kinds[r]] = kind_tokens.get(row_kinds[r], 0) + len(p_ids) + len(o) + 1
            gen_tokens += len(o)
            responses += 1
            if temp == 0.0 and o:  # an answer cut at gen_len ends at its last whole sentence
                done = o[-1] in eos
                answers.append(whole_sentences(tok.decode(o[:-1] if done else o, skip_special_tokens=True), done))
        return {
            "stream": stream,
            "fits": fits,
            "answers": answers,
            "kind_tokens": kind_tokens,
            "generated_tokens": gen_tokens,
            "responses": responses,
        }

    def add_shard(self) -> dict:
        s = self.settings
        prog = self.progress()
        first, n_prompts = prog["next_prompt"], self.shard_prompts
        if self.generator is None:
            self.generator = ResponseGenerator(self._source(), self.batch, self.threads)
        t0 = time.perf_counter()
        source, texts, kinds_of, n_passage = self._prompt_texts(prog["shards"], first, n_prompts)
        got = self._responses(texts, kinds_of, first)
        gen_tokens, fits, answers = got["generated_tokens"], got["fits"], got["answers"]
        gen_s = time.perf_counter() - t0
        arr = np.asarray(got["stream"], dtype=np.int64)
        vocab = self.vocab(arr)
        w = s["window"]
        n = len(arr) // w
        windows = arr[: n * w].reshape(n, w).astype(np.int32)
        index = prog["shards"]
        with PartialFolder(self.folder / "shards" / f"{index:05d}") as tmp:
            np.save(tmp / "tokens.npy", windows)
            feat = build_features(self._source(), windows, vocab, tmp, s["topk"], self.threads) if self.features else {}
            info = {
                "prompts": [first, first + n_prompts],
                "prompt_source": source,
                **({"prompt_texts": texts, "passage_requests": n_passage} if source == "self" else {}),
                **(
                    {
                        "prompt_texts": texts,
                        "prompt_kinds": kinds_of,
                        "prompts_too_long": fits.count(False),
                        "kind_tokens": dict(sorted(got["kind_tokens"].items())),
                    }
                    if source == "kinds"
                    else {}
                ),
                "passages": [t for t in answers if len(t.split()) >= PASSAGE_MIN_WORDS],
                "windows": int(n),
                "tokens": int(n * w),
                "generated_tokens": gen_tokens,
                "generation_s": round(gen_s, 1),
                **feat,
            }
            atomic_write_json(tmp / "shard.json", info)
        prog.update(
            shards=index + 1,
            windows=prog["windows"] + int(n),
            tokens=prog["tokens"] + int(n * w),
            generated_tokens=prog["generated_tokens"] + gen_tokens,
            generated_responses=prog["generated_responses"] + got["responses"],
            next_prompt=first + n_prompts,
            generation_s=round(prog["generation_s"] + gen_s, 1),
            features_s=round(prog.get("features_s", 0.0) + feat.get("features_s", 0.0), 1),
            window=w,
            draft_vocab=int(len(vocab)),
        )
        if feat:
            prog["feature_size"] = feat["feature_size"]
        atomic_write_json(self.folder / "corpus.json", prog)
        return prog

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
            self.generator = None
        self._engine = None


def new_corpus_settings(cfg, aux_layers, gen_len, window, draft_vocab, topk, seed, vocab) -> dict:
    """The settings that key a corpus (corpus_key): what its shards hold depends on each."""
    if draft_vocab > cfg.vocab_size:
        raise InputError(f"--draft-vocab {draft_vocab} exceeds the target's vocabulary ({cfg.vocab_size})")
    settings = {
        "gen_len": gen_len,
        "window": window,
        "draft_vocab": draft_vocab,
        "topk": topk,
        "seed": seed,
        "aux": list(aux_layers),
        "v": 3,
    }
    if vocab is not None:
        if len(vocab) != draft_vocab:
            raise InputError(f"the fixed draft vocabulary has {len(vocab)} ids, expected {draft_vocab}")
        settings["vocab_sha256"] = hashlib.sha256(np.asarray(vocab, dtype=np.int64).tobytes()).hexdigest()[:16]
    return settings


def _grown_corpus_settings(folder: Path, aux_layers: list[int]) -> dict:
    """The settings of the corpus `folder` that is grown as it is: its features must be of the
    layers the head reads."""
    settings = corpus_settings(folder)
    if settings["aux"] != list(aux_layers):
        raise InputError(
            f"the corpus {folder} holds the features of layers {settings['aux']}, the head reads {list(aux_layers)}"
        )
    return settings


def _grow_lock_or_none(folder: Path, tokens: int, total_tokens: int, minutes: float, verbose: bool):
    """The grow lock of `folder` where this run is to add shards (time given, fewer than
    `total_tokens`, no other run adding to it), its killed runs' unfinished shards removed; else
    None (saying why where verbose)."""
    if verbose and minutes > 0 and tokens >= total_tokens:  # time given, nothing to add: say why
        log(
            f"corpus: already {tokens} tokens >= --corpus-tokens {total_tokens}: no shard added "
            "(raise --corpus-tokens to grow it)"
        )
    if not (minutes > 0 and tokens < total_tokens):
        return None
    lock, holder = grow_lock(folder)
    if lock is None:
        if verbose:
            log(f"corpus: another run (pid {holder}) is adding shards to {folder}: this one adds none")
        return None
    for stale in folder.glob("shards/.*partial-*"):  # unfinished shards of killed runs
        shutil.rmtree(stale, ignore_errors=True)
    return lock


def _add_shards(corpus: Corpus, total_tokens: int, minutes: float, verbose: bool) -> None:
    """Add shards to `corpus` under its grow lock until it holds `total_tokens` or `minutes` are
    up (a shard started is finished); then close it and release the lock."""
    t0 = time.perf_counter()
    lock = None
    try:
        prog = corpus.progress()
        lock = _grow_lock_or_none(corpus.folder, prog["tokens"], total_tokens, minutes, verbose)
        while lock is not None and prog["tokens"] < total_tokens and (time.perf_counter() - t0) / 60 < minutes:
            prog = corpus.add_shard()
            if verbose:
                log(
                    f"corpus: shard {prog['shards']} done, {prog['tokens']} tokens in {prog['windows']} windows "
                    f"({prog['generated_responses']} responses; {corpus.folder})"
                )
    finally:
        corpus.close()
        if lock is not None:
            lock.close()  # releases the flock


def grow_corpus(
    loaded,
    aux_layers: list[int],
    *,
    root: Path,
    total_tokens: int,
    minutes: float,
    shard_prompts: int = 64,
    gen_len: int = 192,
    batch: int = 32,
    window: int = 512,
    draft_vocab: int = 8192,
    topk: int = 8,
    seed: int = 0,
    vocab: np.ndarray | None = None,
    threads: int | None = None,
    device: str = "cpu",
    first_prompt: int = 0,
    verbose: bool = True,
    cuda_graphs: bool = False,
    prompt_source: str = "templates",
    folder: Path | None = None,
    features: bool = True,
) -> Path:
    """Append shards to the corpus for this target and these settings until it holds
    `total_tokens` or `minutes` are up (a shard started is finished; 0: add none), and return
    its folder. vocab: a fixed draft vocabulary (target ids; a head being fine-tuned keeps its
    own), else FR-Spec over the first shard. device: "cpu" runs the target in ONNX Runtime, "cuda"
    in PyTorch on the GPU (the corpus is the same either way: its key does not name the device).
    first_prompt: where a NEW corpus starts in the prompt stream (prompt_at): past the prompts an
    earlier corpus used, so a head fine-tuned on it sees new text (a corpus that exists goes on
    from its own next prompt). cuda_graphs: on a GPU, the generator's calls replayed as graphs.
    prompt_source: where new shards' prompts come from (PROMPT_SOURCES): "templates", prompt_at's
    stream (index i -> prompt; its first 7,232 prompts hold 2,643 distinct ones, so half the greedy
    responses repeat one another), or "self", requests the target writes itself (self_prompts),
    new in each shard, or "kinds", translation, short QA, maths, long-document summaries and
    grounded answers (kinds.train_prompt, index i -> prompt); a corpus may hold shards of each. folder: grow THIS corpus (`train-draft
    --corpus`), whatever its settings (its settings.json and vocab.npy are used; the layer ids must
    be `aux_layers`), instead of the one these settings key: a head whose draft vocabulary was
    re-chosen (`--revocab`) keeps training on the corpus its predecessor made. features: False
    adds shards of token ids only (no features, top-K or greedy tokens: ~1.5x the tokens a minute
    on the CPU, where they take a third of a shard's time), for `featurise` or a GPU later."""
    if loaded.tokenizer is None:
        raise InputError("train-draft needs the target's tokenizer (to build the prompt mix)")
    if prompt_source not in PROMPT_SOURCES:
        raise InputError(f"prompt source must be one of {', '.join(PROMPT_SOURCES)}, got {prompt_source!r}")
    if folder is not None:
        settings, vocab = _grown_corpus_settings(folder, aux_layers), None
    else:
        settings = new_corpus_settings(loaded.config, aux_layers, gen_len, window, draft_vocab, topk, seed, vocab)
    corpus = Corpus(
        loaded,
        aux_layers,
        root,
        settings,
        vocab,
        threads,
        batch,
        shard_prompts,
        device,
        first_prompt,
        cuda_graphs,
        prompt_source,
        folder,
        features,
    )
    _add_shards(corpus, total_tokens, minutes, verbose)
    if not shard_dirs(corpus.folder):
        raise InputError(f"the corpus {corpus.folder} has no shard yet: give --corpus-minutes > 0")
    return corpus.folder
