#!/bin/bash
# fourteenth session: head run 16 (run 15 fine-tuned on this CPU over the corpus grown to 4.78M tokens) against run 15
exec bash "$(dirname "$0")/../../../tools/bench/head_end_to_end.sh" v22 v21 benchmarks/history/eagle3_run16_2026-11-27
