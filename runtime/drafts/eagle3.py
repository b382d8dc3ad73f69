"""EAGLE-3 draft source: a one-layer head over the target's own features, reduced vocabulary.

Role in one decode step: step 1 (drafting) and step 5 (commit). Token/feature alignment: the
draft's context entry at position j pairs token x[j+1] with the target's features f[j] (the
hidden states the target computed at position j, where it predicted x[j+1]); a tree node pairs
its token with the draft's own output hidden state of its parent. So

* reset(committed x[0..m-1], features f[0..m-1]) queues entries (x[1], f[0]) .. (x[m-1], f[m-2])
  (the last `context` of them: 1024 by default, so a long prompt costs the head one pass over
  its end, not over all of it) and keeps f[m-1] for the first root;
* start(root) runs the queued entries and (root, last feature) as one causal chain and returns
  the root entry's logits; its output hidden state feeds the root's children;
* expand runs one call over the frontier: each node's embedding with its parent's output hidden;
* commit(tree, path, features) drops every scratch entry (they were made from draft hidden
  states) and queues the accepted nodes y1..yk with the TARGET features of the verify call that
  accepted them: (y1, f[root]), (y2, f[y1]) .. and keeps f[yk] for the next root. The cache thus
  holds exactly what a fresh draft prefill of the kept entries would.

Candidates come out over the draft vocabulary; `token_map` (d2t) turns them into target ids,
and sampled candidates' q lives on the target vocabulary with zeros outside the draft's.

The head runs behind a head engine, one per backend, all with the same three members:
`forward_hidden(ids, hidden, pos, mask, cache) -> (logits, hidden_out)` (K/V written into the
cache at [P, P+T)), `project(features) -> hidden`, `token_map`: TorchEagle3Head (a torch
module, runtime/backends/torch_backend.py), OrtEagle3Head (the exported `draft.onnx` +
`draft_fc.onnx`, below; either cache layout: "bhsd" for the GroupQueryAttention graph, "sbhd"
for the portable one) or TrtEagle3Head (the TensorRT engines `arborspec build` makes from the
portable graphs, `draft.engine` + `draft_fc.engine`; CUDA only).
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import numpy as np
import torch

from .. import contract as C
from ..kvcache import KVCache, common_prefix
from ..tree_plan import MaskBuffer, run_chain
from ..trees import Tree, TreePolicy
from .base import DraftSource, NodeView, TopK, scratch_mask, topk_of, tree_capacity


class Eagle3Draft(DraftSource):
    kind = "eagle3"
    needs_target_features = True
    PREFILL_CHUNK = 512  # entries per call when start() runs a long chain (the prompt)
    # prompt entries the head reads by default (the last ones). Measured on SmolLM2 + the shipped
    # head: 4.4k-token prompts, the same acceptance (1.25 per call) for 19.8 -> 5.4 ms of draft
    # time per token (the head's pass over the prompt); packaged prompts: 1.566 -> 1.560
    CONTEXT = 1024
    # sampled candidates' q = softmax(SAMPLE_SCALE * logits / T) (DraftSource.sample_scale;
    # lossless at any value). Measured on the 3,676 held-out positions, teacher-forced
    # (benchmarks/history/eagle3_revocab_2026-11-27/sampled_acceptance.py): the trained heads are
    # under-confident, sum_x min(p_T, q) is highest for logits sharpened by 1/0.7-1/0.75 at every
    # depth, at T = 0.8 and 1.0 alike (run 11's head, T = 0.8: depth 1 0.520 -> 0.528, chain-of-4
    # expectation 1.922 -> 1.950)
    SAMPLE_SCALE = 1 / 0.75

    def __init__(
        self,
        head,
        embed: torch.Tensor | None = None,
        device: str | torch.device = "cpu",
        context: int | None = CONTEXT,
        cuda_graphs: bool | str = False,
        sample_scale: float = SAMPLE_SCALE,
    ):
        """head: a head engine (TorchEagle3Head, OrtEagle3Head), or a torch EAGLE-3 module with
        `embed` (the target's token embeddings), wrapped in a TorchEagle3Head (`cuda_graphs`: its
        calls replayed as CUDA graphs on a GPU, "static" the same calls eagerly). sample_scale:
        the logit scale of sampled candidates (1: the head's own distribution)."""
        if isinstance(head, torch.nn.Module):
            from ..backends.torch_backend import TorchEagle3Head

            if embed is None:
                raise ValueError("Eagle3Draft(module, embed): a torch head needs the target's token embeddings")
            head = TorchEagle3Head(head, embed, device, cuda_graphs=cuda_graphs)
        self.engine = head
        self.device = head.device
        self.device_topk = self.device.type != "cpu"  # top-k where the logits are (start_topk)
        # context: read at most this many of the prompt's entries (its last ones), None: all.
        # The head attends with RoPE (relative positions), so dropping a prefix only removes
        # what it could attend to; the target still reads everything (outputs stay exact)
        if context is not None and context < 1:
            raise ValueError("Eagle3Draft context must be >= 1 or None")
        self.context = context
        if not sample_scale > 0:
            raise ValueError(f"Eagle3Draft sample_scale must be > 0, got {sample_scale}")
        self.sample_scale = float(sample_scale)
        self.vocab_size = head.info.vocab_size
        self.token_map = head.token_map
        self.spec = head.info.cache
        self.hidden_size = head.hidden_size
        self.feature_size = head.feature_size
        self.cache: KVCache | None = None
        self.mask = MaskBuffer(self.device, 1 << 12)
        self.model_s = 0.0
        self._tokens: list[int] = []  # queued entries: tokens ...
        self._feats: torch.Tensor | None = None  # ... and their target features [n, F]
        self._last: torch.Tensor | None = None  # the feature the next root pairs with [F]
        self._base = self._chain = 0
        # what the cache holds, for a next sequence that starts the same way (a chat's next turn):
        # entry j is (x[w + 1 + j], the target feature of x[w + j]) of the sequence x whose first
        # w + 1 tokens are `_lead`; `_entries` the entry tokens (None: nothing known)
        self._lead: list[int] = []
        self._entries: list[int] | None = None
        self._slot = np.full(64, -1, dtype=np.int64)
        self._slot_node = np.zeros(64, dtype=np.int64)
        self._node_hidden = torch.zeros(64, self.hidden_size)
        self._root_hidden = torch.zeros(self.hidden_size)

    def fork(self) -> "Eagle3Draft":
        # the same head, own cache
        fork = Eagle3Draft(self.engine, device=self.device, context=self.context, sample_scale=self.sample_scale)
        fork.device_topk = self.device_topk
        return fork

    def prepare(self, policy: TreePolicy, max_len: int) -> None:
        cap = tree_capacity(policy, self.vocab_size)
        need = max_len + cap + 2
        if self.cache is None or self.cache.max_len < need:
            self.cache = KVCache(self.spec, need, 1, self.device)
            self._entries = None  # a new cache holds nothing
        if self._slot.size < cap:
            self._slot = np.full(cap, -1, dtype=np.int64)
            self._slot_node = np.zeros(cap, dtype=np.int64)
            self._node_hidden = torch.zeros(cap, self.hidden_size)

    def forget(self) -> None:
        self._entries = None

    def reset(self, committed: list[int], features: torch.Tensor | None = None) -> None:
        """Start a sequence whose committed tokens are `committed` (features: the target's of
        them). The head reads the last `context` entries; where the cache already holds the first
        ones (the previous sequence began the same way: a chat's next turn), they stay and only
        the rest is queued, the window start kept until it would hold twice `context`."""
        m = len(committed)
        f = features if features is not None else torch.zeros(0, self.feature_size)
        w = max(0, m - 1 - self.context) if self.context is not None else 0  # a fresh window's start
        keep = 0
        if self._entries is not None and self._lead:
            w0 = len(self._lead) - 1
            if self.context is None or m - 1 - w0 <= 2 * self.context:
                n = common_prefix(committed, self._lead + self._entries)
                if n >= w0 + 1:  # the window's lead is the same: entries up to token n - 1 stay
                    w, keep = w0, min(n - 1 - w0, len(self._entries))
        self.cache.length = keep
        self._lead, self._entries = list(committed[: w + 1]), (self._entries or [])[:keep]
        self._tokens = list(committed[w + 1 + keep :])
        self._feats = f[w + keep : max(m - 1, 0)].float().cpu()
        self._last = f[m - 1].float().cpu() if m else torch.zeros(self.feature_size)

    @torch.inference_mode()
    def _run(self, tokens, hidden, pos, mask, topk: tuple[int, bool] | None = None, last: bool = False):
        """One head call -> (logits [T, V] on the host, or with `topk` (k, logprobs) a TopK
        computed where the logits are; `last`: of the last row only; output hidden [T, H])."""
        t0 = time.perf_counter()
        dev = self.device
        logits, out = self.engine.forward_hidden(
            tokens.to(dev)[None], hidden.to(dev)[None], pos.to(dev)[None], mask, self.cache
        )
        logits = logits[0, -1:] if last else logits[0]
        if topk is not None:  # on a GPU: k values a row cross to the host, not the vocabulary
            t = topk_of(logits, *topk)
            logits = TopK(t.values.cpu(), t.indices.cpu())
        else:
            logits = logits.cpu()
        # the copies wait for the device (a replayed graph returns before it ran): the head's time
        out = out[0].cpu()
        self.model_s += time.perf_counter() - t0
        return logits, out

    # top-k where the logits are (DraftSource's hook; `device_topk`, on by default off the CPU):
    # on a GPU the head's [F, V] rows never cross to the host (on an H200, dynamic:8,6,64, the
    # runtime's own time was 4.5 ms a step with the host's top-k over them; on this CPU the
    # host's top-k is ~1.4 ms of its 4.4); on the CPU the base class's path is the same work,
    # timed as the runtime's own
    def start_topk(self, root: int, k: int, logprobs: bool = False) -> TopK:
        if not self.device_topk:
            return super().start_topk(root, k, logprobs)
        return self._start(root, (k, logprobs))

    def expand_topk(self, nodes: NodeView, frontier: torch.Tensor, k: int, logprobs: bool = False) -> TopK:
        if not self.device_topk:
            return super().expand_topk(nodes, frontier, k, logprobs)
        return self._expand(nodes, frontier, (k, logprobs))

    def start(self, root: int) -> torch.Tensor:
        return self._start(root)[0]

    @torch.inference_mode()
    def _start(self, root: int, topk: tuple[int, bool] | None = None):
        feats = torch.cat([self._feats, self._last[None]]) if self._feats is not None else self._last[None]
        tokens = torch.tensor(self._tokens + [int(root)])
        m = int(tokens.numel())
        c = self.cache
        p = c.length
        t0 = time.perf_counter()
        hidden = self.engine.project(feats).cpu()  # the head's fc: a model call, timed as one
        self.model_s += time.perf_counter() - t0
        # a long chain (the prompt) runs in chunks over the cache (tree_plan.run_chain; measured
        # on 4,472 prompt tokens: one call 3.07 s inside the decoder, its attention alone
        # allocating ~0.7 GB; chunked 0.58 s); only the last chunk's rows are used
        logits, out = run_chain(
            lambda s, r, mask: self._run(
                tokens[s : s + r], hidden[s : s + r], torch.arange(c.length, c.length + r), mask, topk, last=True
            ),
            self.mask,
            m,
            c,
            self.PREFILL_CHUNK,
        )
        self._base, self._chain = p, m  # c.length is p + m
        if self._entries is not None:
            self._entries += tokens.tolist()
        self._slot.fill(-1)
        self._root_hidden = out[-1]
        self._root_token = int(root)
        return logits  # [1, V] (the root's row) or its TopK

    def expand(self, nodes: NodeView, frontier: torch.Tensor) -> torch.Tensor:
        return self._expand(nodes, frontier)

    @torch.inference_mode()
    def _expand(self, nodes: NodeView, frontier: torch.Tensor, topk: tuple[int, bool] | None = None):
        f = int(frontier.numel())
        c = self.cache
        p = c.length
        scratch0 = self._base + self._chain
        n_slots = p - scratch0
        fr = frontier.numpy()
        mask = scratch_mask(self.mask, nodes.anc, fr, self._slot_node, scratch0, p)
        parents = nodes.parents.numpy()[fr]
        hidden = torch.stack([self._root_hidden if q < 0 else self._node_hidden[q] for q in parents.tolist()])
        pos = nodes.depth[frontier] + (scratch0 - 1)
        logits, out = self._run(nodes.tokens[frontier], hidden, pos, mask, topk)
        self.mask.release()
        self._slot[fr] = np.arange(n_slots, n_slots + f)
        self._slot_node[n_slots : n_slots + f] = fr
        self._node_hidden[torch.from_numpy(fr)] = out
        c.length = p + f
        return logits

    def defer(self, root: int, features: torch.Tensor | None = None) -> None:
        """Queue the root (paired with the feature before it) for the next start; the root's own
        feature becomes the last one."""
        f = features.float().cpu()[0] if features is not None else torch.zeros(self.feature_size)
        self._tokens.append(int(root))
        self._feats = torch.cat([self._feats, self._last[None]]) if self._feats is not None else self._last[None]
        self._last = f

    def commit(self, tree: Tree, path: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Keep the chain; queue the accepted nodes with the verify call's target features
        (rows: 0 = the root, i + 1 = node i)."""
        self.cache.length = self._base + self._chain
        feats = features.float().cpu() if features is not None else None
        rows = [0] + [int(i) + 1 for i in path.tolist()]
        self._tokens = tree.tokens[path].tolist() if path.numel() else []
        if feats is None:
            feats = torch.zeros(len(rows), self.feature_size)
            rows = list(range(len(rows)))
        self._feats = feats[rows[:-1]]
        self._last = feats[rows[-1]]

    def close(self) -> None:
        self.cache = None


def token_map_from_metadata(meta: dict, where, vocab_size: int) -> torch.Tensor:
    """Draft id -> target id from a head graph's metadata (base64 int64 offsets, META_D2T)."""
    from ..errors import ExportDirError

    try:
        d2t = np.frombuffer(base64.b64decode(meta[C.META_D2T]), dtype="<i8").astype(np.int64)
    except (KeyError, ValueError) as e:
        raise ExportDirError(f"{where}: no valid draft-to-target map in the metadata ({e})") from None
    if d2t.size != vocab_size:
        raise ExportDirError(f"{where}: d2t has {d2t.size} entries, the head predicts {vocab_size}")
    return torch.arange(d2t.size) + torch.from_numpy(d2t)


class OrtProjection:
    """`draft_fc.onnx`: target features [N, F] -> the head's hidden input [N, H]."""

    def __init__(self, path: str | Path):
        from ..backends.ort_loader import import_ort, new_session_options

        ort = import_ort()
        self.session = ort.InferenceSession(str(path), new_session_options(ort), providers=["CPUExecutionProvider"])

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        x = features.detach().float().cpu().contiguous().numpy()
        return torch.from_numpy(self.session.run(None, {C.TARGET_FEATURES: x})[0])


class _HeadEngines:
    """What the ONNX Runtime and TensorRT heads share: a layer engine (`forward_hidden`) and a
    projection (`fc`), behind the head-engine interface."""

    layer = fc = None

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def forward_hidden(self, input_ids, hidden, position_ids, mask, cache: KVCache):
        return self.layer.forward_hidden(input_ids, hidden, position_ids, mask, cache)

    def close(self) -> None:
        self.layer.close()
        close_fc = getattr(self.fc, "close", None)
        if close_fc:
            close_fc()


class OrtEagle3Head(_HeadEngines):
    """The exported head (export/eagle3_graph.py) behind the head-engine interface: the layer
    graph through an OrtEngine (its cache read and written in place), the projection through
    OrtProjection, d2t from the graph's metadata."""

    def __init__(self, layer_path: str | Path, fc_path: str | Path, device: str | torch.device = "cpu"):
        from ..backends.onnxruntime import OrtEngine
        from ..errors import ExportDirError

        self.layer = OrtEngine(layer_path, device=device)
        if not self.layer.has_hidden_in:
            raise ExportDirError(f"{layer_path}: not an EAGLE-3 head graph (no {C.HIDDEN_IN} input)")
        meta = self.layer.metadata
        self.fc = OrtProjection(fc_path)
        self.device = self.layer.device
        self.info = self.layer.info
        cfg = self.layer.config
        self.hidden_size = int(cfg["hidden_size"])
        self.feature_size = int(cfg["feature_size"])
        self.token_map = token_map_from_metadata(meta, layer_path, self.info.vocab_size)


class TrtEagle3Head(_HeadEngines):
    """The portable head's TensorRT engines (`arborspec build` of an export made with
    `--attention onnx`) behind the head-engine interface: the layer through a TrtEngine (its
    "sbhd" cache bound by address, `hidden_in` / `hidden_states` bound beside it), the projection
    through a TrtProjection, d2t from the ONNX metadata recorded in engines.json. Needs a CUDA GPU."""

    def __init__(self, layer_engine: str | Path, fc_engine: str | Path, device: str | torch.device = "cuda"):
        import json

        from ..backends.tensorrt import TrtEngine, TrtProjection
        from ..errors import ExportDirError

        self.layer = TrtEngine(layer_engine, device=device)
        try:
            if not self.layer.has_hidden_in:
                raise ExportDirError(f"{layer_engine}: not an EAGLE-3 head engine (no {C.HIDDEN_IN} input)")
            self.fc = TrtProjection(fc_engine, device=self.layer.device)
        except BaseException:
            self.layer.close()
            raise
        self.device = self.layer.device
        self.info = self.layer.info
        meta = (self.layer.entry or {}).get("onnx_metadata") or {}
        try:
            cfg = json.loads(meta.get(C.META_CONFIG) or "{}")
        except ValueError:
            cfg = {}
        self.hidden_size = int(cfg.get("hidden_size") or self.fc.hidden_size)
        self.feature_size = int(cfg.get("feature_size") or self.fc.feature_size)
        if (self.hidden_size, self.feature_size) != (self.fc.hidden_size, self.fc.feature_size):
            raise ExportDirError(f"{fc_engine}: the projection engine does not fit the head engine {layer_engine}")
        self.token_map = token_map_from_metadata(meta, f"{layer_engine} (engines.json)", self.info.vocab_size)
