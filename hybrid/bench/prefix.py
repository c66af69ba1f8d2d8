"""The bound a prefix-cache hit is measured against: the time to prefill a prompt's new suffix alone, its context
already in the KV cache — the work no cache can save (the suffix's own layers, and its attention over the context).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch


def suffix_prefill_s(engine, context_ids: Sequence[int], suffix_ids: Sequence[int]) -> float:
    """Seconds to prefill suffix_ids at positions len(context_ids).. on an idle engine, with context_ids prefilled
    into the same slot first (not timed), the way the scheduler would: stream-loaded by the suffix's length where
    the engine streams, else in chunks ending at multiples of policy.prefill.chunk_tokens."""
    if engine.has_work():
        raise RuntimeError("suffix_prefill_s needs an idle engine (its requests hold the slots)")
    prompt = [int(t) for t in context_ids] + [int(t) for t in suffix_ids]
    start, end = len(context_ids), len(prompt)
    if not 0 < start < end:
        raise ValueError("suffix_prefill_s needs a context and a suffix, both non-empty")
    slot = engine.scheduler.free[0]
    runner = engine.runner
    engine.prefill(prompt[:start], slot=slot)  # the context, and blocks for the whole slot
    streamed = runner.streamed(end - start)
    chunk = engine.plan.prefill.chunk_tokens
    _sync(engine)
    t0 = time.perf_counter()
    if streamed:
        runner.prefill(prompt, start, end, slot, True)
    else:
        at = start
        while at < end:
            stop = min(end, (at // chunk + 1) * chunk)
            runner.prefill(prompt, at, stop, slot, False)
            at = stop
    _sync(engine)
    took = time.perf_counter() - t0
    engine.kv.release(slot)
    return took


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
