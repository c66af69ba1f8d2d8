"""The decode benchmark without a GPU: layers clocked one by one, what runs outside them counted once."""
from __future__ import annotations

import pytest

from hybrid.bench.decode import project_cpu
from hybrid.config.compose import compose, to_settings
from hybrid.hw.detect import detect
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
