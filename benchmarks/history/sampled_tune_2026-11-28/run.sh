#!/bin/bash
# The tree tuned for sampled decoding (`tune --temperature 0.8 --top-p 0.95`: its tree and the
# candidates it measured faster) against the greedy tune's tree with top-k candidates (the T = 0.8
# configuration before it), side by side in each run, T = 0.8 top-p 0.95, 8 packaged prompts x 96
# tokens, one run per seed; writes TAG_s{SEED}.json beside this script.
#   bash benchmarks/history/sampled_tune_2026-11-28/run.sh EXPORT_DIR TAG ["0 1 2 3"]
set -e
E=${1:?usage: run.sh EXPORT_DIR TAG [SEEDS]}
TAG=${2:?usage: run.sh EXPORT_DIR TAG [SEEDS]}
SEEDS=${3:-0 1 2 3}
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$E/tree_auto.sampled.json" ] || .venv/bin/arborspec tune --export-dir "$E" --temperature 0.8 --top-p 0.95 --quiet
for s in $SEEDS; do
  .venv/bin/arborspec bench --export-dir "$E" --backend onnxruntime --temperature 0.8 --top-p 0.95 --seed $s \
      --modes vanilla,tree --tree "auto;static:$E/tree_auto.json" --limit-prompts 8 --max-new-tokens 96 \
      --json-out "$here/${TAG}_s$s.json" > /dev/null
done
