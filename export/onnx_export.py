"""ONNX export of one contract forward (target or draft).

Role in one decoding step: none at run time. This writes the graph that every ONNX Runtime /
TensorRT call of a step runs (draft levels, the target's verify, prefills): inputs
`input_ids, position_ids, attention_mask, past_key.{i}, past_value.{i}`, outputs
`logits, new_key.{i}, new_value.{i}`, with B, T, P dynamic, the cache layout [P, B, Hkv, D] /
[T, B, Hkv, D], and ONNX metadata_props that make the file self-describing (contract version,
model config, tokenizer identity).

Exporter choice (measured, tiny llama 2 layers, torch 2.13 / onnxscript 0.7 / ORT 1.31):
dynamo opset 23 = 112 nodes (RMSNormalization, RotaryEmbedding fused), dynamo opset 20 = 163,
legacy opset 17 = 508. All three match PyTorch to ~1e-5 and give no NaN on a fully masked row
(the decoders use finfo.min, not -inf). So the default is dynamo + opset 23; the legacy
exporter is only a fallback when the dynamo export raises (it is deprecated in torch).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from arborspec.runtime.errors import InputError

log = logging.getLogger("arborspec.export")

DEFAULT_OPSET = 23
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2  # protobuf limit 2 GiB, minus headroom

from arborspec.runtime.contract import (  # noqa: F401,E402
    CONTRACT_VERSION,
    DTYPES,
    HIDDEN_STATES,
    META_CONFIG,
    META_CONTRACT,
    META_DTYPE,
    META_EXPORTER,
    META_FEATURE_LAYERS,
    META_KV_DTYPE,
    META_KV_LAYOUT,
    META_QUANTIZATION,
    META_RAGGED_ROWS,
    META_ROLE,
    META_TOKENIZER,
    META_TOPK,
    META_VERSION,
    TOPK_OUTPUTS,
    input_names,
    output_names,
)
from arborspec.runtime.fileio import sha256_file  # noqa: F401,E402

from .onnx_files import MAX_IR_VERSION, ExportResult, contract_metadata  # noqa: F401,E402
from .onnx_files import finalize as _finalize


def example_inputs(
    cfg, dtype: torch.dtype, b: int = 2, t: int = 3, p: int = 5, seed: int = 0, fully_masked_row: bool = False
):
    """Contract inputs with a random tree-like mask (each row sees the cache, itself and some
    earlier new tokens). Distinct sizes >= 2: a size-1 example would pin that dim to 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    pos = (p + torch.arange(t)).expand(b, t).contiguous()
    tri = torch.rand(b, t, t, generator=g) < 0.5
    tri = torch.tril(tri) | torch.eye(t, dtype=torch.bool)
    mask = torch.cat([torch.ones(b, t, p, dtype=torch.bool), tri], dim=2)
    if fully_masked_row:
        mask[0, t - 1] = False
    past = [torch.randn(p, b, cfg.n_kv_heads, cfg.head_dim, generator=g).to(dtype) for _ in range(2 * cfg.n_layers)]
    return ids, pos, mask, past


def _dims(cfg, max_context: int):
    from torch.export import Dim

    max_context = max(int(max_context), 16)
    b = Dim("batch", min=1, max=4096)
    t = Dim("tokens", min=1, max=max_context)
    p = Dim("past", min=0, max=max_context)
    s = Dim("context", min=1, max=2 * max_context)  # P + T: its own Dim (cannot be declared P+T)
    return b, t, p, s


class WithTopK(torch.nn.Module):
    """A contract module plus its own top-K per row (log-probs, ids): the draft graph's fused
    `topk_logprobs` / `topk_ids` outputs (runtime/contract.py TOPK_OUTPUTS)."""

    def __init__(self, module: torch.nn.Module, k: int):
        super().__init__()
        self.inner, self.k, self.config = module, k, module.config

    def forward(self, input_ids, position_ids, attention_mask, *past):  # the contract's argument names
        out = self.inner(input_ids, position_ids, attention_mask, *past)
        logits = out[0]
        logprobs = logits - torch.logsumexp(logits, -1, keepdim=True)
        vals, ids = torch.topk(logprobs, self.k, dim=-1)
        return (*out, vals, ids)


def _export_dynamo(module, args, names_in, names_out, cfg, opset, max_context):
    b, t, p, s = _dims(cfg, max_context)
    n_past = len(args) - 3
    ds = {
        "input_ids": {0: b, 1: t},
        "position_ids": {0: b, 1: t},
        "attention_mask": {0: b, 1: t, 2: s},
        "past": tuple({0: p, 1: b} for _ in range(n_past)),  # must be a tuple, one shared P
    }
    return quiet_dynamo_export(module, args, names_in, names_out, ds, opset)


def quiet_dynamo_export(module, args, names_in, names_out, dynamic_shapes, opset: int):
    """torch.onnx.export (dynamo) -> its ONNXProgram. torch.onnx prints progress lines and warns
    about torchvision ops: kept quiet for the CLI."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return torch.onnx.export(
            module,
            args,
            input_names=names_in,
            output_names=names_out,
            dynamic_shapes=dynamic_shapes,
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )


def _export_legacy(module, args, names_in, names_out, path, opset):
    axes = {
        "input_ids": {0: "batch", 1: "tokens"},
        "position_ids": {0: "batch", 1: "tokens"},
        "attention_mask": {0: "batch", 1: "tokens", 2: "context"},
        "logits": {0: "batch", 1: "tokens"},
    }
    for n in names_in[3:]:
        axes[n] = {0: "past", 1: "batch"}
    for n in names_out[1:]:
        batch_first = n in TOPK_OUTPUTS or n == HIDDEN_STATES
        axes[n] = {0: "batch", 1: "tokens"} if batch_first else {0: "tokens", 1: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=names_in,
            output_names=names_out,
            dynamic_axes=axes,
            opset_version=opset,
            dynamo=False,
        )


def check_symbolic_inputs(model, n_layers: int) -> None:
    """Every input dim is symbolic except the (Hkv, D) axes of the cache; B is one symbol
    everywhere and all pasts share one P symbol. Raises AssertionError otherwise."""
    inputs = {
        i.name: [d.dim_param if d.HasField("dim_param") else d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in model.graph.input
    }
    expected = input_names(n_layers)
    if list(inputs) != expected:
        raise AssertionError(f"graph inputs {list(inputs)} != contract {expected}")
    for name, dims in inputs.items():
        dyn = dims if not name.startswith("past_") else dims[:2]
        for d in dyn:
            if not isinstance(d, str) or not d:
                raise AssertionError(
                    f"input {name} has a fixed dim {d} in {dims}: "
                    "an example size of 1 pinned it; export with sizes >= 2"
                )
    batch = {inputs[n][0] for n in expected[:3]} | {inputs[n][1] for n in expected[3:]}
    pasts = {inputs[n][0] for n in expected[3:]}
    tokens = {inputs["input_ids"][1], inputs["position_ids"][1], inputs["attention_mask"][1]}
    if len(batch) != 1 or len(pasts) > 1 or len(tokens) != 1:
        raise AssertionError(f"dynamic dims not shared: batch {batch}, past {pasts}, tokens {tokens}")


def _external_files(path: Path) -> list[str]:
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    files = set()
    for t in _get_all_tensors(model):
        if uses_external_data(t):
            for e in t.external_data:
                if e.key == "location":
                    files.add(e.value)
    return sorted(files)


def _param_bytes(module: torch.nn.Module) -> int:
    seen, n = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += t.numel() * t.element_size()
    return n


def verify_against_torch(
    module,
    path: str | os.PathLike,
    cfg,
    dtype: torch.dtype,
    cases=((2, 3, 5), (1, 4, 0), (1, 1, 6)),
    relative: bool = False,
) -> float:
    """Run ORT (CPU) on random tree steps, including P=0 and T=1 and a fully masked row, and
    compare with the module. Returns the max abs diff over logits and new K/V (relative: each
    output's max abs diff divided by its max abs reference value); raises on NaN."""
    import numpy as np
    import onnxruntime as ort

    from arborspec.runtime.backends.ort_loader import qdq_exact_matmul

    so = ort.SessionOptions()
    so.log_severity_level = 3
    qdq_exact_matmul(so)
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = input_names(cfg.n_layers)
    worst = 0.0
    for j, (b, t, p) in enumerate(cases):
        ids, pos, mask, past = example_inputs(cfg, dtype, b, t, p, seed=100 + j, fully_masked_row=(j == 0))
        with torch.inference_mode():
            ref = module(ids, pos, mask, *past)
        feed = {}
        for n, x in zip(names, (ids, pos, mask, *past)):
            feed[n] = x.float().numpy().astype(np.float16) if x.dtype == torch.float16 else x.numpy()
        out = sess.run(None, feed)
        if np.isnan(out[0]).any():
            raise RuntimeError(f"{path}: NaN in ORT logits (B={b}, T={t}, P={p}, one row fully masked)")
        for o, r in zip(out, ref):
            if not np.issubdtype(o.dtype, np.floating):  # top-k ids: near-ties may swap
                continue
            d = float(np.abs(o.astype(np.float32) - r.float().numpy()).max())
            if relative:
                d /= max(float(r.float().abs().max()), 1e-12)
            worst = max(worst, d)
    return worst


def export_contract_onnx(
    module: torch.nn.Module,
    path: str | os.PathLike,
    opset: int = DEFAULT_OPSET,
    dtype: str = "fp32",
    *,
    tokenizer_sha256: str | None = None,
    role: str = "",
    max_context: int | None = None,
    exporter: str = "auto",
    verify: bool = True,
    tolerance: float | None = None,
    topk: int = 0,
    quantize: str | None = None,
    block_size: int = 32,
    gguf_path: str | None = None,
    feature_layers: list[int] | None = None,
) -> ExportResult:
    """Export a contract nn.Module (models/llama.py, models/gpt2.py) to `path`.

    exporter: "dynamo" (torch.export + onnxscript), "legacy" (TorchScript), or "auto"
    (dynamo, falling back to legacy opset min(opset, 17) if the dynamo export raises).
    dtype: fp32 | fp16 | bf16; the module is cast (a copy is not made: pass a module you own),
    logits stay float32 (the decoders cast them). verify: compare ORT with PyTorch on random
    tree steps (bf16 is not verified: ORT CPU has few bf16 kernels). topk: K > 0 adds the fused
    `topk_logprobs` / `topk_ids` outputs (draft graphs: the host never reads a full row).
    quantize: None, "int4" or "int8": the linear layers become blockwise QDQ (standard
    DequantizeLinear + MatMul, export/qdq.py; what TensorRT parses); with `gguf_path` (a GGUF
    with Q4_0/Q4_1/Q8_0 tensors) its blocks are carried over exactly, otherwise blockwise
    symmetric round-to-nearest of the float weights. feature_layers: add the contract's
    `hidden_states` output (the hidden states entering those layers, concatenated [B, T, len*H]:
    what an EAGLE-3 head reads; models/llama.py `feature_layers`), recorded in the metadata.
    """
    with _feature_layers_set(module, feature_layers):
        _check_options(dtype, exporter, quantize, block_size, gguf_path, opset)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        plan = _plan_export(module, dtype, max_context, topk)
        for f in [path, *path.parent.glob(path.name + "*.data")]:
            if f.exists():
                f.unlink()
        used, opset, reason = _export_graph(plan, path, opset, exporter)
        qinfo, big = None, plan.big
        if quantize:
            if used != "dynamo":
                raise RuntimeError(
                    f"--format qdq: {reason or 'the dynamo export failed'} (the legacy exporter "
                    "writes opset <= 17, too old for blocked DequantizeLinear)"
                )
            qinfo = _quantize_qdq(path, plan.module, quantize, block_size, gguf_path, dtype)
            big = bool(qinfo.pop("external_data"))
        meta = contract_metadata(plan.cfg, dtype, tokenizer_sha256, role, f"{used}:opset{opset}", "sbhd", plan.topk)
        if qinfo:
            meta[META_QUANTIZATION] = json.dumps(qinfo, sort_keys=True)
        if plan.features:
            meta[META_FEATURE_LAYERS] = json.dumps(plan.features)
        ir, nodes = _finalize(path, meta, big)
        import onnx

        check_symbolic_inputs(onnx.load(str(path), load_external_data=False), plan.cfg.n_layers)
        res = ExportResult(
            path=path,
            opset=opset,
            exporter=used,
            dtype=dtype,
            ir_version=ir,
            n_nodes=nodes,
            external_data=_external_files(path),
            fallback_reason=reason,
            quantization=qinfo,
        )
        if verify and dtype != "bf16":
            res.max_abs_diff = _self_check(plan, path, dtype, tolerance, quantize, qinfo)
        return res


@contextlib.contextmanager
def _feature_layers_set(module: torch.nn.Module, feature_layers: list[int] | None):
    """With `feature_layers` (checked), the module's `feature_layers` are these for the export,
    then restored; without, nothing changes."""
    if not feature_layers:
        yield
        return
    if not hasattr(module, "feature_layers"):
        raise InputError(f"{type(module).__name__} has no feature output (an EAGLE-3 draft needs a Llama target)")
    bad = [i for i in feature_layers if not 0 <= int(i) < module.config.n_layers]
    if bad:
        raise InputError(f"feature layers {bad} are outside the model's {module.config.n_layers} layers")
    saved = module.feature_layers
    module.feature_layers = [int(i) for i in feature_layers]
    try:
        yield
    finally:
        module.feature_layers = saved


def _check_options(dtype: str, exporter: str, quantize: str | None, block_size: int, gguf_path, opset: int) -> None:
    """One clear InputError for an option export_contract_onnx cannot honour."""
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    if exporter not in ("auto", "dynamo", "legacy"):
        raise InputError(f"unknown exporter {exporter!r}")

    if quantize not in (None, "int4", "int8"):
        raise InputError(f"unknown --quantize {quantize!r} (expected int4 or int8)")
    if quantize:
        if dtype not in ("fp32", "fp16"):
            raise InputError(f"--format qdq exports fp32 or fp16 activations, not {dtype}")
        if block_size not in (16, 32, 64, 128, 256):
            raise InputError(f"--block-size must be 16, 32, 64, 128 or 256, got {block_size}")
        if gguf_path and block_size != 32:
            raise InputError("a GGUF's blocks are 32 wide: --block-size 32 (or quantise from float weights)")
        if opset < 21:
            raise InputError(f"--format qdq needs opset >= 21 (blocked DequantizeLinear), not {opset}")
        if exporter == "legacy":
            raise InputError("--format qdq needs the dynamo exporter (the legacy one writes opset <= 17)")


@dataclass
class _ExportPlan:
    """What one contract export traces: the cast (maybe top-k wrapped) module, its example
    inputs, the graph's input/output names and the extra outputs it carries."""

    module: torch.nn.Module
    cfg: object
    tdtype: torch.dtype
    max_context: int
    names_in: list[str]
    names_out: list[str]
    topk: int
    features: list[int]
    args: tuple
    big: bool


def _plan_export(module: torch.nn.Module, dtype: str, max_context: int | None, topk: int) -> _ExportPlan:
    """Cast the module to `dtype` (in place), add the top-k head if asked, name the outputs."""
    tdtype = DTYPES[dtype]
    cfg = module.config
    module = module.to(dtype=tdtype).eval()
    max_context = int(max_context or cfg.max_position)
    names_in, names_out = input_names(cfg.n_layers), output_names(cfg.n_layers)
    topk = min(int(topk or 0), cfg.vocab_size)
    features = [int(i) for i in getattr(module, "feature_layers", None) or []]
    if topk > 0:
        if features:
            raise InputError("a graph with the feature output has no top-k outputs (targets only)")
        module = WithTopK(module, topk).eval()
        names_out = names_out + list(TOPK_OUTPUTS)
    if features:
        names_out = names_out + [HIDDEN_STATES]
    ids, pos, mask, past = example_inputs(cfg, tdtype)
    args = (ids, pos, mask, *past)
    big = _param_bytes(module) > EXTERNAL_DATA_THRESHOLD
    return _ExportPlan(module, cfg, tdtype, max_context, names_in, names_out, topk, features, args, big)


def _export_graph(plan: _ExportPlan, path: Path, opset: int, exporter: str) -> tuple[str, int, str | None]:
    """Write the graph with the dynamo exporter, or the legacy one (asked for, or the fallback
    of "auto" when dynamo raises). Returns (exporter used, opset written, fallback reason)."""
    used, reason = exporter, None
    if exporter in ("auto", "dynamo"):
        try:
            prog = _export_dynamo(
                plan.module, plan.args, plan.names_in, plan.names_out, plan.cfg, opset, plan.max_context
            )
            prog.save(str(path), external_data=plan.big)
            used = "dynamo"
        except Exception as e:  # noqa: BLE001 - reported, then fallback or re-raise
            if exporter == "dynamo":
                raise
            reason = f"dynamo export failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("%s; falling back to the legacy exporter", reason)
            used = "legacy"
    if used == "legacy":
        opset = min(opset, 17) if exporter == "auto" else opset
        _export_legacy(plan.module, plan.args, plan.names_in, plan.names_out, path, opset)
        if plan.big:
            import onnx

            m = onnx.load(str(path))
            onnx.save(
                m,
                str(path),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=path.name + ".data",
                size_threshold=1024,
            )
    return used, opset, reason


def _self_check(
    plan: _ExportPlan, path: Path, dtype: str, tolerance: float | None, quantize: str | None, qinfo: dict | None
) -> float:
    """Compare ONNX Runtime with PyTorch on random tree steps; raise past the tolerance.
    Round-to-nearest QDQ has no bound: its relative difference is recorded in `qinfo`."""
    rtn = qinfo is not None and qinfo["source"] != "gguf-blocks"
    diff = verify_against_torch(plan.module, path, plan.cfg, plan.tdtype, relative=rtn)
    tol = tolerance if tolerance is not None else (1e-2 if dtype == "fp32" else 1e-1)
    if rtn and tolerance is None:
        # round-to-nearest changes the weights: no bound here (NaN still raises above); the
        # relative difference is recorded and `arborspec compare` / `bench --quality` judge it
        qinfo["self_check_max_rel_diff"] = diff
        if diff > 0.5:
            log.warning(
                "%s: %s round-to-nearest weights move the outputs by %.3g of their size on random "
                "steps: check it with `arborspec compare` and `arborspec bench --quality`",
                path.name,
                quantize,
                diff,
            )
        tol = float("inf")
    if not diff <= tol:
        raise RuntimeError(
            f"{path.name}: ONNX Runtime differs from PyTorch by {diff:.3g} (> {tol:g}) on random tree steps"
        )
    return diff


def _quantize_qdq(path: Path, module, quantize: str, block_size: int, gguf_path: str | None, dtype: str) -> dict:
    """Rewrite the exported graph's linear layers as blockwise QDQ (export/qdq.py), in place.
    Returns the manifest's quantization entry (+ "external_data": whether it was saved so)."""
    import numpy as np
    import onnx

    from .gqa_graph import save_model
    from .qdq import apply_qdq, gguf_layer_lookup, rtn_layer_lookup

    bits = 4 if quantize == "int4" else 8
    np_dtype = np.float16 if dtype == "fp16" else np.float32
    if gguf_path:
        layer_for = gguf_layer_lookup(module, gguf_path, bits, np_dtype)
        source = "gguf-blocks"
    else:
        layer_for = rtn_layer_lookup(bits, block_size, np_dtype)
        source = "rtn-symmetric"
    model = onnx.load(str(path))  # with its external data, if any
    counts = apply_qdq(model, layer_for, block_size)
    if not counts["layers_by_type"]:
        raise InputError(
            f"--format qdq: no linear layer of {path.name} could be quantised"
            + (" (the GGUF holds them as floats)" if gguf_path else "")
        )
    for f in path.parent.glob(path.name + "*.data"):
        f.unlink()
    ext = save_model(model, path)
    return {
        "scheme": quantize,
        "format": "qdq",
        "block_size": block_size,
        "source": source,
        "zero_point": 0,
        **counts,
        "external_data": ext,
    }


def export_gqa_onnx(
    module,
    path: str | os.PathLike,
    dtype: str = "fp32",
    *,
    tokenizer_sha256: str | None = None,
    role: str = "",
    max_context: int | None = None,
    verify: bool = True,
    tolerance: float | None = None,
    topk: int = 0,
    quantize: str | None = None,
    block_size: int = 32,
    accuracy_level: int = 0,
    gguf_path: str | None = None,
    feature_layers: list[int] | None = None,
    kv_dtype: str = "fp32",
    progress: bool = False,
) -> ExportResult:
    """Export a Llama-family module, or a streamed weights source (export/weights.py), as ONNX
    Runtime's fast graph (export/gqa_graph.py: cache read and written in place, kv layout "bhsd");
    the steps are export/gqa_export.py's. dtype "fp32" or "fp16" (weights and activations);
    kv_dtype "fp32" or "fp16" (an fp32 graph's cache slabs); quantize: None, "int4" or "int8"
    weight-only MatMulNBits (export/quantize.py): a GGUF's own blocks (`gguf_path` for a module,
    or a GGUF source) are carried over as they are for "int4"; otherwise ONNX Runtime's blockwise
    round-to-nearest of the float weights."""
    from .gqa_export import GQAExport, export_gqa

    spec = GQAExport(
        dtype=dtype, quantize=quantize, block_size=block_size, accuracy_level=accuracy_level, kv_dtype=kv_dtype,
        topk=topk, feature_layers=feature_layers, max_context=max_context, verify=verify, tolerance=tolerance,
        tokenizer_sha256=tokenizer_sha256, role=role, gguf_path=gguf_path, progress=progress,
    )  # fmt: skip
    return export_gqa(module, path, spec)


def tokenizer_identity(tokenizer_json: str | os.PathLike | None) -> str | None:
    """sha256 of tokenizer.json (the tokenizer's identity in metadata and manifest)."""
    if tokenizer_json is None or not Path(tokenizer_json).is_file():
        return None
    return sha256_file(tokenizer_json)


def config_from_metadata(meta: dict[str, str]) -> dict:
    return json.loads(meta[META_CONFIG])
