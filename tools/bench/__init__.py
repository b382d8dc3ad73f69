"""Benchmarks: decoding speed side by side, peers, baselines, runtime overhead, ORT profiles, output quality, the GPU benchmark."""
