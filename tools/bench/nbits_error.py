"""How far int8 activations (MatMulNBits accuracy level 4) move one GGUF layer's output, by how
the Q4_1 blocks are carried: zero point 0 with offset m, or zero point 8 with offset m + 8d.

Role in one decode step: none; it measures the rounding that every int4 linear layer of step 3
(the verify call) adds. Both forms are the same weights; they differ in what MatMulNBits' int8
rounding of x multiplies: with zero point 0 the q-part carries each block's mean (7.5 d), and the
exact float offset term cannot cancel the rounding error that mean picks up. Real activations:
SmolLM2's hidden states entering the layer over the packaged held-out text.

    python -m arborspec.tools.bench.nbits_error --layer 10 --tokens 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

LINEARS = {"q": "self_attn.q_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "down": "mlp.down_proj"}


def level4_output(nb, x: np.ndarray, accuracy_level: int = 4) -> np.ndarray:
    """x [T, K] through one MatMulNBits node of `nb`'s blocks, plus its block offsets added the way
    the export adds them (float block sums of x @ offsets^T)."""
    from arborspec.tools.bench.nbits_kernels import matmul_nbits_session

    s = matmul_nbits_session(nb.blob, nb.scales, nb.zero_points, nb.k, nb.n, accuracy_level)
    y = s.run(None, {"x": np.ascontiguousarray(x, np.float32)})[0]
    if nb.offsets is not None:
        y = y + x.reshape(len(x), -1, 32).sum(-1) @ nb.offsets.T
    return y


def zero_point_0(nb):
    """The same Q4_1 weights carried as zero point 0 and offset m (the form before 2026-11-26)."""
    d = nb.scales.reshape(nb.n, -1)
    zp = nb.zero_point_values()
    return dataclasses.replace(nb, zero_points=np.zeros_like(nb.packed_zero_points()), offsets=nb.offsets - zp * d)


def relative_error(y: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(((y - exact) ** 2).mean() / (exact**2).mean()))


def activations(lm, layer: int, tokens: int) -> dict:
    """The inputs of `layer`'s q, o, gate and down projections over the held-out text (fp32);
    `lm`: the loaded model (models.registry.load_model)."""
    from pathlib import Path

    import torch

    m, cfg = lm.module.eval(), lm.config
    text = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()
    ids = torch.tensor([lm.tokenizer.encode(text)[:tokens]])
    got, blk = {}, m.model.layers[layer]
    hooks = [
        mod.register_forward_hook(lambda _m, inp, _o, k=k: got.__setitem__(k, inp[0][0].numpy().astype(np.float32)))
        for k, mod in (
            ("q", blk.self_attn.q_proj),
            ("o", blk.self_attn.o_proj),
            ("gate", blk.mlp.gate_proj),
            ("down", blk.mlp.down_proj),
        )
    ]
    t = ids.shape[1]
    past = [torch.zeros(0, 1, cfg.n_kv_heads, cfg.head_dim)] * (2 * cfg.n_layers)
    with torch.no_grad():
        m(ids, torch.arange(t)[None], torch.ones(1, t, t, dtype=torch.bool).tril(), *past)
    for hk in hooks:
        hk.remove()
    return got


def measure(layer: int, tokens: int) -> list[dict]:
    from arborspec.export.quantize import GGUFBlocks
    from arborspec.models.registry import load_model, smollm2_path

    lm = load_model("smollm2-135m")
    cfg = lm.config
    blocks = GGUFBlocks(smollm2_path(), cfg.n_heads, cfg.n_kv_heads)
    acts = activations(lm, layer, tokens)
    rows = []
    for name, hf in LINEARS.items():
        nb = blocks.linear(f"model.layers.{layer}.{hf}.weight")
        x = acts[name]
        exact = x.astype(np.float64) @ nb.dequantize().T.astype(np.float64)
        row = {"layer": f"{layer}.{name}", "k": nb.k, "n": nb.n, "source": nb.source}
        row["level0"] = relative_error(level4_output(nb, x, 0), exact)
        row["level4_zero_point_8"] = relative_error(level4_output(nb, x), exact)
        if nb.offsets is not None:
            row["level4_zero_point_0"] = relative_error(level4_output(zero_point_0(nb), x), exact)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m arborspec.tools.bench.nbits_error",
        description=__doc__.split("\n\n")[0],
        epilog="example: python -m arborspec.tools.bench.nbits_error --layer 10 --tokens 256",
    )
    p.add_argument("--layer", type=int, default=10, help="decoder layer (default 10)")
    p.add_argument("--tokens", type=int, default=256, help="held-out tokens run through the model (default 256)")
    args = p.parse_args(argv)
    if args.tokens < 32 or args.layer < 0:
        print("nbits_error: --tokens must be >= 32 and --layer >= 0", file=sys.stderr)
        return 2
    try:
        rows = measure(args.layer, args.tokens)
    except (IndexError, KeyError) as e:
        print(f"nbits_error: no such layer: {e}", file=sys.stderr)
        return 2
    for r in rows:
        print(json.dumps({k: (f"{v:.3e}" if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
