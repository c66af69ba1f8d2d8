"""bench=kernels on a small layer: the figures each MoE record carries, within what they can be; the plot."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid.bench import kernels
from hybrid.config.bench import KernelsBench
from hybrid.kernels import thread_pool
from hybrid.kernels.dispatch import available
from hybrid.plan.plan import CpuPlan
from tests.kernels.test_moe import CPUS, HALVES, two_nodes


class FixedRoof:
    """A roof read as a constant (the bench's own measures the machine: seconds here, not the point)."""

    def bracket(self, measure):
        record = measure()
        record.bound = 10.0
        return record


def test_moe_records_carry_time_and_the_threads_shares():
    cfg = KernelsBench(hidden=256, inter=128, moe_experts=8, top_k=2, moe_tokens=[1, 5], repeats=1)
    records = kernels._moe_records(cfg, FixedRoof(), [available()[0]], np.random.default_rng(0))
    assert [r.m for r in records] == [1, 5]
    for r in records:
        n = r.extra
        assert r.name == "moe_layer" and r.value > 0 and n["time_ms"] > 0 and n["global_syncs"] == 1
        # the threads' waiting, end-idle and per-stage seconds are shares of the threads' time: between 0 and 1, the
        # stages' and the waiting's together too; the GEMMs took some of it
        shares = [n[k] for k in ("waiting", "end_idle", "prep", "gate_up", "silu", "down", "sums")]
        assert all(0 <= s <= 1 for s in shares) and sum(shares) <= 1.01, n
        assert n["gate_up"] > 0 and n["down"] > 0, n


@pytest.mark.skipif(len(CPUS) < 2, reason="two CPU groups need two CPUs")
def test_moe_records_on_simulated_nodes_time_both_pools_and_each_nodes_bytes():
    """Under NUMA (simulated: two CPU groups) the layer is timed on the per-node pools and on one pool; the per-node
    records carry each node's MB (the layer's experts' bytes between them) against the nodes' local roofs; the pool
    is left in its node groups."""
    cpu = CpuPlan(threads=4, kernel="auto", moe_backend="native", gemm_tile_tokens=64, amx_min_tokens=4,
                  batch_invariant=False, deferred_experts=0, lm_head="bf16", amx_overlap=True, numa=True,
                  numa_simulated=2, numa_nodes=tuple(map(tuple, HALVES)), numa_threads=(2, 2), numa_split=(0.5, 0.5))
    cfg = KernelsBench(hidden=256, inter=128, moe_experts=8, top_k=2, moe_tokens=[5], repeats=1)
    with two_nodes():
        records = kernels._moe_records(cfg, FixedRoof(), [available()[0]], np.random.default_rng(0), cpu, [4.0, 5.0])
        assert thread_pool.groups() == HALVES
    assert [r.extra["pools"] for r in records] == ["one_pool", "per_node"]
    one, per_node = (r.extra for r in records)
    assert "node_mb" not in one and len(per_node["node_mb"]) == 2
    mb = sum(per_node["node_mb"])
    assert 0.999 * per_node["expert_mb_read"] <= mb <= 1.1 * per_node["expert_mb_read"], per_node  # + FP8 scales
    want = max(b / r for b, r in zip(per_node["node_mb"], (4.0, 5.0)))  # MB over GB/s: ms
    assert per_node["node_bound_ms"] == pytest.approx(want, rel=1e-3)


def test_plot_draws_each_kernel_beside_its_bound(tmp_path, monkeypatch):
    """The PNG's lines: every kernel's GEMM TFLOP/s (torch's paths beside them) under the FP8 memory roof of the
    run's best reading, and every kernel's MoE layer time over its experts' bytes at the highest roof beside it."""
    import matplotlib.axes

    from hybrid.bench import plot_bench
    from hybrid.bench.records import Record

    lines = {}
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, *a, **k: lines.setdefault(k["label"], (list(x), list(y)))
                        and real_plot(self, x, y, *a, **k))
    kernels_here = available()[:2]
    cfg = KernelsBench(hidden=256, inter=128, moe_experts=8, top_k=2, moe_tokens=[1, 4], repeats=1)
    layers = kernels._moe_records(cfg, FixedRoof(), kernels_here, np.random.default_rng(0))
    gemms = [Record("fp8_gemm.down", 20.0 * m, "GB/s", 40.0, m, 256, 128, "fp8",
                    {"tflops": 0.04 * m, "kernel": kernels_here[0]}) for m in (1, 2, 8)]
    gemms += [Record("torch_bf16.down", 10.0, "GB/s", 40.0, m, 256, 128, "bf16", {"tflops": 0.02 * m})
              for m in (1, 2, 8)]
    records = [Record("read_roof", 50.0, "GB/s")] + gemms + layers
    png = plot_bench("kernels", records, tmp_path / "kernels-x.json")
    assert png == tmp_path / "kernels-x.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lines[f"down, {kernels_here[0]}"] == ([1, 2, 8], [0.04, 0.08, 0.32])
    assert lines["torch_bf16.down"] == ([1, 2, 8], [0.02, 0.04, 0.16])
    assert lines["FP8 memory roof (50 GB/s, best reading)"] == ([1, 2, 8], [0.1, 0.2, 0.8])
    for kernel in kernels_here:
        assert lines[f"MoE layer, {kernel}"] == (
            [1, 4], [r.extra["time_ms"] for r in layers if r.extra["kernel"] == kernel])
    fastest = [min(r.extra["expert_mb_read"] / r.bound for r in layers if r.m == t) for t in (1, 4)]
    assert lines["experts' bytes at the roof (bound)"] == ([1, 4], fastest)
    assert plot_bench("kernels", [Record("read_roof", 50.0, "GB/s")], tmp_path / "none.json") is None
