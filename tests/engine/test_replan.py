"""`replan`: a new Engine around the placed model for a policy whose plan differs only where placement does not
read (what the tuner's trial worker does between trials), and the workload driven straight at it
(hybrid/bench/workload.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from hybrid.bench.serve import workload
from hybrid.bench.workload import drive, warm_up
from hybrid.config.compose import compose, to_settings
from hybrid.engine.build import build, replan
from hybrid.plan.plan import rebuildable
from hybrid.engine.requests import SamplingParams
from hybrid.errors import ConfigError
from hybrid.serve.load import Workload
from tuner.policy import checked


@pytest.fixture(scope="module")
def settings():
    return to_settings(compose(["+hw=cpu_only", "policy.kv.max_batch=4", "policy.decode.batch_cap=2"]))


def test_replan_keeps_the_model_and_applies_the_knobs(settings):
    s = settings
    engine = build(s, s.hw, progress=False)
    want = engine.generate([list(range(3, 40))], SamplingParams(8))[0].output_ids
    fewest = max(1, len(engine.plan.cpu.numa_nodes))  # one thread, or one per NUMA node (HYBRID_NUMA_SIMULATED)
    s2 = replace(s, policy=checked(s.policy, {"decode.batch_cap": 4, "prefill.chunk_tokens": 16,
                                              "cpu.threads": fewest, "cpu.gemm_tile_tokens": 8}))
    again = replan(engine, s2, s.hw)
    assert again.model is engine.model and again.cache is engine.cache
    assert (again.plan.decode.batch_cap, again.plan.prefill.chunk_tokens, again.plan.cpu.threads) == (4, 16, fewest)
    assert again.scheduler.batch_cap == 4 and again.scheduler.chunk_tokens == 16
    got = again.generate([list(range(3, 40))], SamplingParams(8))[0].output_ids
    assert got[:4] == want[:4]  # chunked differently: the same first tokens (last bits may differ)
    moved = replace(s, policy=checked(s.policy, {"cpu.moe_backend": "torch"}))
    with pytest.raises(ConfigError, match=r"policy\.cpu\.moe_backend changed"):
        replan(again, moved, s.hw)
    assert "cpu.moe_backend" not in rebuildable() and "decode.batch_cap" in rebuildable()


@pytest.mark.parametrize("arrivals", [{"concurrency": 2}, {"rate": 50.0}])
def test_workload_at_the_engine(settings, arrivals):
    s = settings
    engine = build(s, s.hw, progress=False)
    w = Workload("t", (4, 24), (2, 6), 5.0, 1.0, requests=5, **arrivals)
    warm_up(engine, w)
    rep = drive(engine, w, "tiny")
    assert rep["requests"] == rep["completed"] == 5 and rep["errors"] == 0
    assert 0 < rep["ttft_s"]["p50"] <= rep["ttft_s"]["p90"] and rep["tpot_s"]["p90"] > 0
    assert rep["goodput_req_s"] == rep["throughput_req_s"] > 0, "loose limits: every request counts"
    strict = drive(engine, replace(w, ttft_limit_s=1e-9), "tiny")
    assert strict["goodput_req_s"] == 0 and strict["completed"] == 5
    assert not engine.has_work()
    too_long = drive(engine, replace(w, prompt_tokens=(5000, 5000), requests=2), "tiny")
    assert too_long["errors"] == 2 and "max_context" in too_long["error_messages"][0]


def test_workload_of_the_config():
    s = to_settings(compose(["workload=rag"]))
    w = workload(s)
    assert w.name == "rag" and w.prompt_tokens == (2048, 8192) and w.concurrency == 2
