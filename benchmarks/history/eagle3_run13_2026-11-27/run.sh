#!/bin/bash
# twelfth session: head run 13 (trained on an H200) against run 12, int4 and fp32 (what ran: the
# two scripts this one replaced, the same steps in another order)
exec bash "$(dirname "$0")/../../../tools/bench/head_end_to_end.sh" v19 v18 benchmarks/history/eagle3_run13_2026-11-27
