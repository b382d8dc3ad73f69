"""What every peer runner shares: the one-line "cannot run here" error, package versions, and
the run record a peer's generation is reported in (tools/bench/peers.py, llama_server.py).

Role in one decode step: none; benchmarks only.
"""

from __future__ import annotations

import importlib.metadata as md


class PeerUnavailable(Exception):
    """A peer that is not installed or cannot run here: its message is the one-line reason."""


def pkg_version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def _run_dict(toks: list[int], prefill_s: float, decode_s: float, calls: int, stats: dict | None = None) -> dict:
    new = len(toks)
    decode_s = max(decode_s, 1e-9)
    d = {
        "new_tokens": new,
        "tokens_per_s": (new - 1) / decode_s if new > 1 else 0.0,
        "mean_accepted": new / calls if calls else None,
        "target_calls": calls,
        "draft_calls": 0,
        "steps": calls,
        "tree_nodes": None,
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "ttft_s": prefill_s,
        # a peer's time is not split into draft / verify: all of it is reported as "other"
        "time_split": {"draft_s": 0.0, "verify_s": 0.0, "accept_kv_s": 0.0, "other_s": decode_s},
        "draft_model_s": 0.0,
        "overhead_per_step_ms": None,
        "accepted_hist": {},
        "stop_reason": "length",
        "tokens": toks,
    }
    if stats is not None:
        d["peer_stats"] = stats
    return d


def _cut_at_eos(toks: list[int], eos: list[int]) -> tuple[list[int], str]:
    for i, t in enumerate(toks):
        if t in eos:
            return toks[: i + 1], "eos"
    return toks, "length"
