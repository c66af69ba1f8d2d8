"""The decode benchmark on the CPU (tiny model): its records, and the full-model projection from a step's split."""
from __future__ import annotations

import pytest

from hybrid.bench.decode import project
from hybrid.config.compose import compose, to_settings
from hybrid.run import bench
from hybrid.hw.detect import detect


def test_projection_scales_moe_and_dense_layers_separately():
    # a slice of 1 dense + 1 MoE layer: 10 ms step, 4 ms of attention (2 ms a layer), 1 ms dense MLP
    t = project(10e-3, {"attention": 4e-3, "dense_mlp": 1e-3}, n_moe=1, n_dense=1)
    dense, moe = 2e-3 + 1e-3, 10e-3 - 3e-3
    assert t == pytest.approx(58 * moe + 3 * dense)


def test_decode_bench_records_on_the_cpu():
    s = to_settings(compose(["mode=bench", "bench=decode", "bench.contexts=[16,48]", "bench.steps=2",
                             "bench.roof_gb=0.05", "policy.max_context=64", "tracking.enabled=false"]))
    report = bench(s, "auto", detect())
    names = {r["name"] for r in report["records"]}
    assert {"read_roof", "tpot", "decode_vs_expert_bound", "gpu_idle_fraction", "cpu_idle_fraction",
            "split.attention", "split.cpu_moe", "projected_tpot_61_layers", "tpot_ratio"} <= names
    tpots = [r for r in report["records"] if r["name"] == "tpot"]
    assert [r["context"] for r in tpots] == [16, 48] and all(r["value"] > 0 for r in tpots)
    frac = [r for r in report["records"] if r["name"] == "decode_vs_expert_bound"]
    assert all(0 < r["value"] <= 1.5 for r in frac)
