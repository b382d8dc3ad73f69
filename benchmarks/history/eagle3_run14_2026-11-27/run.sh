#!/bin/bash
# twelfth session: head run 14 (run 13 fine-tuned on this CPU over the corpus grown to 2.55M tokens) against run 13
exec bash "$(dirname "$0")/../../../tools/bench/head_end_to_end.sh" v20 v19 benchmarks/history/eagle3_run14_2026-11-27
