"""The `bench=serve` load driver against the test server: fixed concurrency and Poisson arrivals, a few requests
each; the report's counts, percentiles, throughput and goodput."""
from __future__ import annotations

import pytest

from hybrid.serve.load import Workload, plan_requests, run
from tests.serve.conftest import MODEL, wait_idle


def test_fixed_concurrency(server, tiny_model):
    w = Workload("tiny", prompt_tokens=(4, 12), output_tokens=(3, 6), ttft_limit_s=30.0, tpot_limit_s=5.0,
                 requests=6, concurrency=3)
    rep = run(w, f"{server.url}/v1", vocab_size=tiny_model.args.vocab_size)
    assert rep["model"] == MODEL and rep["requests"] == rep["completed"] == 6 and rep["errors"] == 0, rep
    drawn = sum(n for _, n in plan_requests(w, tiny_model.args.vocab_size))
    assert rep["output_tok_s"] * rep["duration_s"] == pytest.approx(drawn), "ignore_eos: exactly the drawn lengths"
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        p = rep[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert rep["e2e_s"]["p50"] >= rep["ttft_s"]["p50"]
    assert rep["goodput_req_s"] == rep["throughput_req_s"] > 0 and rep["slo_attainment"] == 1.0
    wait_idle(server)


def test_poisson_arrivals_and_an_unmet_limit(server, tiny_model):
    w = Workload("tiny-rate", prompt_tokens=(4, 8), output_tokens=(2, 4), ttft_limit_s=1e-6, tpot_limit_s=5.0,
                 requests=4, rate=20.0, seed=3)
    rep = run(w, f"{server.url}/v1", model=MODEL, vocab_size=tiny_model.args.vocab_size)
    assert rep["completed"] == 4 and rep["errors"] == 0, rep
    assert rep["goodput_req_s"] == 0 and rep["slo_attainment"] == 0, "no request meets a 1 us TTFT"
    assert rep["workload"]["rate"] == 20.0
    wait_idle(server)
