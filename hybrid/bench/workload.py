"""A workload (conf/workload/) driven straight at an Engine, in this process: no HTTP, no client. The tuner measures
its serving objectives with it (a trial is one pass of the workload on its engine).

The arrival process is the load driver's (hybrid/serve/load.py): the same requests (`plan_requests`, by the
workload's seed) at a fixed concurrency (each client sends its next request as its last one ends) or with Poisson
arrivals at `rate` (the same gaps). A request counts from its arrival: one that arrives during an engine step waits
for the step like it would at a server. Its tokens count when the step that made them returns. The statistics are
the load driver's (`report`): TTFT, TPOT and end-to-end percentiles, throughput, goodput.

    report = drive(engine, Workload("chat", (32, 256), (16, 128), 2.0, 0.2, requests=32, concurrency=4))
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

from hybrid.engine.requests import FinishReason, RequestError, SamplingParams
from hybrid.serve.load import Result, Workload, plan_requests, report


@dataclass
class _Live:
    prompt_tokens: int
    arrival: float
    times: list[float] = field(default_factory=list)  # when each step that gave it tokens returned
    tokens: int = 0


def drive(engine, w: Workload, model: str = "engine") -> dict:
    todo = deque(plan_requests(w, engine.model.args.vocab_size))
    gaps = random.Random(w.seed + 1)
    results: list[Result] = []
    live: dict[int, _Live] = {}
    t0 = time.perf_counter()
    next_arrival = t0

    def send(arrival: float) -> None:
        prompt, n = todo.popleft()
        try:
            rid = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        except RequestError as e:
            results.append(Result(len(prompt), 0, error=f"RequestError: {e}"))
            return
        live[rid] = _Live(len(prompt), arrival)

    while todo or live:
        now = time.perf_counter()
        if w.concurrency is not None:
            while todo and len(live) < w.concurrency:
                send(now)
        else:
            while todo and next_arrival <= now:
                send(next_arrival)
                next_arrival += gaps.expovariate(w.rate)
        if not engine.has_work():
            if todo and w.rate is not None:
                time.sleep(max(0.0, next_arrival - time.perf_counter()))
            continue
        outs = engine.step()
        done = time.perf_counter()
        for out in outs:
            r = live.get(out.id)
            if r is None:
                continue
            if out.new_token_ids:
                r.times.append(done)
                r.tokens += len(out.new_token_ids)
            if out.finished:
                del live[out.id]
                results.append(_result(r, out, done))
    return report(w, model, results, time.perf_counter() - t0)


def _result(r: _Live, out, end: float) -> Result:
    res = Result(r.prompt_tokens, r.tokens)
    if out.finish_reason not in (FinishReason.length, FinishReason.stop) or not r.times:
        res.error = out.error or f"finished: {out.finish_reason}"
        return res
    first, last = r.times[0], r.times[-1]
    res.ok, res.ttft_s, res.e2e_s = True, first - r.arrival, end - r.arrival
    res.tpot_s = (last - first) / (r.tokens - 1) if r.tokens > 1 else 0.0
    return res


def warm_up(engine, w: Workload) -> None:
    """A few short requests at the workload's shortest and longest prompts, as many as run at once: thread pools,
    allocations, both prefill paths where the cutoff splits the workload, decode graphs of those batch sizes."""
    lo, hi = w.prompt_tokens
    n = engine.plan.decode.batch_cap
    vocab = engine.model.args.vocab_size
    prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(lo if i % 2 else hi)] for i in range(n)]
    engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
