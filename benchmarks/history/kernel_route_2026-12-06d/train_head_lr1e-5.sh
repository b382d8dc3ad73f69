#!/bin/bash
# Issue 67 item 3, 31st session (2026-12-06): the run NEXT.md planned, at a lower rate: fine-tune the
# kinds-8k head (init-kinds8k) at lr 1e-5 on the featurised shards 560-603 (chat 560-567 + kinds 568-603),
# niced, one thread, 20-minute rounds that each checkpoint (run-s31/.train/train_state.pt). Re-run this
# file to resume where it stopped. Stop: kill the pid in train-s31.pid (it checkpoints first).
# Evaluate: python -m arborspec.tools.train.eagle3_heldout --model smollm2-135m --heads DIR --threads 1
set -u
H="$(cd "$(dirname "$0")" && pwd)"
REPO="${REPO:-/work/main}"
AS="$REPO/.venv/bin/arborspec"
C=~/.cache/arborspec/eagle3-corpus/807fdf97bde8c1902484
cd "$REPO"
for round in $(seq 1 200); do
  nice -n 19 "$AS" train-draft --model smollm2-135m --init "$H/init-kinds8k" --corpus "$C" --out "$H/run-s31" --threads 1 \
    --corpus-minutes 0 --shards 560:604 --featurised-prefix --minutes 20 --lr 1e-5 --schedule-batches 1500 \
    --eval-minutes 30 --quiet >> "$H/train-s31.log" 2>&1 &
  echo $! > "$H/train-s31.pid"; wait $!; rc=$?
  grep -q '"stopped": "schedule done"' "$H/run-s31/.train/training.json" 2>/dev/null && break
  grep -q '"stopped": "stopped by a signal"' "$H/run-s31/.train/training.json" 2>/dev/null && break
  [ -f "$H/stop" ] && break
  [ $rc -ne 0 ] && sleep 120
done
