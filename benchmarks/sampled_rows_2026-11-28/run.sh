#!/bin/bash
# Sampled rows before/after (eighteenth session): runtime/sampling.py of the commit before
# (OLD=path) and the working tree's swapped in turn, two rounds, the T = 0.8 top-p 0.95 bench on
# `make demo`'s export; writes t08_{old,new}_{1,2}.json beside this script.
#   git show 031a941:runtime/sampling.py > /tmp/sampling_old.py
#   OLD=/tmp/sampling_old.py bash benchmarks/sampled_rows_2026-11-28/run.sh ~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-v24
set -e
E=${1:?usage: OLD=... run.sh EXPORT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
keep=$(mktemp); cp runtime/sampling.py "$keep"
trap 'cp "$keep" runtime/sampling.py' EXIT
for r in 1 2; do for v in old new; do
  if [ $v = old ]; then cp "$OLD" runtime/sampling.py; else cp "$keep" runtime/sampling.py; fi
  .venv/bin/arborspec bench --export-dir "$E" --backend onnxruntime --temperature 0.8 --top-p 0.95 \
      --modes vanilla,chain,tree --chain chain:2 --tree auto --limit-prompts 8 --max-new-tokens 96 \
      --json-out "$here/t08_${v}_$r.json" > /dev/null
done; done
