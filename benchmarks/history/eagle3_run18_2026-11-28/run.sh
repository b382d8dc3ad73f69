#!/bin/bash
# sixteenth session: head run 18 (run 17 fine-tuned on the H100 over the 6.95M-token corpus, 1400 batches of 32 windows) against run 17
exec bash "$(dirname "$0")/../../../tools/bench/head_end_to_end.sh" v24 v23 benchmarks/history/eagle3_run18_2026-11-28
