#!/usr/bin/env bash
# lm-evaluation-harness's loglikelihood requests against `arborspec serve` (echo + logprobs):
# a 30-question multiple-choice task of our own (mini.jsonl), offline.
#   bash benchmarks/history/lm_eval_2026-11-28/run.sh EXPORT_DIR PORT OUT
# Needs lm-eval[api]==0.4.13 and transformers in the Python on PATH (a venv of its own: lm-eval
# pins packages this project's venv does not want), and a server running:
#   arborspec serve --export-dir EXPORT_DIR --port PORT
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export_dir=$1 port=$2 out=$3
tmp=$(mktemp -d)
# lm-eval reads the tokenizer with transformers' AutoTokenizer: the export's tokenizer.json plus a
# one-line config naming its class
cp "$export_dir/tokenizer.json" "$tmp/"
echo '{"tokenizer_class": "PreTrainedTokenizerFast"}' > "$tmp/tokenizer_config.json"
mkdir -p "$tmp/tasks"
sed "s|MINI_JSONL|$here/mini.jsonl|" "$here/arbor_mini.yaml" > "$tmp/tasks/arbor_mini.yaml"
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval --model local-completions \
    --model_args "base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$tmp,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1" \
    --include_path "$tmp/tasks" --tasks arbor_mini --output_path "$out" --log_samples
