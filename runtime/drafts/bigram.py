"""The bigram draft (the seed's table draft): the target's own next-token top-k given one
token; no model call, no cache.

Role in one decode step: step 1 (a gather per level). `bigram_table_from_target` derives the
table from a target engine; `save_bigram_table` / `load_bigram_table` store it (safetensors).
"""

from __future__ import annotations

import torch

from ..kvcache import KVCache
from .base import DraftSource, NodeView


class BigramDraft(DraftSource):
    """The seed's table draft: next-token logits given only the previous token.

    `table` is either dense logits [V, V] or a sparse (indices [V, K], logits [V, K]) top-K;
    missing entries are -inf. Cost per level: a gather, no model call."""

    kind = "bigram"
    finite_logits = False

    def __init__(self, indices: torch.Tensor | None, logits: torch.Tensor, vocab_size: int):
        self.vocab_size = vocab_size
        self.indices, self.logits = indices, logits.float()

    def _rows(self, toks: torch.Tensor) -> torch.Tensor:
        if self.indices is None:
            return self.logits[toks]
        out = torch.full((toks.numel(), self.vocab_size), float("-inf"))
        return out.scatter_(1, self.indices[toks], self.logits[toks])

    def fork(self) -> "BigramDraft":
        return self  # stateless

    def start(self, root: int) -> torch.Tensor:
        return self._rows(torch.tensor([root]))[0]

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        return self._rows(nodes.tokens[frontier])


@torch.inference_mode()
def bigram_table_from_target(engine, top_k: int = 32, batch: int = 256, progress=None):
    """Derive the bigram table from the target itself: for every token v, the target's
    next-token logits given the one-token context [v] (position 0). Returns (indices [V, K],
    logits [V, K]) float32, or dense (None, logits [V, V]) when V <= top_k."""
    v = engine.info.vocab_size
    k = min(top_k, v)
    idx_out = torch.empty(v, k, dtype=torch.long)
    val_out = torch.empty(v, k, dtype=torch.float32)
    starts = range(0, v, batch)
    for s in progress(starts) if progress else starts:
        toks = torch.arange(s, min(s + batch, v))
        b = toks.numel()
        cache = KVCache(engine.info.cache, 1, b, engine.device)
        dev = engine.device
        logits = (
            engine.forward(
                toks[:, None].to(dev),
                torch.zeros(b, 1, dtype=torch.long, device=dev),
                torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
                cache,
            )[:, 0]
            .float()
            .cpu()
        )
        top = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
        idx_out[s : s + b], val_out[s : s + b] = top.indices, top.values
    if k == v:
        dense = torch.full((v, v), float("-inf"))
        return None, dense.scatter_(1, idx_out, val_out)
    return idx_out, val_out


def save_bigram_table(path, indices: torch.Tensor | None, logits: torch.Tensor, vocab_size: int) -> None:
    """Write a bigram table (the format `load_bigram_table` reads), atomically."""
    from safetensors.torch import save

    from ..fileio import atomic_write_bytes

    tensors = {"logits": logits.contiguous()}
    if indices is not None:
        tensors["indices"] = indices.contiguous()
    atomic_write_bytes(path, save(tensors, metadata={"vocab_size": str(vocab_size), "top_k": str(logits.shape[1])}))


def load_bigram_table(path) -> BigramDraft:
    """A BigramDraft from an exported table file (safetensors: `logits`, optional `indices`)."""
    from safetensors import safe_open

    from ..errors import ExportDirError, one_line

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            logits = f.get_tensor("logits")
            indices = f.get_tensor("indices") if "indices" in f.keys() else None
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ExportDirError(f"{path}: not a readable bigram table ({one_line(e)})") from None
    vocab = int(meta.get("vocab_size", logits.shape[-1]))
    return BigramDraft(indices, logits, vocab)
