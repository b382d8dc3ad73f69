"""bench --governed (tools/bench/decoding.with_governed): every speculative configuration of ours
runs ungoverned and governed side by side."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import random_model, tiny_config

from arborspec.runtime.backends.torch_backend import TorchEngine
from arborspec.tools.bench.decoding import build_configs, make_decoders, with_governed


def test_bench_governed_runs_each_speculative_config_both_ways():
    """`bench --governed`: ungoverned rows as named, governed twins beside them (peers untouched)."""
    cfgs = with_governed(build_configs(["vanilla", "tree"], ["chain:2"], "chain:4", ["openvino"]))
    assert [(c.name, c.adaptive) for c in cfgs] == [
        ("vanilla", None),
        ("chain:2", False),
        ("chain:2~governed", True),
        ("openvino", None),
    ]
    target = TorchEngine(random_model(tiny_config("llama", vocab=64, layers=2, hidden=32, heads=2, kv=1), seed=1))
    models = SimpleNamespace(target=target, draft=target, limits={})
    decs = make_decoders(models, cfgs, None)
    assert [decs[n].config.governed for n in ("chain:2", "chain:2~governed")] == [False, True]
    assert decs["chain:2~governed"].start([3, 4, 5], 2).governor is not None
