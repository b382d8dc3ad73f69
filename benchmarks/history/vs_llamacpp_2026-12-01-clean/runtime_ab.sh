#!/bin/bash
# issue 57: decode speed of the runtime before (5504dc0, /tmp/old) and after (HEAD) on one export, alternated
set -u
cd /work/main
E=/work/cache/exports/smollm2-int4
OUT=${1:-/tmp/runtime_ab}; mkdir -p $OUT
ARGS="bench --export-dir $E --backend onnxruntime --modes vanilla,tree --tree static:$E/tree_auto.json --limit-prompts 8 --max-new-tokens 64"
for r in 1 2 3; do
  (cd /tmp && nice -n -10 /work/main/.venv/bin/python /tmp/oldrun.py $ARGS --json-out $OUT/old_$r.json > /dev/null 2>&1)
  nice -n -10 .venv/bin/arborspec $ARGS --json-out $OUT/new_$r.json > /dev/null 2>&1
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys, statistics
out = sys.argv[1]
for side in ("old", "new"):
    for cfg in ("vanilla", "tree"):
        v = []
        for r in (1, 2, 3):
            c = json.load(open(f"{out}/{side}_{r}.json"))["aggregate"]["configs"]
            a = c["vanilla"] if cfg == "vanilla" else next(x for k, x in c.items() if k != "vanilla")
            v.append(a["tokens_per_s_median"])
        print(side, cfg, [round(x, 1) for x in v], "median", round(statistics.median(v), 1))
PY
