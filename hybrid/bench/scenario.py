"""A bench=concurrency scenario (nD, 1P, 1P+nD) and its run through the engine's scheduler: when each request's
tokens arrived, and what the decode steps' CPU-expert calls show (hybrid/bench/step_spans.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from hybrid.bench.step_spans import cpu_busy, cpu_experts_s, cpu_spans, layer_spans, step_parts
from hybrid.config.bench import scenario_counts


@dataclass(frozen=True)
class Scenario:
    name: str
    prompts: int  # long prompts (0 or 1)
    decodes: int  # requests decoding


def parse_scenario(name: str) -> Scenario:
    """'2D', '1P', '1P+2D' -> Scenario; anything else is a ConfigError naming the form (scenario_counts)."""
    return Scenario(name, *scenario_counts(name))


class _Driver:
    """Steps the engine and notes when each request's tokens arrive."""

    def __init__(self, engine):
        self.engine, self.times, self.errors = engine, {}, []

    def add(self, prompt: list[int], max_tokens: int) -> int:
        from hybrid.engine.requests import SamplingParams

        rid = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.times[rid] = []
        return rid

    def step(self) -> None:
        for out in self.engine.step():
            now = time.perf_counter()
            self.times.setdefault(out.id, []).extend([now] * len(out.new_token_ids))
            if out.finish_reason is not None and out.error:
                self.errors.append(out.error)
        if self.errors:
            raise RuntimeError(f"bench=concurrency: a request failed: {self.errors[0]}")

    def until(self, done, what: str, limit_s: float = 3600.0) -> None:
        t0 = time.perf_counter()
        while not done():
            if not self.engine.has_work() or time.perf_counter() - t0 > limit_s:
                raise RuntimeError(f"bench=concurrency: gave up waiting for {what}")
            self.step()

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def drain(self, rids) -> None:
        for rid in rids:
            self.engine.abort(rid)
        while self.engine.has_work():
            self.engine.step()


def _intervals(times: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens that overlap [start, end] (a step spanning the window counts whole)."""
    return [b - a for a, b in zip(times, times[1:]) if b > start and a < end]



def run_scenario(engine, sc: Scenario, d_prompts, p_prompt, new_tokens: int) -> dict:
    drv = _Driver(engine)
    room = engine.plan.kv.max_context
    ds = [drv.add(p, room - len(p)) for p in d_prompts[:sc.decodes]]
    out: dict = {}
    if ds:
        drv.until(lambda: all(len(drv.times[r]) >= 2 for r in ds), "the decodes' first tokens")
        cpu_spans(engine, True)
        cpu0, t0, ns0 = cpu_experts_s(engine), time.perf_counter(), time.monotonic_ns()
        drv.steps(new_tokens)
        t1, cpu1, ns1 = time.perf_counter(), cpu_experts_s(engine), time.monotonic_ns()
        ns_of = lambda t: ns1 + round((t - t1) * 1e9)  # noqa: E731 - a perf_counter time on the spans' clock
        out["before"] = [g for r in ds for g in _intervals(drv.times[r], t0, t1)]
        if cpu0 is not None:  # the CPU experts' share of a step, and the GPU's: what they leave of it
            out["cpu_s"] = (cpu1 - cpu0) / new_tokens
            if not sc.prompts:
                out["gpu_s"] = ((t1 - t0) - (cpu1 - cpu0)) / new_tokens
        out["before_tok_s"] = sum(t0 < t <= t1 for r in ds for t in drv.times[r]) / (t1 - t0)
    if sc.prompts:
        p = drv.add(p_prompt, 1)
        t_arrive, cpu0, steps0 = time.perf_counter(), cpu_experts_s(engine), len(drv.times[ds[0]]) if ds else 0
        drv.until(lambda: bool(drv.times[p]), "the long prompt's first token")
        t_first, cpu1 = drv.times[p][0], cpu_experts_s(engine)
        out["ttft"] = t_first - t_arrive
        if ds:
            out["during"] = [g for r in ds for g in _intervals(drv.times[r], t_arrive, t_first)]
            if cpu0 is not None and len(drv.times[ds[0]]) > steps0:  # decode's CPU experts per step meanwhile
                out["during_cpu_s"] = (cpu1 - cpu0) / (len(drv.times[ds[0]]) - steps0)
            out["during_tok_s"] = sum(t_arrive < t <= t_first for r in ds for t in drv.times[r]) / out["ttft"]
    drv.drain(ds)
    if ds:  # the spans taken once nothing runs (a step launched ahead notes its calls until collected)
        by_job = cpu_spans(engine, False)
        spans = [span for job_spans in by_job.values() for span in job_spans]
        if spans:  # the CPU's share of the timed steps, and what it waited per step
            busy = cpu_busy(spans, ns0, ns1)
            out["cpu_busy"], out["cpu_idle_s"] = busy / (ns1 - ns0), (ns1 - ns0 - busy) * 1e-9 / new_tokens
        if sc.decodes == 1 and spans:  # one request: its steps one after the other, split by their calls
            layers = layer_spans(engine, by_job)
            windows = {"before": (ns0, ns1)}
            if out.get("during"):
                windows["during"] = (ns_of(t_arrive), ns_of(t_first))
            for name, (a, b) in windows.items():
                parts = step_parts(layers, a, b)
                if parts:
                    out[f"{name}_parts"] = {k: v * 1e-9 for k, v in parts.items()}
    return out

