"""bench=kernels' MoE records on a small layer: the figures each record carries, within what they can be."""
from __future__ import annotations

import numpy as np

from hybrid.bench import kernels
from hybrid.config.schema import BenchConfig
from hybrid.kernels.dispatch import available


class FixedRoof:
    """A roof read as a constant (the bench's own measures the machine: seconds here, not the point)."""

    def bracket(self, measure):
        record = measure()
        record.bound = 10.0
        return record


def test_moe_records_carry_time_and_the_threads_shares():
    cfg = BenchConfig(hidden=256, inter=128, moe_experts=8, top_k=2, moe_tokens=[1, 5], repeats=1)
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
