#!/bin/bash
# Issue 67 items 2-3 (2026-12-06): fine-tune the shipped SmolLM2 EAGLE-3 head over a draft vocabulary
# re-chosen per kind (init-kinds8k: vocab_choice --write-head --size 8192) on the chat shards 566-567
# plus the kinds corpus 568-603, niced, one thread, 20-minute rounds. Re-run this file to resume:
# it unpacks the ids if the cache lost them, keeps `corpus_ids featurise` going (in shard order)
# and resumes the training from run/.train/train_state.pt, taking each round the shards featurised
# since (--featurised-prefix). Stop: kill the train-draft pid in train.pid (it checkpoints first).
set -u
H="${HEAD_RUN:-$HOME/.cache/arborspec/head-2026-12-06}"; mkdir -p "$H"
REPO="${REPO:-/work/wt-head}"; [ -d "$REPO" ] || REPO=/work/main
PY="$REPO/.venv/bin/python"; AS="$REPO/.venv/bin/arborspec"
C=~/.cache/arborspec/eagle3-corpus/807fdf97bde8c1902484
cd "$REPO"
if [ ! -f "$C/shards/00603/tokens.npy" ]; then
  "$PY" -m arborspec.tools.train.corpus_ids unpack --model smollm2-135m --ids tools/data/corpus/smollm2-135m-eagle3-ids.npz \
    tools/data/corpus/smollm2-135m-eagle3-ids-00{496,530,552,566,568}.npz --ids-only
fi
if [ ! -f "$H/init-kinds8k/model.safetensors" ]; then
  nice -n 19 "$PY" -m arborspec.tools.train.vocab_choice --model smollm2-135m --corpus "$C" --counts "$H/kind_counts.npz" \
    --write-head "$H/init-kinds8k" --size 8192 --out "$H/coverage-corpus.json"
fi
if ! { [ -f "$H/featurise.pid" ] && kill -0 "$(cat "$H/featurise.pid")" 2>/dev/null; }; then
  nohup nice -n 19 "$PY" -m arborspec.tools.train.corpus_ids featurise --model smollm2-135m --corpus "$C" \
    --shards 566:604 --threads 1 >> "$H/featurise.log" 2>&1 &
  echo $! > "$H/featurise.pid"
fi
featurised() {  # shards 566.. that hold their features, up to the first that does not
  local n=0; for s in $(seq 566 603); do [ -f "$C/shards/00$s/top1.npy" ] || break; n=$((n+1)); done; echo $n; }
MIN_SHARDS=${MIN_SHARDS:-5}  # chat 566-567 + kinds 568-570 at least: one shard alone overfits (run-566only)
for round in $(seq 1 200); do
  while [ "$(featurised)" -lt "$MIN_SHARDS" ] && [ ! -f "$H/stop" ]; do sleep 120; done
  nice -n 19 "$AS" train-draft --model smollm2-135m --init "$H/init-kinds8k" --corpus "$C" --out "$H/run" --threads 1 \
    --corpus-minutes 0 --shards 566:604 --featurised-prefix --minutes 20 --lr 5e-5 --schedule-batches 1500 \
    --eval-minutes 30 --quiet >> "$H/train.log" 2>&1 &
  echo $! > "$H/train.pid"; wait $!; rc=$?
  grep -q '"stopped": "schedule done"' "$H/run/.train/training.json" 2>/dev/null && break
  grep -q '"stopped": "stopped by a signal"' "$H/run/.train/training.json" 2>/dev/null && break
  [ -f "$H/stop" ] && break
  [ $rc -ne 0 ] && sleep 120   # e.g. no featurised shard yet
done
