"""What a prefix-cache hit is measured against: the time to prefill a prompt's new suffix alone, its context already
in the KV cache — the work no cache can save (the suffix's own layers, and its attention over the context); and a
hit from the host tier against the same prompt cold.
"""
from __future__ import annotations

import random
import time
from typing import Optional, Sequence

import torch

from hybrid.engine.requests import SamplingParams
from hybrid.serve.load import FIRST_TOKEN_ID


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


def host_tier_hit(engine, context_tokens: int, suffix_tokens: int, seed: int = 0) -> Optional[dict]:
    """A prefix served from the host tier against the same prompt cold, on an idle engine: the time to the first
    token of a random prompt of context + suffix tokens never seen (cold); then prompts of random ids fill the
    device pool until the first prompt's blocks are all evicted (kept in the host tier); then its context with a
    new suffix (the hit). None where the engine has no host tier."""
    kv = engine.kv
    if kv.host is None:
        return None
    rng = random.Random(seed)
    vocab = engine.model.args.vocab_size
    draw = lambda n: [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]  # noqa: E731
    context = draw(context_tokens)
    cold_s = _first_token_s(engine, context + draw(suffix_tokens))
    fill = engine.plan.kv.max_context - 1
    evicted = kv.stats().evictions
    while kv.stats().evictions - evicted < kv.stats().device_blocks:  # every device block's room taken once
        _first_token_s(engine, draw(fill))
    before = kv.stats().host_hit_tokens
    hit_s = _first_token_s(engine, context + draw(suffix_tokens))
    return {"cold_s": cold_s, "host_hit_s": hit_s, "host_hit_tokens": kv.stats().host_hit_tokens - before,
            "context_tokens": context_tokens, "suffix_tokens": suffix_tokens}


def _first_token_s(engine, prompt: list[int]) -> float:
    done = engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return done.ttft_s
