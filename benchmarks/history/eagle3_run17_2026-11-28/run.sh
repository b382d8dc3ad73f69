#!/bin/bash
# fifteenth session: head run 17 (run 16 fine-tuned on this CPU over the corpus grown to 6.48M tokens) against run 16
exec bash "$(dirname "$0")/../../../tools/bench/head_end_to_end.sh" v23 v22 benchmarks/history/eagle3_run17_2026-11-28
