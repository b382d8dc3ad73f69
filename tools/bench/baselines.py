"""Baselines measured next to arborspec in `arborspec bench`: transformers' greedy generate(),
assisted generation with a truncated assistant, and prompt lookup, on the same prompt ids.

Role in one decode step: none; the reference points the measured decode steps are compared with.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

from arborspec.runtime.errors import InputError

BASELINES = ("hf-greedy", "hf-assisted", "hf-lookup")


# ---------------------------------------------------------------------------------- HF baselines
def hf_source_path(source: dict | None) -> tuple[Path | None, str | None, str]:
    """Where transformers can load the target from: (dir, gguf file name or None, note)."""
    if not source:
        return None, None, "no model source recorded"
    path = source.get("path") or source.get("location")
    name = source.get("name") or source.get("model")
    if not path and name == "smollm2-135m":
        from arborspec.models.registry import smollm2_path

        path = str(smollm2_path())
    if not path:
        return None, None, "the model source has no path"
    p = Path(path).expanduser()
    if not p.exists() and name == "smollm2-135m":
        from arborspec.models.registry import smollm2_path

        p = smollm2_path()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name, ""
    if p.is_dir() and (p / "config.json").is_file():
        return p, None, ""
    if not p.exists():
        return None, None, f"model source {p} not found"
    return None, None, f"transformers cannot load {p.name} (not a .gguf file or a HF folder)"


class HFBaselines:
    """transformers' own generate() on the target's weights: greedy, assisted, prompt lookup."""

    def __init__(
        self,
        model_dir: Path,
        gguf_file: str | None,
        assistant_layers: int,
        need_assistant: bool,
        lookup_tokens: int = 10,
    ):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.torch = torch
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, local_files_only=True, **kw
        ).eval()
        self.load_s = time.perf_counter() - t0
        self.assistant = None
        self.assistant_layers = assistant_layers
        self.lookup_tokens = lookup_tokens
        if need_assistant:
            self.assistant = truncated_hf(self.model, assistant_layers)
        self._counts = {}
        self._hooks = []
        for tag, m in (("target", self.model), ("assistant", self.assistant)):
            if m is None:
                continue
            self._hooks.append(m.register_forward_pre_hook(self._pre(tag)))
            self._hooks.append(m.register_forward_hook(self._post(tag)))
        self._reset()

    def _reset(self):
        self._counts = {"target": [0, 0.0, None], "assistant": [0, 0.0, None]}

    def _pre(self, tag):
        def f(_m, _a):
            self._counts[tag][2] = time.perf_counter()

        return f

    def _post(self, tag):
        def f(_m, _a, _o):
            c = self._counts[tag]
            c[0] += 1
            c[1] += time.perf_counter() - c[2]

        return f

    def _gen(self, kind: str, ids, n: int, eos: list[int], temperature: float, seed: int, top_k=0, top_p=1.0):
        torch = self.torch
        kw: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=0, attention_mask=torch.ones_like(ids))
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        kw["eos_token_id"] = list(eos) if eos else None
        kw["pad_token_id"] = eos[0] if eos else 0
        if kind == "hf-assisted":
            kw["assistant_model"] = self.assistant
        elif kind == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = self.lookup_tokens
        torch.manual_seed(seed)
        self._reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, **kw)
        dt = time.perf_counter() - t0
        counts = {k: (v[0], v[1]) for k, v in self._counts.items()}
        return out[0, ids.shape[1] :].tolist(), dt, counts

    def run(
        self, kind: str, prompt: list[int], n: int, eos: list[int], temperature: float, seed: int, top_k=0, top_p=1.0
    ) -> dict:
        ids = self.torch.tensor([prompt], dtype=self.torch.long)
        _, t1, c1 = self._gen(kind, ids, 1, eos, temperature, seed, top_k, top_p)
        toks, tn, cn = self._gen(kind, ids, n, eos, temperature, seed, top_k, top_p)
        if eos:  # generate() keeps the eos token, as our runtime does; drop any padding after it
            for i, t in enumerate(toks):
                if t in eos:
                    toks = toks[: i + 1]
                    break
        new = len(toks)
        decode_s = max(tn - t1, 1e-9)
        tcalls = cn["target"][0]
        verify_s = max(cn["target"][1] - c1["target"][1], 0.0)
        draft_s = max(cn["assistant"][1] - c1["assistant"][1], 0.0)
        other_s = max(decode_s - verify_s - draft_s, 0.0)
        stop = "eos" if eos and toks and toks[-1] in eos else "length"
        return {
            "new_tokens": new,
            "tokens_per_s": (new - 1) / decode_s if new > 1 else 0.0,
            "mean_accepted": new / tcalls if tcalls else None,
            "target_calls": tcalls,
            "draft_calls": cn["assistant"][0],
            "steps": tcalls,
            "tree_nodes": None,
            "decode_s": decode_s,
            "prefill_s": t1,
            "time_split": {"draft_s": draft_s, "verify_s": verify_s, "accept_kv_s": 0.0, "other_s": other_s},
            "draft_model_s": draft_s,
            "overhead_per_step_ms": None,
            "accepted_hist": {},
            "stop_reason": stop,
            "tokens": toks,
        }


def truncated_hf(model, k: int):
    """An assistant for assisted generation: a copy of the HF model keeping its first K layers
    (embeddings, final norm and head shared in value with the target: same tokenizer)."""
    n = model.config.num_hidden_layers
    if not 1 <= k <= n:
        raise InputError(f"--hf-assistant-layers {k}: needs 1 <= K <= {n}")
    a = copy.deepcopy(model)
    a.model.layers = a.model.layers[:k]
    a.config.num_hidden_layers = k
    if getattr(a.config, "layer_types", None):
        a.config.layer_types = a.config.layer_types[:k]
    return a.eval()
