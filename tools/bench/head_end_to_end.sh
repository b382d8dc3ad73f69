#!/bin/bash
# A newly installed EAGLE-3 head end to end on this CPU, against the head before it, one sitting
# (docs/drafts-training.md "Resume a run": what follows an install):
#   bash tools/bench/head_end_to_end.sh NEW OLD OUT     e.g. v19 v18 benchmarks/history/eagle3_run13_2026-11-27
# NEW / OLD: the DEMO_EXPORT versions (Makefile) of the new and the previous head; NEW's int4 and
# fp32 exports are made if missing (OLD's are the previous session's, in the user cache).
# 1. tune the int4 export's tree (export+lookup and export), 2. bench 8 prompts x 64 tokens:
# int4 NEW/OLD on the packaged and held-out prompts, fp32 NEW/OLD packaged, 3. greedy chain:3 on
# every packaged (30) and held-out (32) prompt x 128 tokens, int4 NEW/OLD (tokens a call is what
# compares heads; 8 x 64 leaves it within noise). Logs and JSON in OUT.
set -u
[ $# -eq 3 ] || { echo "usage: head_end_to_end.sh NEW OLD OUT (e.g. v19 v18 benchmarks/history/eagle3_run13_2026-11-27)" >&2; exit 2; }
NEW=$1 OLD=$2 O=$3
cd "$(dirname "$0")/../.."
A=.venv/bin/arborspec
X=~/.cache/arborspec/exports
mkdir -p "$O"
E=$X/smollm2-135m-int4-eagle3-int8-$NEW
F=$X/smollm2-135m-fp32-eagle3-int8-$NEW
[ -f $E/manifest.json ] || $A export --model smollm2-135m --draft eagle3 --quantize int4 --draft-quantize int8 --out $E --quiet
[ -f $F/manifest.json ] || $A export --model smollm2-135m --draft eagle3 --draft-quantize int8 --out $F --quiet
echo "exported $(date +%T)"
for d in export+lookup export; do
  $A tune --export-dir $E --draft $d --n-prompts 4 --calib-tokens 64 --max-nodes 12 --max-depth 4 --reps 5 --quiet > $O/tune_${NEW}_${d}.log 2>&1
  echo "tuned $d rc $?: $(tail -n 2 $O/tune_${NEW}_${d}.log | tr '\n' ' ')"
done
run() { local E=$1 P=$2; shift 2; local n=$(basename $E)
  $A bench --export-dir $E --limit-prompts 8 --max-new-tokens 64 --modes vanilla,chain,tree --quiet "$@" \
    --json-out $O/bench_${n}_${P}.json > $O/bench_${n}_${P}.log 2>&1
  echo "bench $n $P rc $? $(date +%T)"; }
INT4="--chain chain:2 --tree auto --mix-tree auto"
HELD="--prompts tools/data/heldout_prompts.json"
for v in $NEW $OLD; do run $X/smollm2-135m-int4-eagle3-int8-$v packaged $INT4; done
for v in $NEW $OLD; do run $X/smollm2-135m-int4-eagle3-int8-$v heldout $INT4 $HELD; done
FP="--chain chain:3 --tree full:2,2 --mix-tree full:3,2"
for v in $NEW $OLD; do run $X/smollm2-135m-fp32-eagle3-int8-$v packaged $FP; done
for P in packaged heldout; do
  args=(); [ $P = heldout ] && args=($HELD)
  for v in $NEW $OLD; do
    $A bench --export-dir $X/smollm2-135m-int4-eagle3-int8-$v --limit-prompts 32 --max-new-tokens 128 --modes vanilla,chain \
      --chain chain:3 --quiet "${args[@]}" --json-out $O/all_${v}_${P}.json > $O/all_${v}_${P}.log 2>&1
    echo "bench all $v $P rc $? $(date +%T)"
  done
done
echo "done $(date +%T)"
