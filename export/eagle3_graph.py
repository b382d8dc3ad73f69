"""An EAGLE-3 head as two plain ONNX graphs in the contract's conventions (no custom plugin):

* `draft.onnx`, the layer: input_ids, position_ids, attention_mask, past_key.0/past_value.0 (the
  head's own cache), and `hidden_in` [B, T, H], the hidden state each row pairs with its token
  -> logits over the draft vocabulary [B, T, Vd], new_key.0/new_value.0 and `hidden_states`
  [B, T, H], the layer's output (what the row's children read);
* `draft_fc.onnx`, the projection of the target's features: target_features [N, F] ->
  hidden_states [N, H] (one MatMul: standard ONNX for both flavours).

Two flavours of the layer graph, following the target's:
* "gqa" (`build_head_model`, kv layout "bhsd"): written node by node around ONNX Runtime's
  GroupQueryAttention (cache read and written in place, as the target's fast graph does);
* "portable" (`export_portable_head`, kv layout "sbhd"): `torch.onnx.export` of the PyTorch
  head itself (models/eagle3.Eagle3Head with the target's embedding lookup in front), standard
  ONNX only, so TensorRT parses and builds it (`arborspec build`); written when the target is
  the portable graph (`--attention onnx`, `--format qdq`).

Rows whose hidden state comes from the target (the committed chain) are projected first by
`draft_fc`, rows of tree nodes pass their parent's output: one layer graph serves both, with no
control flow on tensor values. The draft-to-target id map (d2t) and the head's config travel in
the metadata (contract META_D2T, META_CONFIG["eagle3"]).

Role in one decode step: step 1 (one `draft.onnx` call per tree level; `draft_fc` once per
step for the accepted path's features).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import torch

from arborspec.runtime import contract as C
from arborspec.runtime.errors import InputError

from .gqa_graph import IR_VERSION, OPSET, _np, attention_inputs, gqa_node, save_model


def head_config_json(head, max_context: int, name: str = "eagle3") -> dict:
    """The config an OrtEngine reads (one layer, the draft vocabulary) plus the head's own."""
    c = head.config
    return {
        "family": "eagle3",
        "name": name,
        "n_layers": 1,
        "vocab_size": c.draft_vocab_size,
        "max_position": int(max_context),
        "n_kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_size": c.hidden_size,
        "target_vocab_size": c.vocab_size,
        "feature_size": c.feature_size,
        "eagle3": c.to_json(),
    }


def build_head_model(head, embed: torch.Tensor, max_context: int, sink=None, bits: int = 0, block_size: int = 32):
    """The layer graph (see the module docstring) from an models/eagle3.Eagle3Head.
    sink: where initialisers go (export/gqa_graph.MemorySink, or ExternalDataSink for a head over
    the protobuf's 2 GB); bits 4 / 8: every MatMul's weight as MatMulNBits blocks with int8
    activations (ONNX Runtime's round-to-nearest, weight by weight: export/gqa_export.rtn_nbits)."""
    from onnx import helper as h

    from .gqa_graph import MemorySink

    c = head.config
    sd = head.state_dict()
    nq, nkv, d = c.n_heads, c.n_kv_heads, c.head_dim
    sink = sink if sink is not None else MemorySink()
    nodes = []

    def init(name, arr):
        sink.add(name, np.ascontiguousarray(arr))
        return name

    def matmul(x, w_in_out, name, out):
        if not bits:
            return node("MatMul", [x, init(name, w_in_out)], [out])
        from .gqa_export import rtn_nbits

        q = rtn_nbits(w_in_out.T, bits, block_size)
        ins = [x, init(name + "_Q", q.blob), init(name + "_scales", q.scales), init(name + "_zero_points", q.zero_points)]
        return node("MatMulNBits", ins, [out], domain="com.microsoft", K=q.k, N=q.n, bits=bits, block_size=block_size,
                    accuracy_level=4)  # fmt: skip

    def node(op, ins, outs, domain="", **attrs):
        nodes.append(h.make_node(op, ins, outs, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def rms(x, w, name):
        return node(
            "RMSNormalization",
            [x, init(name, _np(sd[w]))],
            [name + "_out"],
            axis=-1,
            epsilon=float(c.rms_eps),
            stash_type=1,
        )

    inputs, outputs = _head_io(c)
    seqlens, total, bias = attention_inputs(node, init, d, c.rope_theta, max_context, rotary=head.rotary)

    e = node("Gather", [init("embed_tokens", _np(embed)), C.INPUT_IDS], ["embeds"], axis=0)
    en = rms(e, "midlayer.input_layernorm.weight", "in_norm")
    hn = rms(C.HIDDEN_IN, "midlayer.hidden_norm.weight", "hidden_norm")
    x = node("Concat", [en, hn], ["x2h"], axis=-1)
    wqkv = np.concatenate([_np(sd[f"midlayer.self_attn.{n}_proj.weight"]).T for n in "qkv"], axis=1)
    qkv = matmul(x, wqkv, "qkv", "qkv_out")
    attn = gqa_node(node, qkv, 0, "attn", nq, nkv, d, seqlens, total, bias)
    o = matmul(attn[0], _np(sd["midlayer.self_attn.o_proj.weight"]).T, "o", "o_out")
    post = node(
        "SkipSimplifiedLayerNormalization",
        [o, C.HIDDEN_IN, init("post_norm", _np(sd["midlayer.post_attention_layernorm.weight"]))],
        ["post_normed", "", "", "res1"],
        domain="com.microsoft",
        epsilon=float(c.rms_eps),
    )
    gate = matmul(post[0], _np(sd["midlayer.mlp.gate_proj.weight"]).T, "gate", "gate_out")
    up = matmul(post[0], _np(sd["midlayer.mlp.up_proj.weight"]).T, "up", "up_out")
    act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate], ["sig"])], ["silu"]), up], ["act"])
    down = matmul(act, _np(sd["midlayer.mlp.down_proj.weight"]).T, "down", "down_out")
    fin = node(
        "SkipSimplifiedLayerNormalization",
        [down, post[3], init("final_norm", _np(sd["norm.weight"]))],
        ["final_normed", "", "", C.HIDDEN_STATES],
        domain="com.microsoft",
        epsilon=float(c.rms_eps),
    )
    matmul(fin[0], _np(sd["lm_head.weight"]).T, "lm_head", C.LOGITS)
    return _head_onnx_model(nodes, inputs, outputs, sink)


def _head_io(c):
    """The head graph's declared inputs and outputs (the contract's names; K/V [B, Hkv, S, D])."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    nkv, d, hs = c.n_kv_heads, c.head_dim, c.hidden_size
    inputs = [
        h.make_tensor_value_info(C.INPUT_IDS, TP.INT64, ["batch", "tokens"]),
        h.make_tensor_value_info(C.POSITION_IDS, TP.INT64, ["batch", "tokens"]),
        h.make_tensor_value_info(C.ATTENTION_MASK, TP.BOOL, ["batch", "tokens", "context"]),
        h.make_tensor_value_info(C.past_key(0), TP.FLOAT, ["batch", nkv, "max_seq", d]),
        h.make_tensor_value_info(C.past_value(0), TP.FLOAT, ["batch", nkv, "max_seq", d]),
        h.make_tensor_value_info(C.HIDDEN_IN, TP.FLOAT, ["batch", "tokens", hs]),
    ]
    outputs = [
        h.make_tensor_value_info(C.LOGITS, TP.FLOAT, ["batch", "tokens", c.draft_vocab_size]),
        h.make_tensor_value_info(C.new_key(0), TP.FLOAT, ["batch", nkv, "max_seq", d]),
        h.make_tensor_value_info(C.new_value(0), TP.FLOAT, ["batch", nkv, "max_seq", d]),
        h.make_tensor_value_info(C.HIDDEN_STATES, TP.FLOAT, ["batch", "tokens", hs]),
    ]
    return inputs, outputs


def _head_onnx_model(nodes, inputs, outputs, sink):
    """The head graph as an ONNX model (opset OPSET + com.microsoft), checked unless its
    initialisers go to external data (checked on the saved file then)."""
    import onnx
    from onnx import helper as h

    from .gqa_graph import ExternalDataSink

    graph = h.make_graph(nodes, "arborspec_eagle3_head", inputs, outputs, sink.tensors)
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid("com.microsoft", 1)], producer_name="arborspec"
    )
    model.ir_version = IR_VERSION
    if not isinstance(sink, ExternalDataSink):
        onnx.checker.check_model(model)  # external data: checked on the saved file
    return model


def build_fc_model(head):
    """target_features [N, F] -> hidden_states [N, H] (the head's fc)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper

    c = head.config
    w = numpy_helper.from_array(np.ascontiguousarray(_np(head.fc.weight).T), "fc")
    g = h.make_graph(
        [h.make_node("MatMul", [C.TARGET_FEATURES, "fc"], [C.HIDDEN_STATES])],
        "arborspec_eagle3_fc",
        [h.make_tensor_value_info(C.TARGET_FEATURES, TP.FLOAT, ["rows", c.feature_size])],
        [h.make_tensor_value_info(C.HIDDEN_STATES, TP.FLOAT, ["rows", c.hidden_size])],
        [w],
    )
    model = h.make_model(g, opset_imports=[h.make_opsetid("", OPSET)], producer_name="arborspec")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


class PortableHead(torch.nn.Module):
    """The contract forward of the head graph for `torch.onnx.export`: input_ids -> the target's
    embedding lookup -> the head layer with `hidden_in` -> (logits, new_key.0, new_value.0,
    hidden_states), K/V in the "sbhd" layout ([P, B, Hkv, D] in, [T, B, Hkv, D] out)."""

    def __init__(self, head, embed: torch.Tensor):
        super().__init__()
        self.head, self.config = head, head.config
        self.embed = torch.nn.Embedding.from_pretrained(embed.detach().float().clone(), freeze=True)

    def forward(self, input_ids, position_ids, attention_mask, past_key, past_value, hidden_in):
        logits, out, k, v = self.head(
            self.embed(input_ids), hidden_in, position_ids, attention_mask, past_key, past_value
        )
        return logits, k, v, out


def export_portable_head(head, embed: torch.Tensor, path: str | Path, max_context: int, opset: int = 23) -> str:
    """torch.onnx.export (dynamo) of PortableHead into `path`; returns the exporter tag. B, T, P
    (and the mask's P+T) stay symbolic: the example sizes are distinct and >= 2."""
    from .onnx_export import _dims, quiet_dynamo_export

    c = head.config
    module = PortableHead(head.float().eval(), embed).eval()
    b, t, p = 2, 3, 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (b, t), generator=g)
    pos = (p + torch.arange(t)).expand(b, t).contiguous()
    mask = torch.cat(
        [torch.ones(b, t, p, dtype=torch.bool), torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)], 2
    )
    past = [torch.randn(p, b, c.n_kv_heads, c.head_dim, generator=g) for _ in range(2)]
    hidden = torch.randn(b, t, c.hidden_size, generator=g)
    B, T, P, S = _dims(None, max_context)
    ds = {
        "input_ids": {0: B, 1: T},
        "position_ids": {0: B, 1: T},
        "attention_mask": {0: B, 1: T, 2: S},
        "past_key": {0: P, 1: B},
        "past_value": {0: P, 1: B},
        "hidden_in": {0: B, 1: T},
    }
    names_in = [*C.input_names(1), C.HIDDEN_IN]
    names_out = [*C.output_names(1), C.HIDDEN_STATES]
    prog = quiet_dynamo_export(module, (ids, pos, mask, *past, hidden), names_in, names_out, ds, opset)
    prog.save(str(path), external_data=False)
    return f"eagle3-dynamo:opset{opset}"


def d2t_metadata(head) -> str:
    return base64.b64encode(np.ascontiguousarray(head.d2t.cpu().numpy().astype("<i8")).tobytes()).decode()


HEAD_QUANTIZE = ("int4", "int8")


def check_head_quantize(quantize: str | None, portable: bool) -> None:
    """One error line for a head quantisation (`--draft-quantize`) this export cannot write:
    an unknown scheme, or the portable head (MatMulNBits is ONNX Runtime's)."""
    if quantize is None:
        return
    if quantize not in HEAD_QUANTIZE:
        raise InputError(f"unknown --draft-quantize {quantize!r} (expected {' or '.join(HEAD_QUANTIZE)})")
    if portable:
        raise InputError("--draft-quantize needs ONNX Runtime's graph (--attention gqa), not the portable head")


def save_head_model(head, embed, path: Path, max_context: int, qinfo, block_size: int) -> None:
    """The layer graph written to `path`; its weights straight to `<path>.data` when the head is
    over 1 GiB in fp32 (a head of an 8B target's width)."""
    from .gqa_graph import ExternalDataSink

    big = sum(t.numel() for t in head.state_dict().values()) * 4 + embed.numel() * 4 > 1024**3
    sink = ExternalDataSink(path) if big else None
    bits = 0 if not qinfo else 4 if qinfo["scheme"] == "int4" else 8
    try:
        model = build_head_model(head, embed, max_context, sink, bits, block_size)
    finally:
        if sink is not None:
            sink.close()
    save_model(model, path)


def export_eagle3_head(
    head,
    embed: torch.Tensor,
    folder: str | Path,
    max_context: int,
    *,
    tokenizer_sha256: str | None = None,
    layer_file: str = "draft.onnx",
    fc_file: str = "draft_fc.onnx",
    verify: bool = True,
    portable: bool = False,
    quantize: str | None = None,
    block_size: int = 32,
) -> dict:
    """Write both graphs with their metadata into `folder`; return the manifest entry.
    portable: the standard-ONNX layer graph (kv layout "sbhd", what TensorRT builds) instead of
    ONNX Runtime's GroupQueryAttention one ("bhsd").
    quantize: None, "int8" or "int4": the head's and the projection's MatMuls become ONNX Runtime
    MatMulNBits with int8 activations (accuracy level 4). The draft only proposes (the target
    verifies, and sampled candidates carry the quantised head's own q), so outputs stay exact;
    the head reads 3-4x fewer weight bytes per call (measured: its in-loop cost on SmolLM2
    4.3 -> 3.0 ms per token)."""
    from .onnx_export import _finalize, contract_metadata

    folder = Path(folder)
    cfg = head_config_json(head, max_context)

    class _Cfg:  # contract_metadata reads cfg.to_json()
        def to_json(self):
            return json.dumps(cfg)

    layout = "sbhd" if portable else "bhsd"
    check_head_quantize(quantize, portable)
    qinfo = None
    if quantize:
        qinfo = {"scheme": quantize, "format": "matmulnbits", "block_size": block_size, "accuracy_level": 4}

    def quantized(model):
        if not qinfo:
            return model
        from .quantize import quantize_float_model

        return quantize_float_model(model, bits=4 if quantize == "int4" else 8, block_size=block_size, accuracy_level=4)

    if portable:
        exporter = export_portable_head(head, embed, folder / layer_file, max_context)
    else:
        exporter = f"eagle3:opset{OPSET}"
        save_head_model(head, embed, folder / layer_file, max_context, qinfo, block_size)
    meta = contract_metadata(_Cfg(), "fp32", tokenizer_sha256, C.ROLE_EAGLE3, exporter, layout)
    meta[C.META_D2T] = d2t_metadata(head)
    if qinfo:
        meta[C.META_QUANTIZATION] = json.dumps(qinfo)
    _finalize(folder / layer_file, meta, False)
    save_model(quantized(build_fc_model(head)), folder / fc_file)
    _finalize(folder / fc_file, meta, False)
    entry = {
        "kind": "eagle3",
        "file": layer_file,
        "fc_file": fc_file,
        "config": cfg,
        "dtype": "fp32",
        "kv_layout": layout,
        "exporter": exporter,
        "aux_layers": list(head.config.aux_layers),
        "draft_vocab_size": head.config.draft_vocab_size,
    }
    if qinfo:
        entry["quantization"] = qinfo
    if verify:
        entry["max_abs_diff"], scale = verify_head(head, embed, folder / layer_file, folder / fc_file, with_scale=True)
        # a quantised head differs from PyTorch by its rounding: only a wrong graph (an error of
        # the outputs' own size) fails
        if not entry["max_abs_diff"] <= (0.5 * scale if qinfo else 1e-2):
            raise RuntimeError(f"{layer_file}: ONNX Runtime differs from PyTorch by {entry['max_abs_diff']:.3g}")
    return entry


@torch.no_grad()
def verify_head(head, embed, layer_path, fc_path, seed: int = 0, with_scale: bool = False):
    """The graphs against the torch head on a chain call then a tree level; max abs difference
    (with_scale: and the largest absolute PyTorch output, -> (diff, scale))."""
    from arborspec.runtime.backends.onnxruntime import OrtEngine
    from arborspec.runtime.drafts.eagle3 import OrtProjection
    from arborspec.runtime.kvcache import KVCache

    g = torch.Generator().manual_seed(seed)
    c = head.config
    eng, fc = OrtEngine(layer_path), OrtProjection(fc_path)
    cache = KVCache(eng.info.cache, 32, 1)
    feats = torch.randn(5, c.feature_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, 5), generator=g)
    hid = fc(feats)
    worst = float((hid - head.project(feats)).abs().max())
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    empty = torch.zeros(0, 1, c.n_kv_heads, c.head_dim)
    lo, ho = eng.forward_hidden(ids, hid[None], torch.arange(5)[None], mask, cache)
    lr, hr, k, v = head(embed[ids], hid[None], torch.arange(5)[None], mask, empty, empty)
    worst = max(worst, float((lo - lr).abs().max()), float((ho - hr).abs().max()))
    cache.length = 5
    ids2 = torch.randint(0, c.vocab_size, (1, 3), generator=g)
    m2 = torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], 1)[None]
    m2[0, :, 3] = False
    pos = torch.tensor([[5, 5, 5]])
    lo2, ho2 = eng.forward_hidden(ids2, hr[:, -3:], pos, m2, cache)
    lr2, hr2, _, _ = head(embed[ids2], hr[:, -3:], pos, m2, k, v)
    worst = max(worst, float((lo2 - lr2).abs().max()), float((ho2 - hr2).abs().max()))
    eng.close()
    if with_scale:
        return worst, max(float(t.abs().max()) for t in (lr, hr, lr2, hr2))
    return worst
