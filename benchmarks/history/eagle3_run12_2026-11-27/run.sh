#!/bin/bash
# eleventh session: head run 12 end to end. int4 export v18 (tuned) beside v17 (packaged and held-out
# prompts), fp32 exports with the run-12 and run-11 heads at T = 0 and T = 0.8 (fixed trees), one sitting
set -u
cd "$(dirname "$0")/../../.."
A=.venv/bin/arborspec
X=~/.cache/arborspec/exports
O=benchmarks/history/eagle3_run12_2026-11-27; mkdir -p $O
E=$X/smollm2-135m-int4-eagle3-int8-v18
F=$X/smollm2-135m-fp32-eagle3-int8-v18
[ -f $E/manifest.json ] || $A export --model smollm2-135m --draft eagle3 --quantize int4 --draft-quantize int8 --out $E --quiet
[ -f $F/manifest.json ] || $A export --model smollm2-135m --draft eagle3 --draft-quantize int8 --out $F --quiet
echo "exported $(date +%T)"
for d in export+lookup export; do
  $A tune --export-dir $E --draft $d --n-prompts 4 --calib-tokens 64 --max-nodes 12 --max-depth 4 --reps 5 --quiet > $O/tune_v18_${d}.log 2>&1
  echo "tuned $d rc $?: $(tail -n 2 $O/tune_v18_${d}.log | tr '\n' ' ')"
done
run() { local E=$1 P=$2; shift 2; local n=$(basename $E)
  $A bench --export-dir $E --limit-prompts 8 --max-new-tokens 64 --modes vanilla,chain,tree --quiet "$@" \
    --json-out $O/bench_${n}_${P}.json > $O/bench_${n}_${P}.log 2>&1
  echo "bench $n $P rc $? $(date +%T)"; }
INT4="--chain chain:2 --tree auto --mix-tree auto"
run $E packaged $INT4
run $X/smollm2-135m-int4-eagle3-int8-v17 packaged $INT4
run $E heldout $INT4 --prompts tools/data/heldout_prompts.json
run $X/smollm2-135m-int4-eagle3-int8-v17 heldout $INT4 --prompts tools/data/heldout_prompts.json
FP="--chain chain:3 --tree full:2,2 --mix-tree full:3,2"
run $F packaged $FP
run $X/smollm2-135m-fp32-eagle3-int8-v17 packaged $FP
run $F t08 $FP --temperature 0.8 --candidates topk,sample-unique
run $X/smollm2-135m-fp32-eagle3-int8-v17 t08 $FP --temperature 0.8 --candidates topk,sample-unique
echo "done $(date +%T)"
