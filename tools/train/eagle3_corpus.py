"""The EAGLE-3 training corpus: the target's own responses to a varied prompt mix plus text
already on this machine, the draft vocabulary chosen from its token frequencies (FR-Spec), and
the target's features and next-token distributions over it.

Role in one decode step: none; it makes the data `arborspec train-draft` trains a head on.

Layout of a built corpus (a folder in the user cache, keyed by the target and the settings;
built into a temp folder and renamed, so a killed build leaves nothing half-written):
    tokens.npy     int32 [N, W]      windows of W tokens (documents joined by EOS)
    features.npy   float16 [N, W, F] the target's hidden states entering the aux layers
    top_ids.npy    int32 [N, W, K]   the target's top-K next tokens per row, draft ids (-1: the
                                     token is outside the draft vocabulary)
    top_lp.npy     float16 [N, W, K] their log-probs (normalised over the full vocabulary)
    top1.npy       int32 [N, W]      the target's greedy next token (target ids)
    vocab.npy      int64 [Vd]        draft id -> target id (most frequent first)
    corpus.json    sizes, sources, timings
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from arborspec.runtime.errors import InputError
from arborspec.runtime.fileio import PartialFolder

# ------------------------------------------------------------------------ prompt mix
# Kept apart from the packaged benchmark prompts (tools/data/prompts.json): none of these
# templates or topics is used there.
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
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Show me how to write code in {lang} that {task}, with comments.",
    "Explain step by step how a program that {task} works, then write it in {lang}.",
]


def prompt_mix(n: int, seed: int) -> list[str]:
    """n varied user prompts: explanations, lists, stories, emails, code (chat-formatted later)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(rnd.choice(CODE_TEMPLATES).format(lang=rnd.choice(LANGS), task=rnd.choice(CODE_TASKS)))
        else:
            out.append(rnd.choice(CHAT_TEMPLATES).format(t=rnd.choice(TOPICS)))
    return out


def machine_text_files() -> list[Path]:
    """Text already on the machine, in a fixed order: Python's documentation topics (prose),
    the standard library's sources (code and docstrings), the licences (legal prose)."""
    std = Path(sysconfig.get_paths()["stdlib"])
    files = [std / "pydoc_data" / "topics.py"]
    files += sorted(p for p in std.glob("*.py") if p.stat().st_size > 4000)
    lic = Path("/usr/share/common-licenses")
    if lic.is_dir():
        files += sorted(p for p in lic.iterdir() if p.is_file())
    return [f for f in files if f.is_file()]


# ------------------------------------------------------------------------ generation
class ResponseGenerator:
    """The target's continuations of many prompts, batched: the runtime's `BatchDecoder` over an
    ONNX Runtime graph of the target (continuous batching, one verify call per step for up to
    `batch` sequences, each row over its own length), vanilla decoding. About 15x the tokens/s of
    a padded torch loop on 2 cores (SmolLM2-135M: 280 tok/s at 32 rows)."""

    def __init__(self, graph_path: Path, batch: int):
        from arborspec.runtime.backends.onnxruntime import OrtEngine
        from arborspec.runtime.batch_decode import BatchDecoder

        self.engine = OrtEngine(graph_path)
        self.decoder = BatchDecoder(self.engine, None, mode="vanilla", max_batch=batch)

    def __call__(
        self, prompts: list[list[int]], max_new: int, eos: set[int], temperature: float, seed: int
    ) -> list[list[int]]:
        """temperature 0: greedy; else sampled (seed + row). -> the new tokens per prompt (up to
        and including EOS)."""
        from arborspec.runtime.sampling import SamplingParams

        sp = SamplingParams(temperature=temperature) if temperature > 0 else None
        seqs = self.decoder.generate_many(prompts, max_new, sorted(eos), sp, [seed + i for i in range(len(prompts))])
        return [list(s.tokens) for s in seqs]

    def close(self) -> None:
        self.decoder.close()
        self.engine.close()


def target_graph(module, cfg, window: int, aux_layers: list[int], path: Path) -> Path:
    """The target's GQA graph with the `hidden_states` output (not shipped: it generates the
    responses and computes the features, then is deleted)."""
    from arborspec.export.gqa_graph import build_gqa_model, save_model
    from arborspec.export.onnx_export import _finalize, contract_metadata
    from arborspec.runtime.contract import META_RAGGED_ROWS

    save_model(build_gqa_model(module.float(), window, feature_layers=aux_layers), path)
    meta = contract_metadata(cfg, "fp32", None, "target", "gqa", "bhsd")
    meta[META_RAGGED_ROWS] = "1"  # seqlens_k from the mask: batched rows each over their own length
    _finalize(path, meta, False)
    return path


# ------------------------------------------------------------------------ corpus
def corpus_key(target_id: str, settings: dict) -> str:
    h = hashlib.sha256(json.dumps({"target": target_id, **settings}, sort_keys=True).encode())
    return h.hexdigest()[:20]


def build_token_stream(
    generate, tok, *, generated_tokens: int, total_tokens: int, gen_len: int, batch: int, seed: int, progress: bool
) -> tuple[list[int], dict]:
    """Documents as one token stream (EOS between them): generated responses first (chat
    template, half greedy, half sampled at T = 0.7), then machine text up to total_tokens."""
    from tqdm import tqdm

    eos_ids = list(tok.meta.get("eos_token_ids") or []) if tok is not None else []
    sep = eos_ids[0] if eos_ids else 0
    stream: list[int] = []
    stats = {"generated_tokens": 0, "generated_responses": 0, "machine_tokens": 0, "machine_files": 0}
    t0 = time.perf_counter()
    prompts = prompt_mix(max(1, generated_tokens // max(gen_len // 2, 1) + 2 * batch), seed)
    bar = tqdm(total=generated_tokens, desc="corpus: target responses", unit="tok", disable=None if progress else True)
    i = 0
    step = 2 * batch  # more prompts than rows: a finished row takes the next prompt at once
    while stats["generated_tokens"] < generated_tokens and i < len(prompts):
        chunk = prompts[i : i + step]
        ids = [
            tok.encode(tok.apply_chat([{"role": "user", "content": p}]), add_bos=False)
            if tok.meta.get("chat_template")
            else tok.encode(p)
            for p in chunk
        ]
        temp = 0.0 if (i // step) % 2 == 0 else 0.7
        outs = generate(ids, gen_len, set(eos_ids), temp, seed + i)
        for p_ids, o in zip(ids, outs):
            stream += p_ids + o + [sep]
            stats["generated_tokens"] += len(o)
            stats["generated_responses"] += 1
            bar.update(len(o))
        i += step
    bar.close()
    stats["generation_s"] = round(time.perf_counter() - t0, 1)
    for f in machine_text_files():
        if len(stream) >= total_tokens:
            break
        text = f.read_text(errors="replace")
        ids = tok.encode(text)
        take = ids[: total_tokens - len(stream)]
        stream += take + [sep]
        stats["machine_tokens"] += len(take)
        stats["machine_files"] += 1
    stats["total_tokens"] = len(stream)
    return stream, stats


def draft_vocabulary(stream: np.ndarray, vocab_size: int, draft_vocab: int, always: list[int]) -> np.ndarray:
    """FR-Spec: the draft predicts over the `draft_vocab` most frequent tokens of the corpus
    (ties by id), plus `always` (EOS); returns target ids sorted by frequency."""
    counts = np.bincount(stream, minlength=vocab_size).astype(np.int64)
    for t in always:
        counts[t] = counts.max() + 1
    order = np.lexsort((np.arange(vocab_size), -counts))
    return order[:draft_vocab].astype(np.int64)


def build_features(
    graph_path: Path, windows: np.ndarray, vocab: np.ndarray, out: Path, topk: int, progress: bool
) -> dict:
    """Run every window through the target's ONNX Runtime graph (with the `hidden_states`
    output); write features, the target's top-K over the draft vocabulary and its greedy token."""
    from tqdm import tqdm

    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.kvcache import KVCache

    eng = OrtEngine(graph_path)
    n, w = windows.shape
    f = eng.info.n_features
    feats = np.lib.format.open_memmap(out / "features.npy", "w+", np.float16, (n, w, f))
    top_ids = np.lib.format.open_memmap(out / "top_ids.npy", "w+", np.int32, (n, w, topk))
    top_lp = np.lib.format.open_memmap(out / "top_lp.npy", "w+", np.float16, (n, w, topk))
    top1 = np.lib.format.open_memmap(out / "top1.npy", "w+", np.int32, (n, w))
    to_draft = torch.full((eng.info.vocab_size,), -1, dtype=torch.long)
    to_draft[torch.from_numpy(vocab)] = torch.arange(len(vocab))
    vocab_t = torch.from_numpy(vocab)
    cache = KVCache(eng.info.cache, w, 1)
    mask = torch.ones(w, w, dtype=torch.bool).tril()[None]
    pos = torch.arange(w)[None]
    t0 = time.perf_counter()
    for i in tqdm(range(n), desc="corpus: target features", unit="window", disable=None if progress else True):
        cache.reset()
        logits, fe = eng.forward_features(torch.from_numpy(windows[i : i + 1].astype(np.int64)), pos, mask, cache)
        lp = torch.log_softmax(logits[0], -1)
        top1[i] = lp.argmax(-1).numpy()
        v, ix = torch.topk(lp[:, vocab_t], topk, dim=-1)
        top_ids[i] = ix.int().numpy()
        top_lp[i] = v.half().numpy()
        feats[i] = fe[0].half().numpy()
    for a in (feats, top_ids, top_lp, top1):
        a.flush()
    eng.close()
    return {"features_s": round(time.perf_counter() - t0, 1), "feature_size": f}


def build_corpus(
    loaded,
    aux_layers: list[int],
    *,
    root: Path,
    total_tokens: int,
    generated_tokens: int,
    gen_len: int,
    batch: int,
    window: int,
    draft_vocab: int,
    topk: int,
    seed: int,
    vocab: np.ndarray | None = None,
    progress: bool = True,
) -> Path:
    """Build (or find in the cache) the corpus folder for this target and these settings.
    vocab: a fixed draft vocabulary (target ids; a head being fine-tuned keeps its own), else
    FR-Spec over the corpus."""
    module, tok, cfg = loaded.module, loaded.tokenizer, loaded.config
    if tok is None:
        raise InputError("train-draft needs the target's tokenizer (to build the prompt mix and read text)")
    if draft_vocab > cfg.vocab_size:
        raise InputError(f"--draft-vocab {draft_vocab} exceeds the target's vocabulary ({cfg.vocab_size})")
    settings = {
        "total": total_tokens,
        "generated": generated_tokens,
        "gen_len": gen_len,
        "window": window,
        "draft_vocab": draft_vocab,
        "topk": topk,
        "seed": seed,
        "aux": aux_layers,
        "v": 2,  # v2: responses generated through ONNX Runtime, batched
    }
    if vocab is not None:
        if len(vocab) != draft_vocab:
            raise InputError(f"the fixed draft vocabulary has {len(vocab)} ids, expected {draft_vocab}")
        settings["vocab_sha256"] = hashlib.sha256(np.asarray(vocab, dtype=np.int64).tobytes()).hexdigest()[:16]
    src = getattr(loaded, "source", {}) or {}
    target_id = str(src.get("sha256") or (src.get("checksums") or {}) or cfg.to_json())
    key = corpus_key(target_id, settings)
    out = root / key
    if (out / "corpus.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with PartialFolder(out) as tmp:
        module.eval()
        ctx = min(cfg.max_position, max(window, gen_len + 256))  # chat prompts are < 256 tokens
        g = target_graph(module, cfg, ctx, aux_layers, tmp / "target_features.onnx")
        generate = ResponseGenerator(g, batch)
        try:
            stream, stats = build_token_stream(
                generate,
                tok,
                generated_tokens=generated_tokens,
                total_tokens=total_tokens,
                gen_len=gen_len,
                batch=batch,
                seed=seed,
                progress=progress,
            )
        finally:
            generate.close()
        arr = np.asarray(stream, dtype=np.int64)
        eos = list(tok.meta.get("eos_token_ids") or [])
        if vocab is None:
            vocab = draft_vocabulary(arr, cfg.vocab_size, draft_vocab, eos)
        n = len(arr) // window
        windows = arr[: n * window].reshape(n, window).astype(np.int32)
        np.save(tmp / "tokens.npy", windows)
        np.save(tmp / "vocab.npy", np.asarray(vocab, dtype=np.int64))
        stats.update(build_features(g, windows, vocab, tmp, topk, progress))
        g.unlink()
        covered = np.isin(arr, vocab).mean()
        stats.update(
            {
                "windows": int(n),
                "window": window,
                "draft_vocab": draft_vocab,
                "corpus_coverage_of_draft_vocab": round(float(covered), 4),
                "settings": settings,
            }
        )
        (tmp / "corpus.json").write_text(json.dumps(stats, indent=1))
    return out
