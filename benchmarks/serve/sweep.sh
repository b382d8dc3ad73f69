#!/usr/bin/env bash
# Serving sweep (docs/serving.md): one server per configuration, loadtest at 1, 4 and 8
# concurrent streaming chat clients, 64 max tokens, greedy. JSON per run in $OUT.
#   bash benchmarks/serve/sweep.sh EXPORT_DIR [OUT]
set -euo pipefail
EXPORT=${1:?export dir}
OUT=${2:-benchmarks/serve/batched}
PORT=${PORT:-8123}
REQ8=${REQ8:-200}
mkdir -p "$OUT"
for cfg in "1 none" "1 lookup" "8 none" "8 lookup"; do
  set -- $cfg
  mb=$1 draft=$2
  arborspec serve --export-dir "$EXPORT" --draft "$draft" --tree full:3,2 --max-batch "$mb" --port "$PORT" &
  pid=$!
  for _ in $(seq 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.5; done
  for c in 1 4 8; do
    n=$((c == 1 ? 8 : 16)); if [ "$c" = 8 ] && [ "$mb" != 1 ]; then n=$REQ8; fi
    echo "max-batch $mb draft $draft clients $c requests $n"
    arborspec loadtest --url "http://127.0.0.1:$PORT" --concurrency "$c" --requests "$n" --stream --chat \
      --max-tokens 64 --json-out "$OUT/mb${mb}-${draft}-c${c}.json"
  done
  curl -s "localhost:$PORT/metrics" | grep -E "^arborspec_(mean_batch_size|mean_accepted|request_errors)" || true
  kill -TERM $pid; wait $pid || true
done
