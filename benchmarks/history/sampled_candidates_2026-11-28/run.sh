#!/bin/bash
# Sampled candidates before/after (nineteenth session): runtime/sampling.py and
# runtime/drafts/tree_builder.py at git revision OLD (default f316ef4, before the change) and the
# working tree's, swapped in turn for each seed; the T = 0.8 top-p 0.95 bench with topk and
# sample-unique candidates on the tuned tree and chain:2; writes {old,new}_s{SEED}.json beside
# this script (TAG=x: x{old,new}_...).
#   bash benchmarks/history/sampled_candidates_2026-11-28/run.sh ~/.cache/arborspec/exports/smollm2-135m-fp32-eagle3-int8-s18
set -e
E=${1:?usage: [OLD=rev] [SEEDS="0 1 2 3"] run.sh EXPORT_DIR}
OLD=${OLD:-f316ef4}
SEEDS=${SEEDS:-0 1 2 3}
here=$(cd "$(dirname "$0")" && pwd)
files="runtime/sampling.py runtime/drafts/tree_builder.py"
keep=$(mktemp -d)
for f in $files; do mkdir -p "$keep/$(dirname $f)"; cp $f "$keep/$f"; done
trap 'for f in $files; do cp "$keep/$f" $f; done' EXIT
for s in $SEEDS; do for v in old new; do
  for f in $files; do
    if [ $v = old ]; then git show "$OLD:$f" > $f; else cp "$keep/$f" $f; fi
  done
  .venv/bin/arborspec bench --export-dir "$E" --backend onnxruntime --temperature 0.8 --top-p 0.95 --seed $s \
      --modes vanilla,chain,tree --chain chain:2 --tree "static:$E/tree_auto.json" --candidates topk,sample-unique \
      --limit-prompts 8 --max-new-tokens 96 --json-out "$here/${TAG}${v}_s$s.json" > /dev/null
done; done
