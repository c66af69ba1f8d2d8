"""Timing on shared machines: the best of several passes (noise from neighbours only ever adds time)."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch


def best_per_call(calls: Sequence[Callable[[], object]], passes: int) -> float:
    """Seconds per call: every pass runs all `calls` once (one warm-up pass first); the fastest pass counts."""
    for c in calls:
        c()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for c in calls:
            c()
        best = min(best, (time.perf_counter() - t0) / len(calls))
    return best


def call_times(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of `reps` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def calls_for(budget_s: float, one_call_s: float, available: int, least: int = 4) -> int:
    """How many calls of a pass fit the time budget (at least `least`, at most what is available)."""
    return max(least, min(available, int(budget_s / max(one_call_s, 1e-9))))


def cuda_seconds(fn: Callable[[int], object], reps: int, warmup: int = 1) -> float:
    """Seconds per call of fn(i) on the GPU, i = 0, 1, ...: `warmup` calls first, then `reps` timed between two
    device synchronisations."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(reps):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps
