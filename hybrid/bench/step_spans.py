"""The graphed decode steps' CPU-expert calls as their native jobs note them (bench=concurrency): the CPU experts'
time, the calls' spans by job and by MoE layer, where a step's time went, how long the CPU was busy.
"""
from __future__ import annotations

import statistics
from typing import Optional


def cpu_experts_s(engine) -> Optional[float]:
    """The CPU experts' time so far in graphed decode steps (their native jobs' own clocks); None when eager."""
    graphs = engine.graphs
    return None if graphs is None else sum(job.cpu_s for job in graphs.jobs())


def cpu_spans(engine, tracing: bool) -> dict[int, list[tuple[int, int]]]:
    """The graphed decode steps' CPU-expert calls since the last take, by job (id), each (submit, complete) in
    time.monotonic_ns() (their native jobs' notes); from now on noted while `tracing`. Taken only while no call
    runs (the workers write the notes)."""
    graphs = engine.graphs
    spans = {}
    for job in graphs.jobs() if graphs is not None else []:
        spans[id(job)] = job.take_spans()
        job.tracing = tracing
    return spans


def layer_spans(engine, spans: dict[int, list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """The single-batch steps' calls by MoE layer (lane 0's graphs), from cpu_spans' notes."""
    graphs = engine.graphs
    layers = graphs.layer_jobs() if graphs is not None else []
    return [[span for job in jobs for span in spans.get(id(job), [])] for jobs in layers]


def step_parts(layers: list[list[tuple[int, int]]], start: int, end: int) -> Optional[dict[str, float]]:
    """Where the decode steps within [start, end) spent their time, from their CPU-expert calls by MoE layer (one
    request decoding: the steps one after the other): per step, in the spans' unit, `cpu_experts` (the calls,
    submit to complete), `between_layers` (from a call's end to the next layer's submit: the GPU's work in
    between, inside the step's graph) and `between_steps` (from a step's last call to the next step's first: the
    host's end and start of a step, and the GPU's work after the last call and before the first). Means over the
    whole steps in the window that another step follows there; None without one."""
    calls = sorted((s, e, layer) for layer, spans in enumerate(layers) for s, e in spans if start <= s and e <= end)
    steps, step = [], []
    for call in calls:
        if call[2] == 0 and step:  # the first MoE layer's call opens a step
            steps.append(step)
            step = []
        step.append(call)
    if step:
        steps.append(step)
    order = list(range(len(layers)))  # a whole step: every layer's call once, in order
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if [c[2] for c in a] == order]
    if not pairs:
        return None
    return {"cpu_experts": statistics.fmean(sum(e - s for s, e, _ in st) for st, _ in pairs),
            "between_layers": statistics.fmean(sum(b[0] - a[1] for a, b in zip(st, st[1:])) for st, _ in pairs),
            "between_steps": statistics.fmean(nxt[0][0] - st[-1][1] for st, nxt in pairs)}


def cpu_busy(spans: list[tuple[int, int]], start: int, end: int) -> float:
    """The time within [start, end) when at least one CPU-expert call was pending (submitted, not complete), in
    the spans' unit: what the CPU had to do; the rest of the window it waited for the GPU or the host."""
    busy, reach = 0, start
    for s, e in sorted(spans):
        s, e = max(s, reach), min(e, end)
        if e > s:
            busy += e - s
            reach = e
    return busy

