#!/bin/bash
# thirteenth session: head run 15 (run 14 fine-tuned on this CPU over the corpus grown to 3.58M tokens) against run 14
exec bash "$(dirname "$0")/../../../tools/bench/head_end_to_end.sh" v21 v20 benchmarks/history/eagle3_run15_2026-11-27
