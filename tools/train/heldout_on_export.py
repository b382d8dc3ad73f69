"""A head's held-out agreement on an export's own target: the held-out set (eagle3_heldout)
rebuilt with the export's target graph (its responses, features and greedy tokens) and the heads
measured on it, per depth and per kind of prompt. The head is trained on the fp32 target's
features; an int4 export (int8 activations) feeds it other features and judges it by other
tokens, and this says what that costs.

Role in one decode step: none; it measures step 1 (the head) against step 3 (this export's
verify) without decoding.

    python -m arborspec.tools.train.heldout_on_export --export-dir EXPORT --heads eagle3 DIR ...
"""

from __future__ import annotations

import json
from pathlib import Path

from arborspec.tools.errors import reports_mistakes
from arborspec.tools.options import tool_parser


@reports_mistakes("heldout_on_export")
def main(argv=None) -> int:
    p = tool_parser(
        __doc__,
        "python -m arborspec.tools.train.heldout_on_export",
        "example: python -m arborspec.tools.train.heldout_on_export --export-dir "
        "~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v12 --heads eagle3",
    )
    p.add_argument("--export-dir", type=Path, required=True, help="an export whose target outputs features")
    p.add_argument("--heads", nargs="+", default=["eagle3"], help="eagle3 (the shipped head) or head folders")
    p.add_argument(
        "--model", default="smollm2-135m", help="the target the export was made from (tokenizer, embeddings)"
    )
    p.add_argument("--threads", type=int, default=1, help="threads (default 1)")
    args = p.parse_args(argv)
    import torch

    from arborspec.models.eagle3 import default_aux_layers
    from arborspec.models.registry import cache_dir, load_model
    from arborspec.runtime.contract import read_manifest
    from arborspec.runtime.errors import ArborspecError
    from arborspec.tools.train import eagle3_heldout

    torch.set_num_threads(args.threads)
    man = read_manifest(args.export_dir)
    target = man.target
    outputs = [o["name"] for o in target.get("outputs", [])]
    if "hidden_states" not in outputs:
        raise ArborspecError(f"{args.export_dir}: its target has no features output (export it with --draft eagle3)")
    loaded = load_model(args.model)
    aux = default_aux_layers(loaded.config.n_layers)
    # keyed by the export's target graph: its held-out set is its own, not the fp32 target's
    root = cache_dir() / "eagle3-heldout-exports" / str(target["sha256"])[:16]
    folder = eagle3_heldout.build_heldout(
        loaded, aux, str(args.export_dir / target["file"]), root, threads=args.threads
    )
    embed = loaded.module.model.embed_tokens.weight.detach().float()
    out = {}
    for h in args.heads:
        head = eagle3_heldout.head_to_measure(h, args.model, loaded.config)
        out[h] = eagle3_heldout.evaluate_heldout(head, embed, folder)
        print(f"{h}: top-1 per depth {out[h]['top1_agreement_per_depth']}", flush=True)
    print(json.dumps({"export": str(args.export_dir), "heldout": str(folder), "heads": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
