"""`mode=bench bench=serve`: load against the real HTTP server. The engine is built from the configs, served by
mode=serve's app on a free local port in this process, and driven over HTTP through the official `openai` client
(hybrid/serve/load.py) with the workload (conf/workload/) at each of `bench.concurrency`.

Records per concurrency (m): TTFT, TPOT and end-to-end latency (value p50; p90, p99 beside it), throughput
(requests/s, output tokens/s), goodput (requests/s meeting both of the workload's limits) and SLO attainment.

A multi-turn workload (workload.kind multi_turn) runs at its own concurrency with the prefix cache on and off
instead (hybrid/bench/sessions.py). With `bench.endpoint` the workload is driven at that endpoint instead of a server
of our own (hybrid/bench/endpoint.py).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import replace

from hybrid.bench.records import Record, Records
from hybrid.config.schema import HybridConfig
from hybrid.errors import ConfigError


def workload(s: HybridConfig):
    """The configured workload as the load driver takes it."""
    from hybrid.serve.load import Workload

    w = s.workload
    if w.kind != "single":
        raise ConfigError(f"workload {w.name} is {w.kind}: bench=serve drives it (hybrid/bench/sessions.py); this "
                          f"measure takes single-turn workloads")
    return Workload(w.name, tuple(w.prompt_tokens), tuple(w.output_tokens), w.ttft_limit_s, w.tpot_limit_s,
                    w.requests, w.concurrency, w.rate, w.seed)


def workloads(s: HybridConfig):
    """The workload at each of bench.concurrency (or as configured)."""
    base = workload(s)
    return [replace(base, concurrency=c, rate=None) for c in s.bench.concurrency] or [base]


def check_fits(s: HybridConfig) -> None:
    """The workload's longest prompt and output fit a KV slot."""
    w = s.workload
    need = w.prompt_tokens[1] + w.output_tokens[1]
    if need > s.policy.kv.max_context:
        raise ConfigError(f"workload {w.name}: prompts up to {w.prompt_tokens[1]} + outputs up to "
                          f"{w.output_tokens[1]} tokens need policy.kv.max_context >= {need} "
                          f"(it is {s.policy.kv.max_context})")


def run(s: HybridConfig) -> list[Record]:
    for name in ("httpx", "httpx2"):  # the openai client's HTTP layer (by version): not a line per request
        logging.getLogger(name).setLevel(logging.WARNING)
    if s.bench.endpoint:
        from hybrid.bench.endpoint import run as run_endpoint

        return run_endpoint(s)  # one replica, a gateway, another server: nothing built here
    if s.workload.kind == "multi_turn":
        from hybrid.bench.sessions import run as run_sessions

        return run_sessions(s)
    from hybrid.engine.build import build
    from hybrid.serve import ServerThread, create_app
    from hybrid.serve.load import run as drive

    w = s.workload
    check_fits(s)
    loads = workloads(s)
    engine = build(s, s.hw, progress=False)
    name = s.server.model_name or s.model.name
    cfg = replace(s.server, max_waiting=max(s.server.max_waiting, w.requests))  # the bench measures, not sheds
    records = []
    with ServerThread(create_app(engine, cfg, name)) as srv:
        print(f"bench=serve: {name} on {srv.url}", file=sys.stderr)
        for load in loads:
            rep = drive(load, f"{srv.url}/v1", name, cfg.api_key or "EMPTY", engine.model.args.vocab_size)
            records += records_of(rep, load.concurrency)
            print(f"  concurrency {load.concurrency or f'rate {load.rate}/s'}: {rep['completed']}/{rep['requests']} "
                  f"done, TTFT p50 {rep['ttft_s']['p50']:.3f} s, TPOT p50 {rep['tpot_s']['p50'] * 1e3:.1f} ms, "
                  f"goodput {rep['goodput_req_s']:.2f} req/s", file=sys.stderr)
    return Records(records, {"plan": engine.plan.params()})


def records_of(rep: dict, concurrency) -> list[Record]:
    m = concurrency
    tails = lambda key: {"p90": rep[key]["p90"], "p99": rep[key]["p99"], "mean": rep[key]["mean"]}  # noqa: E731
    common = {"workload": rep["workload"]["name"], "requests": rep["requests"], "completed": rep["completed"],
              "errors": rep["errors"], "rate": rep["workload"].get("rate")}
    return [
        Record("ttft_s", rep["ttft_s"]["p50"], "s", None, m, extra={**tails("ttft_s"), **common}),
        Record("tpot_s", rep["tpot_s"]["p50"], "s", None, m, extra=tails("tpot_s")),
        Record("e2e_s", rep["e2e_s"]["p50"], "s", None, m, extra=tails("e2e_s")),
        Record("throughput_req_s", rep["throughput_req_s"], "req/s", None, m),
        Record("output_tok_s", rep["output_tok_s"], "tok/s", None, m),
        Record("goodput_req_s", rep["goodput_req_s"], "req/s", None, m,
               extra={"ttft_limit_s": rep["workload"]["ttft_limit_s"],
                      "tpot_limit_s": rep["workload"]["tpot_limit_s"]}),
        Record("slo_attainment", rep["slo_attainment"], "fraction", None, m),
        Record("errors", rep["errors"], "requests", None, m, extra={"messages": rep["error_messages"]}),
    ]
