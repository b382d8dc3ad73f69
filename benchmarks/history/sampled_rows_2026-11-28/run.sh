#!/bin/bash
# Sampled rows before/after (eighteenth session): the runtime's sampling, accept and decode
# modules at git revision OLD (default 031a941, before the change) and the working tree's,
# swapped in turn, two rounds, the T = 0.8 top-p 0.95 bench on `make demo`'s export; writes
# t08_{old,new}_{1,2}.json beside this script (TAG=x: t08x_...; the committed ones without their
# per-prompt rows).
#   bash benchmarks/history/sampled_rows_2026-11-28/run.sh ~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24
set -e
E=${1:?usage: [OLD=rev] run.sh EXPORT_DIR}
OLD=${OLD:-031a941}
here=$(cd "$(dirname "$0")" && pwd)
files="runtime/sampling.py runtime/accept.py runtime/decode.py"
keep=$(mktemp -d)
for f in $files; do mkdir -p "$keep/$(dirname $f)"; cp $f "$keep/$f"; done
trap 'for f in $files; do cp "$keep/$f" $f; done' EXIT
for r in 1 2; do for v in old new; do
  for f in $files; do
    if [ $v = old ]; then git show "$OLD:$f" > $f; else cp "$keep/$f" $f; fi
  done
  .venv/bin/arborspec bench --export-dir "$E" --backend onnxruntime --temperature 0.8 --top-p 0.95 \
      --modes vanilla,chain,tree --chain chain:2 --tree 'auto;full:3,2' --limit-prompts 8 --max-new-tokens 96 \
      --json-out "$here/t08${TAG}_${v}_$r.json" > /dev/null
done; done
