#!/bin/bash
# ninth session end: int4 export v16 (head run 10), tune, bench beside v15 (packaged, llama.cpp) and held-out
set -u
cd /work/main
A=.venv/bin/arborspec
X=~/.cache/arborspec/exports
O=benchmarks/history/eagle3_run10_2026-11-27; mkdir -p $O
E=$X/smollm2-135m-int4-eagle3-int8-v16
[ -f $E/manifest.json ] || $A export --model smollm2-135m --draft eagle3 --quantize int4 --draft-quantize int8 --out $E --quiet
echo "exported $(date +%T)"
for d in export+lookup export; do
  $A tune --export-dir $E --draft $d --n-prompts 4 --calib-tokens 64 --max-nodes 12 --max-depth 4 --reps 5 --quiet > $O/tune_v16_${d}.log 2>&1
  echo "tuned $d rc $?: $(tail -n 2 $O/tune_v16_${d}.log | tr '\n' ' ')"
done
run() { local E=$1 P=$2; shift 2; local n=$(basename $E)
  $A bench --export-dir $E --limit-prompts 8 --max-new-tokens 64 --modes vanilla,chain,tree --chain chain:2 \
    --tree auto --mix-tree auto "$@" --json-out $O/bench_${n}_${P}.json > $O/bench_${n}_${P}.log 2>&1
  echo "bench $n $P rc $? $(date +%T)"; }
run $E packaged --baselines llama-cpp
run $X/smollm2-135m-int4-eagle3-int8-v15 packaged
run $E heldout --prompts tools/data/heldout_prompts.json
run $X/smollm2-135m-int4-eagle3-int8-v15 heldout --prompts tools/data/heldout_prompts.json
echo "done $(date +%T)"
