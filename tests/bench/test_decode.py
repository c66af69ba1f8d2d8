"""The decode benchmark on the CPU (tiny model): its records, and the full-model projection from a step's split."""
from __future__ import annotations

import pytest
import torch

from hybrid.bench.decode import DEVICE_PARTS, HOST_PARTS, project
from hybrid.config.compose import compose, to_settings
from hybrid.placement.passes import CpuExperts, cpu_experts, experts_to_cpu_kernels
from hybrid.engine.profile import StepProfile, TimedExperts
from hybrid.placement.staging import Staging
from hybrid.model.moe import MoE
from hybrid.engine.build import plan_for
from hybrid.run import bench
from hybrid.hw.detect import detect
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model


def test_projection_scales_moe_and_dense_layers_separately():
    # a slice of 1 dense + 1 MoE layer: 10 ms step, 4 ms of attention (2 ms a layer), 1 ms dense MLP
    t = project(10e-3, {"attention": 4e-3, "dense_mlp": 1e-3}, n_moe=1, n_dense=1)
    dense, moe = 2e-3 + 1e-3, 10e-3 - 3e-3
    assert t == pytest.approx(58 * moe + 3 * dense)


def test_decode_bench_records_on_the_cpu():
    s = to_settings(compose(["mode=bench", "bench=decode", "bench.contexts=[16,48]", "bench.steps=2",
                             "bench.roof_gb=0.05", "policy.kv.max_context=64", "tracking.enabled=false"]))
    report = bench(s, "auto", detect(), plan_for(s, s.hw).cpu.kernel)
    names = {r["name"] for r in report["records"]}
    assert {"read_roof", "tpot", "decode_vs_expert_bound", "gpu_idle_fraction", "cpu_idle_fraction",
            "split.attention", "split.cpu_moe", "projected_tpot_61_layers", "tpot_ratio"} <= names
    tpots = [r for r in report["records"] if r["name"] == "tpot"]
    assert [r["context"] for r in tpots] == [16, 48] and all(r["value"] > 0 for r in tpots)
    frac = [r for r in report["records"] if r["name"] == "decode_vs_expert_bound"]
    assert all(0 < r["value"] <= 1.5 for r in frac)


def test_step_profile_splits_the_step_and_puts_the_experts_back(tiny_dir):
    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(m, staging=Staging(256, 4, stage_on_cpu=True))
    moes = [x for x in m.modules() if isinstance(x, MoE)]
    layers = cpu_experts(m)
    t, pos = torch.randint(2, 320, (2, 6), generator=torch.Generator().manual_seed(0)), torch.arange(6)[None]
    want = m(t, pos)
    picked = []
    hooks = [x.gate.register_forward_hook(lambda mod, args, out: picked.append(out[1].unique().numel()))
             for x in moes]
    profile = StepProfile(m, torch.device("cpu"))
    assert all(isinstance(x.experts, TimedExperts) for x in moes) and cpu_experts(m) == layers
    m(t, pos)
    profile.reset()
    picked.clear()
    got = m(t, pos)
    parts = profile.summary()
    profile.close()
    for h in hooks:
        h.remove()
    assert torch.equal(got, want) and torch.equal(m(t, pos), want)
    assert set(parts) == set(DEVICE_PARTS + HOST_PARTS) | {"experts_read"}
    assert parts["stage"] > 0 and parts["cpu_moe"] >= parts["wait"] >= 0 and parts["to_device"] >= 0
    assert parts["experts_read"] == sum(picked) > 0
    assert [x.experts for x in moes] == layers and all(type(x) is CpuExperts for x in layers)
    assert profile.summary() == parts, "nothing counted once closed"
