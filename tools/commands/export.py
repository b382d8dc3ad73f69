"""`arborspec export`: write target.onnx, the draft, the tokenizer and manifest.json.

Role in one decoding step: none at run time; it produces the folder every step runs from
(see arborspec.export.export_folder).
"""

from __future__ import annotations

import sys

from arborspec.runtime.errors import InputError
from arborspec.tools.commands.options import command_parser

EXAMPLE = """examples:
  arborspec export --model smollm2-135m --draft layers:4 --out out/smollm2
  arborspec export --model ./my-hf-folder --draft bigram --out out/m --dtype fp16
  arborspec export --model big.gguf --draft small.gguf --out out/pair --max-context 4096
  arborspec export --model smollm2-135m --draft layers:4 --attention onnx --out out/trt  # for `arborspec build`
  arborspec export --model smollm2-135m --draft layers:4 --quantize int4 --out out/int4  # the GGUF's Q4_1 blocks
  arborspec export --model smollm2-135m --draft none --kv-dtype fp16 --out out/kv16  # fp32 weights, fp16 KV cache
  arborspec export --model smollm2-135m --draft layers:4 --quantize int4 --format qdq --out out/qdq  # for TensorRT
  arborspec export --model smollm2-135m --draft eagle3 --draft-quantize int8 --out out/e3  # int8 EAGLE-3 head
  arborspec export --model ./Llama-3.1-8B-Instruct --draft none --quantize int4 --max-context 4096 --out out/8b
"""


def register(sub) -> None:
    p = command_parser(
        sub,
        "export",
        "export target + draft to ONNX with a manifest",
        __doc__,
        EXAMPLE,
        description="Export a target model and its draft to ONNX (engine contract: "
        "input_ids, position_ids, tree attention_mask, per-layer KV) "
        "into one self-describing folder. The folder is written "
        "atomically: a failed export leaves nothing behind.",
    )
    _add_source_args(p)
    _add_graph_args(p)
    _add_quantisation_args(p)
    _add_limit_args(p)
    _add_run_args(p)
    p.set_defaults(run=run)


def _add_source_args(p) -> None:
    """What is exported and where: --model, --draft, --out."""
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME|PATH",
        help="registry name (smollm2-135m), Hugging Face folder, .gguf or nanoGPT .pt",
    )
    p.add_argument(
        "--draft",
        default="layers:2",
        metavar="SPEC",
        help="layers:K (the target's first K layers), bigram (a table from the target), eagle3[:DIR] "
        "(an EAGLE-3 head: the shipped one, or a `train-draft` folder), none, or a model NAME|PATH with the "
        "same vocabulary (default: layers:2); lookup needs no export: give it to generate/serve/bench",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")


def _add_graph_args(p) -> None:
    """The graph's dtypes and attention: --dtype, --attention, --kv-dtype."""
    p.add_argument(
        "--dtype",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="weights and KV cache dtype (logits stay float32); default fp32",
    )
    p.add_argument(
        "--attention",
        choices=["auto", "gqa", "onnx"],
        default="auto",
        help="gqa: ONNX Runtime's fast graph (GroupQueryAttention reads and writes the KV cache in "
        "place; Llama family, fp32); onnx: the portable graph TensorRT builds; auto (default): "
        "gqa where it applies",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["fp32", "fp16"],
        default="fp32",
        help="KV cache dtype of ONNX Runtime's graph (--attention gqa, fp32 weights): fp16 halves the "
        "cache; GroupQueryAttention then runs in fp16 between two Casts (default fp32)",
    )


def _add_quantisation_args(p) -> None:
    """Weight-only quantisation of the target and the EAGLE-3 draft."""
    p.add_argument(
        "--quantize",
        choices=["int4", "int8"],
        default=None,
        help="weight-only quantisation of the linear layers (ONNX Runtime MatMulNBits); from a GGUF "
        "with Q4_0/Q4_1/Q8_0 tensors, int4 carries the GGUF's own blocks over exactly",
    )
    p.add_argument(
        "--format",
        dest="qformat",
        choices=["matmulnbits", "qdq"],
        default="matmulnbits",
        help="form of the --quantize weights: matmulnbits (default; ONNX Runtime's com.microsoft "
        "MatMulNBits on the gqa graph) or qdq (standard blockwise DequantizeLinear + MatMul, "
        "opset 21+, on the portable --attention onnx graph: what TensorRT builds)",
    )
    p.add_argument(
        "--draft-quantize",
        choices=["int4", "int8"],
        default=None,
        help="weight-only quantisation of an EAGLE-3 head (MatMulNBits, int8 activations; gqa graph): "
        "the draft only proposes, so outputs stay exact; int8 cut its cost 30%% on SmolLM2",
    )
    p.add_argument("--block-size", type=int, default=32, metavar="N", help="quantisation block size (default 32)")
    p.add_argument(
        "--accuracy-level",
        type=int,
        default=None,
        metavar="N",
        help="MatMulNBits compute: 4 int8 activations (the default for --quantize int4: fastest, and exact under "
        "speculation through ONNX Runtime's row-invariant layout, docs/int4.md), 0 fp32 (the default otherwise)",
    )


def _add_limit_args(p) -> None:
    """The opset and the limits the runtime will use (context, tree size)."""
    p.add_argument(
        "--opset",
        type=int,
        default=None,
        metavar="N",
        help="ONNX opset (default 23: fused RMSNormalization/RotaryEmbedding)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="largest P+T the runtime will use (default: the model's max positions)",
    )
    p.add_argument(
        "--max-tree-nodes",
        type=int,
        default=None,
        metavar="N",
        help="largest tree (T of one verify call) the runtime will use (default 64)",
    )


def _add_run_args(p) -> None:
    """How the export runs: streamed reading, --force, the self-check, the progress bar."""
    p.add_argument(
        "--stream",
        choices=("auto", "on", "off"),
        default="auto",
        help="read a Hugging Face folder or GGUF a tensor at a time, writing each layer as it is read "
        "(peak memory: a few layers, not the model; ONNX Runtime's graph and the portable one, "
        "--attention onnx, --format qdq included); auto (default): for models over 2 GB in fp32",
    )
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument(
        "--no-verify", action="store_true", help="skip the ONNX Runtime vs PyTorch self-check after each export"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from arborspec.export.export_folder import DEFAULT_MAX_TREE_NODES, export_folder
    from arborspec.export.onnx_export import DEFAULT_OPSET

    if args.opset is not None and not 14 <= args.opset <= 23:
        raise InputError(f"--opset {args.opset} is not supported (14..23)")
    s = export_folder(
        args.model,
        args.out,
        args.draft,
        dtype=args.dtype,
        opset=args.opset or DEFAULT_OPSET,
        max_context=args.max_context,
        max_tree_nodes=args.max_tree_nodes or DEFAULT_MAX_TREE_NODES,
        force=args.force,
        progress=not args.quiet,
        verify=not args.no_verify,
        attention=args.attention,
        quantize=args.quantize,
        block_size=args.block_size,
        accuracy_level=args.accuracy_level,
        qformat=args.qformat,
        kv_dtype=args.kv_dtype,
        draft_quantize=args.draft_quantize,
        stream=args.stream,
    )
    t = s.manifest["target"]
    d = s.manifest["draft"]
    print(f"wrote {s.out}: {', '.join(s.files)}")
    q = t.get("quantization")
    qs = f", {q['scheme']} weights ({q['source']}, {q.get('format', 'matmulnbits')})" if q else ""
    kv = f", {t['kv_dtype']} KV cache" if t.get("kv_dtype", t["dtype"]) != t["dtype"] else ""
    print(f"  target: {t['nodes']} nodes, opset {t['opset']} ({t['exporter']}), {t['dtype']}{qs}{kv}")
    requantised = (q or {}).get("requantised_max_rel_error") or {}
    if requantised:  # GGUF types MatMulNBits cannot hold: rounded again, error relative to the layer's largest weight
        worst = max(requantised, key=requantised.get)
        print(f"  requantised {len(requantised)} GGUF layers to int4 (max error {requantised[worst]:.3g} of the largest weight, {worst})")
    if d.get("kind") == "onnx":
        print(f"  draft ({d.get('spec')}): {d['nodes']} nodes")
    elif d.get("kind") == "bigram":
        print(f"  draft: bigram table top-{d['top_k']}")
    elif d.get("kind") == "eagle3":
        dq = d.get("quantization")
        print(f"  draft ({d.get('spec')}): EAGLE-3 head, {dq['scheme'] + ' weights' if dq else 'fp32'}")
    from arborspec.runtime.export_dir import int8_activation_level

    if int8_activation_level(t):
        print(
            "  note: int8 activations: chain/tree output == vanilla only through ONNX Runtime's row-invariant "
            "layout (the default; ARBORSPEC_ORT_ROW_LAYOUT=0 turns it off: inexact trees)"
        )
    sys.stdout.flush()
    return 0
