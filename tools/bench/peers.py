"""Peers measured next to arborspec in `arborspec bench`: ONNX Runtime GenAI and llama.cpp, on
the same prompt token ids, greedy.

Role in one decode step: none; these are what a CPU user would run instead of arborspec.

- ort-genai / ort-genai-int4: a model built by onnxruntime-genai's model builder
  (`python -m onnxruntime_genai.models.builder -p fp32|int4 -e cpu`, its default options) from a
  Hugging Face folder: the export's source folder, or for a GGUF source the folder transformers
  writes from it (`from_pretrained(dir, gguf_file=...)` + the tokenizer's `save_pretrained`).
  Built once, cached under `$ARBORSPEC_CACHE/peers/` (default ~/.cache/arborspec/peers), keyed by
  the source's sha256 and size, the precision and the GenAI version; built in a temporary folder
  and renamed into place.
- ort-genai-ngram / ort-genai-int4-ngram: the same models with GenAI's own speculative mode,
  n-gram lookup (`GeneratorParams.set_speculative_options(ngram_size=2, max_draft_tokens=K)`,
  K = --hf-lookup-tokens, at most 16).
- llama-cpp / llama-cpp-lookup: llama-cpp-python on the source GGUF (no conversion), greedy
  (temp 0), n_threads = the cores this process may use; -lookup adds its prompt-lookup draft
  `LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=K)`. At --temperature T > 0
  llama.cpp samples at T with bench's --top-k / --top-p cut (none by default) and no min-p; its
  sampler chain cuts before it scales by T (top-k, top-p, then temp: llama-cpp-python 0.3.36),
  ours and transformers' after, so at T != 1 with a top-p cut its nucleus is another set of tokens
  (the same cost); its seed set to --seed; GenAI runs greedy only and is skipped there.
- llama-server, llama-server-ngram-mod / -ngram-simple / -ngram-map-k, llama-server-eagle3 (-n2):
  llama.cpp's own server and speculative modes, built from llama-cpp-python's sdist
  (tools/bench/llama_server.py).

Fairness: the prompt token ids are ours, fed as ids (no text, no chat template in the peer).
Generation stops where ours stops: the same eos ids (GenAI: the model config's eos list is
replaced by ours; llama.cpp: its stop is ignored and we stop on our eos ids), min_length 0.
When there are no eos ids (a tokenizer-less model) ours generates exactly N tokens, so GenAI
gets min_length = max_length (which masks its eos token: where that token would have been the
argmax, the tokens disagree, and the agreement count shows it). Peers run greedy only
(temperature 0) except llama.cpp (above). Timing: prefill = until the first new token is out (model call on the prompt
+ its token), decode = the rest, tokens/s = (new tokens - 1) / decode time, as for hf-*.
Target calls: GenAI's own counters (speculative verify/re-anchor passes + plain steps) for the
n-gram mode, one per token otherwise; llama.cpp: calls to `Llama.eval` (one per verify).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arborspec.runtime.fileio import PartialFolder
from arborspec.tools.bench.baselines import hf_source_path
from arborspec.tools.bench.peer_base import PeerUnavailable, _cut_at_eos, _one_line, _run_dict, pkg_version  # noqa: F401

# llama.cpp's own server, plain and with its speculative modes (tools/bench/llama_server.py: SERVER_SPECS),
# each also as NAME-repack-on / NAME-repack-off (weight repacking forced on / off)
LLAMA_SERVER_PEERS = (
    "llama-server",
    "llama-server-ngram-mod",
    "llama-server-ngram-simple",
    "llama-server-ngram-map-k",
    "llama-server-eagle3",
    "llama-server-eagle3-n2",
)
LLAMA_SERVER_NAMES = tuple(n + sfx for n in LLAMA_SERVER_PEERS for sfx in ("", "-repack-on", "-repack-off"))
# OpenVINO GenAI on the same GGUF, plain and with its prompt lookup (tools/bench/openvino_peer.py)
OPENVINO_PEERS = ("openvino", "openvino-lookup")
PEERS = (
    (
        "ort-genai",
        "ort-genai-int4",
        "ort-genai-ngram",
        "ort-genai-int4-ngram",
        "llama-cpp",
        "llama-cpp-lookup",
    )
    + LLAMA_SERVER_NAMES
    + OPENVINO_PEERS
)
GENAI_PKG = "onnxruntime-genai"
LLAMA_PKG = "llama-cpp-python"
BUILD_FORMAT = 1  # bump when the way a GenAI model is built here changes


def peer_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _import(module: str, pkg: str, extra: str = "peers"):
    try:
        return importlib.import_module(module)
    except ImportError as e:  # not installed, or installed but broken (a missing shared library)
        if pkg_version(pkg) is None:
            raise PeerUnavailable(f"{pkg} is not installed (pip install 'arborspec[{extra}]')") from None
        raise PeerUnavailable(f"{pkg} {pkg_version(pkg)} is installed but does not import ({_one_line(e)})") from None


# ---------------------------------------------------------------------------------- GenAI
def genai_precision(name: str) -> str:
    return "int4" if "-int4" in name else "fp32"


def _source_key(mdir: Path, gguf: str | None) -> tuple[str, int]:
    """(sha256, bytes) of the model source: the GGUF file, or the folder's weight files."""
    from arborspec.models.registry import file_sha256

    if gguf:  # file_sha256 remembers the hash per (path, size, mtime): hashed once per file
        f = mdir / gguf
        return file_sha256(f), f.stat().st_size
    files = sorted(p for p in mdir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not files:
        raise PeerUnavailable(f"{mdir}: no weight files (.safetensors/.bin) to build a GenAI model from")
    sha = hashlib.sha256("".join(f"{p.name}:{file_sha256(p)}\n" for p in files).encode()).hexdigest()
    return sha, sum(p.stat().st_size for p in files)


def _gguf_to_hf(mdir: Path, gguf: str, out: Path) -> None:
    """The Hugging Face folder transformers writes from a GGUF (dequantised to fp32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(mdir), gguf_file=gguf, dtype=torch.float32, local_files_only=True)
    # the weights are dequantised: drop the GGUF quantiser so the folder is a plain fp32 checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(mdir), gguf_file=gguf, local_files_only=True).save_pretrained(str(out))
    del model


def genai_cache_root() -> Path:
    from arborspec.models.registry import cache_dir

    return cache_dir() / "peers"


def _hf_folder_for_builder(mdir: Path, gguf, work: Path, log) -> Path:
    """The Hugging Face folder the GenAI model builder reads: the source's own, or (a GGUF) one
    transformers writes under `work`."""
    if not gguf:
        return mdir
    hf_dir = work / "hf"
    log(f"writing a Hugging Face folder from {gguf} for the GenAI model builder ...")
    try:
        _gguf_to_hf(mdir, gguf, hf_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; one line is the contract
        raise PeerUnavailable(f"transformers cannot convert {gguf} to a Hugging Face folder ({_one_line(e)})") from None
    return hf_dir


def _build_genai_model(hf_dir: Path, built: Path, prec: str, work: Path, version: str, source: dict) -> None:
    """Run the GenAI model builder for `prec` into `built`, and record how (arborspec_peer.json,
    with `source`: the model's path, sha256 and bytes)."""
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf_dir),
        "-o",
        str(built),
        "-p",
        prec,
        "-e",
        "cpu",
        "-c",
        str(work / "cache"),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0 or not (built / "genai_config.json").is_file():
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise PeerUnavailable(
            f"the GenAI model builder failed for {prec} (exit {r.returncode}: {lines[-1] if lines else 'no output'})"
        )
    (built / "arborspec_peer.json").write_text(
        json.dumps(
            {
                "format": BUILD_FORMAT,
                "builder": "onnxruntime_genai.models.builder",
                GENAI_PKG: version,
                "transformers": pkg_version("transformers"),
                "precision": prec,
                "command": ["python"] + cmd[1:4] + ["HF_DIR", "-o", "OUT", "-p", prec, "-e", "cpu"],
                "source": source,
                "build_s": round(time.perf_counter() - t0, 1),
            },
            indent=1,
        )
    )


def genai_model_dirs(source: dict, precisions: list[str], log=None) -> dict[str, Path]:
    """precision -> a folder with a GenAI model of the source (built once, then cached)."""
    log = log or (lambda s: print(s, file=sys.stderr))
    version = pkg_version(GENAI_PKG)
    mdir, gguf, why = hf_source_path(source)
    if mdir is None:
        raise PeerUnavailable(why)
    if not gguf and not any((mdir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise PeerUnavailable(f"the GenAI model builder needs a tokenizer in {mdir} (no tokenizer.json)")
    sha, size = _source_key(mdir, gguf)
    root = genai_cache_root()
    out: dict[str, Path] = {}
    todo = []
    for prec in precisions:
        entry = root / f"ort-genai-{version}-{prec}-{sha[:16]}-{size}-v{BUILD_FORMAT}"
        out[prec] = entry
        if not (entry / "genai_config.json").is_file():
            todo.append(prec)
    if not todo:
        return out
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    recorded = {"path": str(((mdir / gguf) if gguf else mdir).resolve()), "sha256": sha, "bytes": size}
    try:
        hf_dir = _hf_folder_for_builder(mdir, gguf, work, log)
        for prec in todo:
            entry = out[prec]
            with PartialFolder(entry) as built:  # renamed into place once the build is complete
                log(f"building the ONNX Runtime GenAI {prec} model (once; cached in {entry}) ...")
                _build_genai_model(hf_dir, built, prec, work, version, recorded)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


class GenAIRunner:
    """One GenAI model (fp32 or int4); plain greedy, or with GenAI's n-gram speculation."""

    def __init__(self, model_dir: Path, threads: int, eos: list[int], lookup_tokens: int = 10, ngram_size: int = 2):
        og = _import("onnxruntime_genai", GENAI_PKG)
        self.og = og
        self.np = importlib.import_module("numpy")
        self.eos = list(eos)
        self.lookup_tokens = max(1, min(int(lookup_tokens), 16))  # GenAI accepts 1..16
        self.ngram_size = ngram_size
        overlay: dict = {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}
        if self.eos:  # stop where our runtime stops (the same eos ids)
            overlay["model"]["eos_token_id"] = self.eos
            overlay["model"]["pad_token_id"] = self.eos[0]
        try:
            cfg = og.Config(str(model_dir))
            cfg.overlay(json.dumps(overlay))
            t0 = time.perf_counter()
            self.model = og.Model(cfg)
            self.load_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - GenAI raises RuntimeError with multi-line text
            raise PeerUnavailable(f"ONNX Runtime GenAI cannot load {model_dir} ({_one_line(e)})") from None
        self.model_dir = model_dir
        self.threads = threads

    def describe(self, name: str) -> dict:
        d = {
            "model_dir": str(self.model_dir),
            "intra_op_num_threads": self.threads,
            "eos": self.eos,
            "search": "greedy (do_sample false), min_length 0"
            if self.eos
            else "greedy, min_length = max_length (no eos ids)",
        }
        if name.endswith("-ngram"):
            d["speculative_options"] = {"ngram_size": self.ngram_size, "max_draft_tokens": self.lookup_tokens}
        try:
            d["build"] = json.loads((self.model_dir / "arborspec_peer.json").read_text())
        except (OSError, ValueError):
            pass
        return d

    def run(self, kind: str, prompt: list[int], n: int, eos: list[int], temperature: float, seed: int, **_cut) -> dict:
        og, np = self.og, self.np  # greedy only (open_peers skips it at temperature > 0): no cut to apply
        if eos and list(eos) != self.eos:
            raise PeerUnavailable(f"{kind}: the model was opened for eos ids {self.eos}, asked for {list(eos)}")
        total = len(prompt) + n
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=total, do_sample=False, min_length=0 if eos else total)
        ngram = kind.endswith("-ngram")
        if ngram:
            params.set_speculative_options(ngram_size=self.ngram_size, max_draft_tokens=self.lookup_tokens)
        t0 = time.perf_counter()
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(prompt, dtype=np.int32))
        toks: list[int] = []
        t1 = None
        while not gen.is_done() and len(toks) < n:
            gen.generate_next_token()
            toks += [int(x) for x in gen.get_next_tokens()]
            if t1 is None:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        t1 = t1 or t2
        toks, stop = _cut_at_eos(toks[:n], list(eos))
        stats = None
        calls = len(toks)
        if ngram:
            s = gen.get_speculative_stats()
            keys = (
                "rounds",
                "target_forward_passes",
                "standard_fallback_steps",
                "draft_tokens_proposed",
                "draft_tokens_accepted",
                "acceptance_rate",
                "mean_emitted_tokens_per_round",
            )
            stats = {k: s.get(k) for k in keys}
            calls = int(s.get("target_forward_passes", 0)) + int(s.get("standard_fallback_steps", 0)) or len(toks)
        del gen
        r = _run_dict(toks, t1 - t0, t2 - t1, calls, stats)
        r["stop_reason"] = stop
        return r


# ---------------------------------------------------------------------------------- llama.cpp
class LlamaCppRunner:
    """llama-cpp-python on the source GGUF: greedy, optionally with its prompt-lookup draft."""

    def __init__(
        self,
        gguf_path: Path,
        threads: int,
        n_ctx: int,
        lookup: bool,
        lookup_tokens: int = 10,
        temperature: float = 0.0,
        logits_all: bool = False,
    ):
        llama_cpp = _import("llama_cpp", LLAMA_PKG)
        self.lookup = lookup
        self.temperature = temperature
        self.lookup_tokens = lookup_tokens
        kw = {"logits_all": True} if logits_all else {}  # logits_all: scores for every position (perplexity)
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kw["draft_model"] = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=lookup_tokens)
            # a draft turns on logits for every position, but llama-cpp-python 0.3.36 sizes its
            # logits buffer from this argument (n_batch rows when False): prompts longer than
            # n_batch then fail ("could not broadcast ... into shape (0,)"); measured on SmolLM2
            kw["logits_all"] = True
        t0 = time.perf_counter()
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(gguf_path),
                n_threads=threads,
                n_threads_batch=threads,
                n_ctx=n_ctx,
                n_batch=min(512, n_ctx),
                verbose=False,
                **kw,
            )
        except Exception as e:  # noqa: BLE001 - llama-cpp-python raises ValueError/RuntimeError
            raise PeerUnavailable(f"llama.cpp cannot load {gguf_path} ({_one_line(e)})") from None
        self.load_s = time.perf_counter() - t0
        self.gguf_path = gguf_path
        self.threads = threads
        self.n_ctx = n_ctx
        self._calls = 0
        inner = self.llm.eval

        def counted_eval(tokens):  # one llama.cpp decode call per eval (prompt: per n_batch chunk)
            self._calls += 1
            return inner(tokens)

        self.llm.eval = counted_eval

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()

    def describe(self, name: str) -> dict:
        d = {
            "gguf": str(self.gguf_path),
            "n_threads": self.threads,
            "n_ctx": self.n_ctx,
            "sampling": "temp 0 (greedy), repeat_penalty 1"
            if not self.temperature
            else f"temp {self.temperature:g} with bench's --top-k / --top-p (0 / 1: none), min_p 0, repeat_penalty 1",
        }
        if self.lookup:
            d["draft"] = {"LlamaPromptLookupDecoding": {"max_ngram_size": 2, "num_pred_tokens": self.lookup_tokens}}
        return d

    def run(self, kind: str, prompt: list[int], n: int, eos: list[int], temperature: float, seed: int, **cut) -> dict:
        """cut: top_k, top_p, json_schema, gbnf: llama_sampler's, as llama-server gets them, in the
        Python binding's names (temp; the seed set on the model; the grammar compiled)."""
        from arborspec.tools.bench.llama_server import llama_sampler  # (imported before the clock starts)

        llm = self.llm
        llm.reset()  # no prefix reuse from the previous prompt: every run prefills its whole prompt
        self._calls = 0
        toks: list[int] = []
        t0 = time.perf_counter()
        t1 = None
        calls_at_first = 0
        sampling = llama_sampler(temperature, seed, **cut)
        sampling["temp"] = sampling.pop("temperature")
        if "seed" in sampling:
            llm.set_seed(sampling.pop("seed"))
        if "json_schema" in sampling or "grammar" in sampling:
            from llama_cpp import LlamaGrammar

            schema = sampling.pop("json_schema", None)
            sampling["grammar"] = (
                LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
                if schema is not None
                else LlamaGrammar.from_string(sampling["grammar"], verbose=False)
            )
        gen = llm.generate(list(prompt), reset=True, **sampling)
        for t in gen:
            toks.append(int(t))
            if t1 is None:
                t1 = time.perf_counter()
                calls_at_first = self._calls
            if len(toks) >= n or t in eos:
                break
        gen.close()
        t2 = time.perf_counter()
        t1 = t1 or t2
        toks, stop = _cut_at_eos(toks, list(eos))
        # target calls: the prompt's call(s) count as one, as for the other configurations
        calls = 1 + max(self._calls - calls_at_first, 0)
        r = _run_dict(toks, t1 - t0, t2 - t1, calls)
        r["stop_reason"] = stop
        return r


# ---------------------------------------------------------------------------------- opening
def open_peers(
    names: list[str],
    source: dict,
    *,
    eos: list[int],
    n_ctx: int,
    lookup_tokens: int,
    temperature: float,
    log=None,
    head_dir: Path | None = None,
    threads: int | None = None,
) -> tuple[dict, dict, dict]:
    """-> (runners {name: runner}, info {name: description}, skipped {name: one-line reason}).
    head_dir: the export's EAGLE-3 checkpoint folder (llama-server-eagle3). Runners with a
    `close()` (llama-server) are to be closed by the caller. threads: the peers' threads (None:
    the cores this process may use)."""
    log = log or (lambda s: print(s, file=sys.stderr))
    threads = threads or peer_threads()
    families = []  # each family's (runners, info, skipped)
    servers = [n for n in names if n in LLAMA_SERVER_NAMES]
    if servers:
        from arborspec.tools.bench.llama_server import open_servers

        families.append(open_servers(servers, source, head_dir=head_dir, n_ctx=n_ctx, threads=threads, log=log))
    ov = [n for n in names if n in OPENVINO_PEERS]
    if ov:
        from arborspec.tools.bench.openvino_peer import open_openvino

        families.append(
            open_openvino(ov, source, eos=eos, lookup_tokens=lookup_tokens, temperature=temperature, threads=threads)
        )
    genai = [n for n in names if n.startswith("ort-genai")]
    if genai and temperature > 0:
        families.append(
            ({}, {}, {n: "ONNX Runtime GenAI runs greedy only in bench (use --temperature 0)" for n in genai})
        )
    elif genai:
        families.append(_open_genai(genai, source, threads, eos, lookup_tokens, log))
    lcpp = [n for n in names if n.startswith("llama-cpp")]
    if lcpp:
        families.append(_open_llama_cpp(lcpp, source, threads, n_ctx, lookup_tokens, temperature))
    runners, info, skipped = {}, {}, {}
    for r, i, sk in families:
        runners.update(r)
        info.update(i)
        skipped.update(sk)
    return runners, info, skipped


def _open_genai(genai: list[str], source: dict, threads, eos, lookup_tokens, log) -> tuple[dict, dict, dict]:
    """open_peers' ONNX Runtime GenAI runners (one per precision) -> (runners, info, skipped)."""
    runners, info, skipped = {}, {}, {}
    try:
        _import("onnxruntime_genai", GENAI_PKG)
        precs = sorted({genai_precision(n) for n in genai})
        dirs = genai_model_dirs(source, precs, log)
        by_prec: dict[str, GenAIRunner] = {}
        for prec in precs:
            try:
                by_prec[prec] = GenAIRunner(dirs[prec], threads, eos, lookup_tokens)
            except PeerUnavailable as e:
                for n in genai:
                    if genai_precision(n) == prec:
                        skipped[n] = str(e)
        for n in genai:
            r = by_prec.get(genai_precision(n))
            if r is not None:
                runners[n] = r
                info[n] = {"package": GENAI_PKG, "version": pkg_version(GENAI_PKG), **r.describe(n)}
    except PeerUnavailable as e:
        for n in genai:
            skipped.setdefault(n, str(e))
    return runners, info, skipped


def _open_llama_cpp(
    lcpp: list[str], source: dict, threads, n_ctx, lookup_tokens, temperature
) -> tuple[dict, dict, dict]:
    """open_peers' llama-cpp-python runners (the source's GGUF) -> (runners, info, skipped)."""
    runners, info, skipped = {}, {}, {}
    try:
        _import("llama_cpp", LLAMA_PKG)
        mdir, gguf, why = hf_source_path(source)
        if mdir is None:
            raise PeerUnavailable(why)
        if not gguf:
            raise PeerUnavailable(f"llama.cpp needs a GGUF file; the model source is a Hugging Face folder ({mdir})")
        for n in lcpp:
            try:
                r = LlamaCppRunner(mdir / gguf, threads, n_ctx, n.endswith("-lookup"), lookup_tokens, temperature)
                runners[n] = r
                info[n] = {"package": LLAMA_PKG, "version": pkg_version(LLAMA_PKG), **r.describe(n)}
            except PeerUnavailable as e:
                skipped[n] = str(e)
    except PeerUnavailable as e:
        for n in lcpp:
            skipped.setdefault(n, str(e))
    return runners, info, skipped
