#!/bin/bash
# The exact int4 export (make demo's, its tuned trees) beside llama.cpp on the same GGUF, on this
# machine's CPU (2 AMD EPYC Zen 5 cores), one sitting, the corpus grower paused: packaged and
# held-out prompts greedy, packaged at T = 0.8 with top-p 0.95 (a serving configuration; llama.cpp
# samples with the same cut). Usage: bash benchmarks/history/int4_vs_llamacpp_2026-11-27/run.sh VERSION [TAG]
# (TAG names the logs and JSON, default VERSION: a later sitting of the same export keeps the earlier's)
set -u
V=${1:?usage: run.sh VERSION [TAG] (the Makefile DEMO_EXPORT version, e.g. v21)}
TAG=${2:-$V}
cd "$(dirname "$0")/../../.."
O=benchmarks/history/int4_vs_llamacpp_2026-11-27
E=~/.cache/arborspec/exports/smollm2-135m-int4-eagle3-int8-$V
run() { local P=$1; shift
  .venv/bin/arborspec bench --export-dir $E --limit-prompts 8 --max-new-tokens 64 --modes vanilla,chain,tree \
    --chain chain:2 --tree auto --mix-tree auto --lookup-tree chain:1 --baselines llama-cpp --quiet "$@" \
    --json-out $O/${TAG}_$P.json > $O/${TAG}_$P.log 2>&1
  echo "bench $P rc $? $(date +%T)"; }
run packaged
run heldout --prompts tools/data/heldout_prompts.json
run packaged_t08_topp095 --temperature 0.8 --top-p 0.95
echo "done $(date +%T)"
