"""OpenVINO GenAI as a bench peer: Intel's own LLM stack on the same GGUF, plain and with its
prompt lookup.

Role in one decode step: none; this is what many users of Intel CPUs would run instead of
arborspec. `arborspec bench --baselines openvino,openvino-lookup` runs it on the export's source
GGUF (OpenVINO GenAI reads Q4_0, Q4_1, Q8_0, Q4_K, Q6_K GGUFs of the Llama and Qwen families
natively: no conversion step) and on the same prompt token ids as ours.

- openvino: `openvino_genai.LLMPipeline(gguf, "CPU", INFERENCE_NUM_THREADS=threads)`, greedy
  (do_sample false), the prompt as token ids (no chat template in the peer), our eos ids as its
  stop ids (none: ignore_eos, exactly N tokens, as ours).
- openvino-lookup: the same with `prompt_lookup=True` and GenerationConfig num_assistant_tokens =
  --hf-lookup-tokens, max_ngram_size = 2 (as llama-cpp-lookup and ort-genai-ngram).
- Timing: its own perf metrics: decode tokens/s = 1000 / `perf_metrics.get_tpot().mean` (ms per
  output token after the first: (tokens - 1) / time after the first token, as ours), prefill =
  `get_ttft()`; target calls = its raw metrics' steps (`m_batch_sizes`: tokens emitted per step).
- Greedy only: at --temperature > 0 it is skipped with one line; no structured output.
Not installed (pip install 'arborspec[openvino]') or a model it cannot read: one line each
(PeerUnavailable), and the bench goes on without it.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from arborspec.tools.bench.baselines import hf_source_path
from arborspec.tools.bench.peer_base import PeerUnavailable, _cut_at_eos, _one_line, _run_dict, pkg_version

OV_PKG = "openvino-genai"
NAMES = ("openvino", "openvino-lookup")
NGRAM = 2  # max_ngram_size of its prompt lookup, as the other lookup peers


def import_openvino_genai():
    try:
        return importlib.import_module("openvino_genai")
    except ImportError as e:  # not installed, or installed but broken (a missing shared library)
        if pkg_version(OV_PKG) is None:
            raise PeerUnavailable(f"{OV_PKG} is not installed (pip install 'arborspec[openvino]')") from None
        raise PeerUnavailable(
            f"{OV_PKG} {pkg_version(OV_PKG)} is installed but does not import ({_one_line(e)})"
        ) from None


def generation_options(name: str, n: int, eos: list[int], lookup_tokens: int) -> dict:
    """The GenerationConfig fields of one run: greedy, n new tokens, our eos ids as stop ids
    (none: ignore_eos), and for openvino-lookup the draft length and n-gram size."""
    if name not in NAMES:
        raise PeerUnavailable(f"unknown OpenVINO configuration {name!r} (expected {', '.join(NAMES)})")
    opts = {"max_new_tokens": int(n), "min_new_tokens": 0, "do_sample": False, "repetition_penalty": 1.0}
    if eos:
        opts.update(eos_token_id=int(eos[0]), stop_token_ids=set(int(t) for t in eos), ignore_eos=False)
    else:
        opts["ignore_eos"] = True
    if name == "openvino-lookup":
        opts.update(num_assistant_tokens=max(1, int(lookup_tokens)), max_ngram_size=NGRAM)
    return opts


def run_from_metrics(tokens: list[int], n: int, eos: list[int], tpot_ms: float, ttft_ms: float, steps: int) -> dict:
    """A bench run (peer_base._run_dict) from OpenVINO's perf metrics."""
    toks, stop = _cut_at_eos([int(t) for t in tokens][:n], list(eos))
    decode_s = max(len(toks) - 1, 0) * tpot_ms / 1e3
    calls = steps if steps else len(toks)
    r = _run_dict(toks, ttft_ms / 1e3, decode_s, calls, {"tpot_ms": tpot_ms, "ttft_ms": ttft_ms, "steps": steps})
    if len(toks) > 1 and tpot_ms > 0:
        r["tokens_per_s"] = 1e3 / tpot_ms  # its own: get_tpot() is (generate - ttft) / (tokens - 1)
    r["stop_reason"] = stop
    return r


class OpenVINORunner:
    """One LLMPipeline on the GGUF: plain, or with prompt lookup."""

    def __init__(self, name: str, gguf: Path, threads: int, eos: list[int], lookup_tokens: int):
        ov = import_openvino_genai()
        self.ov, self.name, self.gguf, self.threads = ov, name, gguf, threads
        self.eos, self.lookup_tokens = list(eos), lookup_tokens
        kw = {"INFERENCE_NUM_THREADS": int(threads)}
        if name == "openvino-lookup":
            kw["prompt_lookup"] = True
        t0 = time.perf_counter()
        try:
            self.pipe = ov.LLMPipeline(str(gguf), "CPU", **kw)
        except Exception as e:  # noqa: BLE001 - OpenVINO raises RuntimeError with multi-line text
            raise PeerUnavailable(f"OpenVINO GenAI cannot read {gguf.name} ({_one_line(e)})") from None
        self.load_s = time.perf_counter() - t0

    def describe(self, name: str) -> dict:
        d = {
            "package": OV_PKG,
            "version": pkg_version(OV_PKG),
            "gguf": str(self.gguf),
            "pipeline": f"LLMPipeline(gguf, 'CPU', INFERENCE_NUM_THREADS={self.threads}"
            + (", prompt_lookup=True)" if name == "openvino-lookup" else ")"),
            "generation": {k: sorted(v) if isinstance(v, set) else v for k, v in self._options(name, 1).items()},
            "timing": "decode tok/s = 1000 / perf_metrics.get_tpot().mean; prefill = get_ttft()",
            "load_s": round(self.load_s, 2),
        }
        d["generation"].pop("max_new_tokens")
        return d

    def _options(self, name: str, n: int) -> dict:
        return generation_options(name, n, self.eos, self.lookup_tokens)

    def run(self, kind: str, prompt: list[int], n: int, eos: list[int], temperature: float, seed: int, **_cut) -> dict:
        import numpy as np
        import openvino as ov_core

        ids = np.asarray([prompt], dtype=np.int64)
        inputs = self.ov.TokenizedInputs(ov_core.Tensor(ids), ov_core.Tensor(np.ones_like(ids)))
        cfg = self.ov.GenerationConfig()
        for k, v in generation_options(self.name, n, eos, self.lookup_tokens).items():
            setattr(cfg, k, v)
        res = self.pipe.generate(inputs, cfg)
        pm = res.perf_metrics
        steps = len(pm.raw_metrics.m_batch_sizes)
        return run_from_metrics(list(res.tokens[0]), n, eos, pm.get_tpot().mean, pm.get_ttft().mean, steps)


def open_openvino(
    names: list[str], source: dict, *, eos: list[int], lookup_tokens: int, temperature: float, threads: int
) -> tuple[dict, dict, dict]:
    """One pipeline per configuration name -> (runners, info, skipped {name: one-line reason})."""
    if temperature > 0:
        return {}, {}, {n: "OpenVINO GenAI runs greedy only in bench (use --temperature 0)" for n in names}
    try:
        import_openvino_genai()
        mdir, gguf, why = hf_source_path(source)
        if mdir is None or not gguf:
            raise PeerUnavailable(
                why or f"OpenVINO GenAI reads a GGUF file here; the model source is a folder ({mdir})"
            )
    except PeerUnavailable as e:
        return {}, {}, {n: str(e) for n in names}
    runners, info, skipped = {}, {}, {}
    for n in names:
        try:
            runners[n] = OpenVINORunner(n, mdir / gguf, threads, eos, lookup_tokens)
            info[n] = runners[n].describe(n)
        except PeerUnavailable as e:
            skipped[n] = str(e)
    return runners, info, skipped
