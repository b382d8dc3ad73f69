#!/usr/bin/env bash
# Rounds of `arborspec train-draft` until END (HH:MM, UTC): each round grows the corpus, then
# trains, each resuming where the last round stopped; lowest CPU priority, one thread, progress
# as plain lines (stderr is a file). The last round trains only. Run it in the background:
#   nohup tools/train/rounds.sh 11:20 ~/.cache/arborspec/train/smollm2-135m-eagle3 --init eagle3 \
#       --lr 3e-4 --schedule-batches 300 --shard-prompts 32 --eval-minutes 30 > ~/.cache/arborspec/train/smollm2-135m-eagle3.log 2>&1 &
# CORPUS_MIN=0: training rounds only, each reading the shards the corpus then has, beside a
# separate run that grows it (`train-draft --minutes 0 --corpus-minutes N`; one run grows, others read).
# Stop early: kill the running `arborspec` (SIGTERM: it checkpoints, measures, writes the head).
set -u
END=$1 OUT=$2
shift 2
CORPUS_MIN=${CORPUS_MIN:-20} TRAIN_MIN=${TRAIN_MIN:-15}
mkdir -p "$OUT"
while :; do
    left=$(( ($(date -u -d "$END" +%s) - $(date -u +%s)) / 60 - 3 ))  # 3 min: load, final measure
    [ "$left" -lt 3 ] && break
    c=$CORPUS_MIN t=$TRAIN_MIN last=0
    if [ $((c + t)) -gt "$left" ]; then c=0 t=$left last=1; fi  # the last round trains only
    echo "$(date -u +%H:%M:%S) round: corpus $c min, training $t min"
    nice -n 19 arborspec train-draft --model "${MODEL:-smollm2-135m}" --out "$OUT" --threads "${THREADS:-1}" \
        --corpus-tokens "${CORPUS_TOKENS:-5000000}" --corpus-minutes "$c" --minutes "$t" --quiet "$@" || exit $?
    [ "$last" -eq 1 ] && break
done
