"""The decode benchmark without a GPU: layers clocked one by one, what runs outside them counted once."""
from __future__ import annotations

import os

import pytest

from hybrid.bench.decode import project_cpu
from hybrid.config.compose import compose, to_settings
from hybrid.hw.detect import detect
from hybrid.kernels import thread_pool
from hybrid.engine.build import plan_for
from hybrid.run import bench


def test_cpu_projection_counts_what_is_outside_the_layers_once():
    # a slice of 1 dense + 2 MoE layers: 40 ms dense, 2 x 30 ms MoE, 90 ms of lm_head and sampling
    t = project_cpu({"dense_layers": 40e-3, "moe_layers": 60e-3, "outside_layers": 90e-3}, n_moe=2, n_dense=1)
    assert t == pytest.approx(58 * 30e-3 + 3 * 40e-3 + 90e-3)


def test_cpu_records_split_the_step_by_layer():
    s = to_settings(compose(["+hw=cpu_only", "mode=bench", "bench=decode", "bench.contexts=[16]", "bench.steps=3",
                             "bench.roof_gb=0.05", "policy.kv.max_context=64", "tracking.enabled=false"]))
    records = {r["name"]: r for r in bench(s, "cpu_only", detect(), plan_for(s, s.hw).cpu.kernel)["records"]}
    tpot_ms = records["tpot"]["value"] * 1e3
    assert 0 <= records["split.outside_layers"]["value"] < tpot_ms
    assert 0 < records["split.cpu_moe"]["value"] < tpot_ms, "the routed experts alone, the shared experts not in"
    assert "outside the layers, once" in records["projected_tpot_61_layers"]["projection"]
    assert 0 < records["split.lm_head"]["value"] < tpot_ms
    bound = records["decode_vs_all_bytes_bound"]
    assert 0 < bound["value"] <= 1.5 and bound["bound_s"] > 0, "every weight byte over the roof of the same run"
    assert records["all_bytes_per_token"]["lm_head_mb"] > 0
    attention = records["attention_per_layer"]
    assert 0 < attention["value"] < tpot_ms and attention["bound_ms"] > 0, "attention per layer over its roof bound"
    assert attention["vs_bound"] == pytest.approx(attention["value"] / attention["bound_ms"])
    assert attention["cache_bytes"] > 0 and attention["weight_bytes"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPU groups need two CPUs")
def test_numa_on_and_off_in_one_run():
    """bench.numa=[true, false] on two simulated nodes: each way on its own engine, every record tagged; with NUMA
    each node's local and remote roofs and the expert bytes each node read in a step."""
    s = to_settings(compose(["+hw=cpu_only", "mode=bench", "bench=decode", "bench.contexts=[16]", "bench.steps=2",
                             "bench.roof_gb=0.05", "policy.kv.max_context=64", "tracking.enabled=false",
                             "policy.cpu.threads=4", "policy.cpu.numa_simulated=2", "bench.numa=[true,false]"]))
    try:
        report = bench(s, "cpu_only", detect(), plan_for(s, s.hw).cpu.kernel)
    finally:
        thread_pool.set_groups([], [])
    records = report["records"]
    assert {r["numa"] for r in records} == {True, False}
    assert report["plans"]["numa_true"]["cpu.numa_threads"] == (2, 2) and not report["plans"]["numa_false"]["cpu.numa"]
    roofs = [r for r in records if r["name"] == "node_read_roof"]
    assert sorted((r["reader_node"], r["memory_node"]) for r in roofs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["numa"] and r["value"] > 0 and r["local"] == (r["reader_node"] == r["memory_node"]) for r in roofs)
    step = [r for r in records if r["name"] == "node_bytes_per_step"]
    assert len(step) == 1 and step[0]["numa"] and len(step[0]["node_mb"]) == 2 and step[0]["value"] > 0
    assert step[0]["node_bound_ms"] > 0
    assert sum(r["name"] == "tpot" for r in records) == 2
