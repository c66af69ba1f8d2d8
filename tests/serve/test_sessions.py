"""The multi-turn workload: its config (conf/workload/agent.yaml, workload.kind multi_turn) and its checks, the
session planner, and the driver against the test server (each turn re-sends the conversation and its answer is the
engine's own greedy continuation); bench=serve's records, table and hit rate from made-up runs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybrid.bench import serve as bench_serve, sessions as bench
from hybrid.config import compose
from hybrid.config.bench import policy_keys
from hybrid.config.compose import settings_of
from hybrid.engine.engine import Engine
from hybrid.engine.requests import SamplingParams
from hybrid.errors import ConfigError
from hybrid.serve.load import FIRST_TOKEN_ID
from hybrid.serve.sessions import Run, Sessions, TurnResult, next_prompt, plan_sessions, run
from tests.serve.conftest import MODEL, PLAN, wait_idle
from tests.serve.test_cli import ROOT, _env

SMALL = Sessions("tiny-agent", sessions=2, concurrency=2, system_tokens=16, message_tokens=(4, 12),
                 output_tokens=(2, 5), context_tokens=80, ttft_limit_s=30.0, tpot_limit_s=5.0, seed=1)


# ------------------------------------------------------------------------------------------------------ config

def test_the_agent_workload_composes():
    s = settings_of(compose(["workload=agent"]))
    w = s.workload
    assert (w.kind, w.sessions, w.concurrency, w.system_tokens, w.context_tokens) == ("multi_turn", 4, 2, 1024, 32768)
    assert list(w.message_tokens) == [500, 4000] and list(w.output_tokens) == [100, 300] and w.rate is None
    d = bench.sessions_workload(s)
    assert d.message_tokens == (500, 4000) and d.concurrency == 2
    assert settings_of(compose([])).workload.kind == "single", "chat stays single-turn"


@pytest.mark.parametrize("overrides, error", [
    (["workload.kind=turns"], "workload.kind must be one of single, multi_turn"),
    (["workload.message_tokens=[500,40000]"], "= 41324 tokens, over workload.context_tokens 32768"),
    (["workload.context_tokens=1000"], "over workload.context_tokens 1000"),
    (["workload.message_tokens=[10,5]"], "workload.message_tokens must be [lo, hi]"),
    (["workload.output_tokens=[0,5]"], "workload.output_tokens must be [lo, hi]"),
    (["workload.rate=2"], "with workload.rate null"),
    (["workload.concurrency=null"], "with workload.rate null"),
    (["workload.sessions=0"], "workload.sessions must be >= 1"),
    (["workload.system_tokens=-1"], "workload.system_tokens >= 0"),
    (["workload.ttft_limit_s=0"], "must be > 0"),
])
def test_bad_agent_workloads_are_refused_naming_the_knob(overrides, error):
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        settings_of(compose(["workload=agent", *overrides]))


def test_single_turn_checks_stay():
    with pytest.raises(ConfigError, match="workload.prompt_tokens must be"):
        settings_of(compose(["workload.prompt_tokens=[0,5]"]))
    with pytest.raises(ConfigError, match="exactly one of workload.concurrency and workload.rate"):
        settings_of(compose(["workload.rate=2"]))


def test_multi_turn_needs_its_context_in_a_kv_slot_and_is_not_a_single_turn_load():
    s = settings_of(compose(["workload=agent", "policy.kv.max_context=8192"]))
    with pytest.raises(ConfigError, match="policy.kv.max_context >= 32768"):
        bench.check(s)
    with pytest.raises(ConfigError, match="workload agent is multi_turn"):
        bench_serve.workload(s)


# ----------------------------------------------------------------------------------------------------- planner

def test_the_plan_is_reproducible_by_seed_and_grows_as_a_conversation():
    system, sessions = plan_sessions(SMALL, 320)
    assert (system, sessions) == plan_sessions(SMALL, 320)
    assert plan_sessions(Sessions(**{**SMALL.__dict__, "seed": 2}), 320) != (system, sessions)
    assert len(system) == 16 and all(FIRST_TOKEN_ID <= t < 320 for t in system)
    assert len(sessions) == 2 and all(sessions) and sessions[0] != sessions[1]
    for turns in sessions:
        context, answer = len(system), 0
        for t in turns:
            assert SMALL.message_tokens[0] <= len(t.message) <= SMALL.message_tokens[1]
            assert SMALL.output_tokens[0] <= t.output_tokens <= SMALL.output_tokens[1]
            assert t.context_tokens == context + answer + len(t.message) and t.new_tokens == answer + len(t.message)
            assert t.context_tokens + t.output_tokens <= SMALL.context_tokens
            context, answer = t.context_tokens, t.output_tokens
        assert context + answer + SMALL.message_tokens[1] + SMALL.output_tokens[1] > SMALL.context_tokens, \
            "a session ends only where a next turn may not fit"
    assert next_prompt([1, 2], [3], (4, 5)) == [1, 2, 3, 4, 5]


def test_bad_sessions_are_refused():
    with pytest.raises(ValueError, match="over context_tokens 20"):
        Sessions(**{**SMALL.__dict__, "context_tokens": 20})
    with pytest.raises(ValueError, match="message_tokens must be"):
        Sessions(**{**SMALL.__dict__, "message_tokens": (3, 2)})


# ------------------------------------------------------------------------------------------------------ driver

def test_the_driver_reports_each_turn_and_resends_the_conversation(server, tiny_model, tiny_tok):
    vocab = tiny_model.args.vocab_size
    r = run(SMALL, f"{server.url}/v1", vocab_size=vocab)
    system, plans = plan_sessions(SMALL, vocab)
    rep = r.report()
    assert r.model == MODEL and rep["errors"] == 0 and rep["completed"] == rep["requests"] == r.planned
    assert rep["turns_planned"] == sum(len(p) for p in plans) and rep["sessions"] == 2
    assert [(t["session"], t["turn"]) for t in rep["turns"]] == [(i, k) for i, p in enumerate(plans)
                                                                 for k in range(len(p))]
    for row in rep["turns"]:
        planned = plans[row["session"]][row["turn"]]
        assert (row["context_tokens"], row["new_tokens"], row["output_tokens"]) == \
            (planned.context_tokens, planned.new_tokens, planned.output_tokens)
        assert row["ok"] and 0 < row["ttft_s"] <= row["e2e_s"] and row["tpot_s"] >= 0
    assert 0 < rep["ttft_s"]["p50"] <= rep["ttft_s"]["p99"] and rep["goodput_req_s"] == rep["throughput_req_s"] > 0
    solo = Engine(tiny_model, PLAN, tiny_tok)
    by = {(t.session, t.turn): t for t in r.turns}
    for i, turns in enumerate(plans):
        prompt, answer = system, []
        for k, planned in enumerate(turns):
            t = by[(i, k)]
            assert t.prompt == prompt + answer + list(planned.message), "the last prompt, its answer, the message"
            assert t.answer == solo.generate([t.prompt], SamplingParams(
                max_tokens=planned.output_tokens, temperature=0.0, ignore_eos=True))[0].output_ids
            prompt, answer = t.prompt, t.answer
    assert r.largest().prompt_tokens == max(t.context_tokens for p in plans for t in p)
    wait_idle(server)


# -------------------------------------------------------------------------------------------- bench records

def _run(ttfts: dict[tuple[int, int], float]) -> Run:
    contexts = {(0, 0): 600, (0, 1): 1500, (1, 0): 700, (1, 1): 3000}
    turns = [TurnResult(contexts[k], 3, ok=True, ttft_s=v, tpot_s=0.01, e2e_s=v + 0.02, session=k[0], turn=k[1],
                        new_tokens=500, prompt=list(range(contexts[k])), answer=[1, 2, 3]) for k, v in ttfts.items()]
    w = Sessions("w", 2, 2, 100, (400, 1400), (3, 3), 4000, 1.0, 1.0)
    return Run(w, "m", turns, 4, 2.0)


def test_records_by_context_the_longest_turn_and_the_hit_rate(capsys):
    on = _run({(0, 0): 0.2, (0, 1): 0.1, (1, 0): 0.3, (1, 1): 0.1})
    off = _run({(0, 0): 0.2, (0, 1): 0.5, (1, 0): 0.3, (1, 1): 0.8})
    hits = {True: bench.hit_rate({bench.HIT_TOKENS: 10, bench.QUERIED_TOKENS: 100},
                                 {bench.HIT_TOKENS: 60, bench.QUERIED_TOKENS: 200}),
            False: bench.hit_rate({}, {})}
    assert hits[True] == {"rate": 0.5, "hit_tokens": 50, "queried_tokens": 100}
    assert hits[False]["rate"] is None
    recs = bench.records_of(on, off, hits, bound=0.05)
    by = {(r.name, r.m): r for r in recs}
    assert by[("ttft_cache_on_s", 1024)].extra["turns"] == 2 and by[("ttft_cache_off_s", 4096)].value == 0.8
    assert by[("ttft_cache_on_s", 2048)].extra["context_mean"] == 1500
    longest = by[("ttft_longest_s", 3000)]
    assert (longest.value, longest.bound, longest.fraction_of_bound) == (0.1, 0.05, 2.0)
    assert longest.extra["off_over_on"] == pytest.approx(8.0) and by[("ttft_off_over_on", 3000)].value == 8.0
    rates = [r for r in recs if r.name == "prefix_cache_hit_rate"]
    assert len(rates) == 1 and rates[0].value == 0.5 and rates[0].extra["prefix_cache"] is True
    ttft = [r for r in recs if r.name == "ttft_s"]
    assert [(r.extra["prefix_cache"], r.extra["prefix_cache_hit_rate"]) for r in ttft] == [(True, 0.5), (False, None)]
    text = bench.turn_table(on.report()["turns"], off.report()["turns"], on.largest(), 0.05)
    assert "3000" in text and "0.800" in text and "TTFT / bound 2.00" in text
    assert [bench.bucket(n) for n in (1, 2, 3, 1024, 1025)] == [1, 2, 4, 1024, 2048]
    whole = TurnResult(8, 2, ok=True, new_tokens=8, prompt=list(range(8)))
    assert bench.suffix_bound(None, None) is None and bench.suffix_bound(None, whole) is None, "no cached context"


def test_the_servers_prefix_cache_counters_or_none(server):
    rate = bench.hit_rate(bench.counters(server.url), bench.counters(server.url))["rate"]
    assert rate is None or 0 <= rate <= 1


def test_the_plot_draws_multi_turn_runs_only(tmp_path):
    on = _run({(0, 0): 0.2, (0, 1): 0.1, (1, 0): 0.3, (1, 1): 0.1})
    recs = bench.records_of(on, on, {True: bench.hit_rate({}, {}), False: bench.hit_rate({}, {})}, bound=0.05)
    assert bench.plot(recs, tmp_path / "a.png") == tmp_path / "a.png" and (tmp_path / "a.png").stat().st_size > 0
    assert bench.plot([r for r in recs if r.name == "ttft_s"], tmp_path / "b.png") is None


@pytest.mark.skipif(bench.PREFIX_CACHE not in policy_keys(), reason=f"policy.{bench.PREFIX_CACHE} not in the schema")
def test_bench_serve_runs_the_agent_workload_with_the_prefix_cache_on_and_off(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hybrid", "mode=bench", "bench=serve", "workload=agent", "output=json",
                        "policy.kv.max_context=1024", "workload.context_tokens=1024", "workload.system_tokens=256",
                        "workload.message_tokens=[32,128]", "workload.output_tokens=[2,6]", "workload.sessions=3"],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    recs = report["records"]
    names = {r["name"] for r in recs}
    assert {"ttft_cache_on_s", "ttft_cache_off_s", "ttft_longest_s", "ttft_off_over_on"} <= names
    errors = [r for r in recs if r["name"] == "errors"]
    assert [(r["prefix_cache"], r["value"]) for r in errors] == [(True, 0), (False, 0)]
    on = next(r for r in recs if r["name"] == "ttft_s" and r["prefix_cache"])
    assert on["prefix_cache_hit_rate"] is None or 0 < on["prefix_cache_hit_rate"] <= 1
    assert "TTFT on s" in p.stderr and "longest: context" in p.stderr and report.get("plot")
