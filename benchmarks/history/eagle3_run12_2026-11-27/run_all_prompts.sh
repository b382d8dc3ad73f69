#!/bin/bash
# eleventh session: run 12's head against run 11's on every packaged (30) and held-out (32) prompt,
# 128 tokens each, greedy chain:3 on the int4 exports v18 / v17 (tokens a call is what compares;
# run.sh's 8 prompts x 64 tokens left it within noise)
set -u
cd "$(dirname "$0")/../../.."
A=.venv/bin/arborspec
X=~/.cache/arborspec/exports
O=benchmarks/history/eagle3_run12_2026-11-27
for P in packaged heldout; do
  args=(); [ $P = heldout ] && args=(--prompts tools/data/heldout_prompts.json)
  for v in v18 v17; do
    E=$X/smollm2-135m-int4-eagle3-int8-$v
    $A bench --export-dir $E --limit-prompts 32 --max-new-tokens 128 --modes vanilla,chain --chain chain:3 --quiet \
      "${args[@]}" --json-out $O/all_${v}_${P}.json > $O/all_${v}_${P}.log 2>&1
    echo "bench $v $P rc $? $(date +%T)"
  done
done
