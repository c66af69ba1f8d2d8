"""Soak: 32 concurrent streaming clients for a bounded time against one server (8 KV slots). No request may fail or
be left unfinished, the server must end idle, and the process's resident memory must stay flat: the mean of the last
window of samples may exceed the mean of the first (after a warm-up) by at most RSS_TOLERANCE_MB."""
from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import openai
import pytest

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.serve import ServerConfig
from tests.serve.conftest import MODEL, running, wait_idle

CLIENTS = 32
SOAK_S = float(os.environ.get("HYBRID_SOAK_S", 60))
WARMUP_S = 15.0
RSS_TOLERANCE_MB = 32.0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
def test_soak_32_streaming_clients(tiny_model, tiny_tok):
    plan = local_plan({"kv.max_batch": 8, "kv.max_context": 128, "decode.batch_cap": 8, "prefill.chunk_tokens": 64})
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            samples.append((time.monotonic(), _rss_mb()))

    with running(Engine(tiny_model, plan, tiny_tok), ServerConfig(max_waiting=64)) as srv:
        stats = {"started": 0, "ok": 0, "errors": []}

        async def client(i: int, ac: openai.AsyncOpenAI, deadline: float) -> None:
            rng = random.Random(i)
            while time.monotonic() < deadline:
                stats["started"] += 1
                try:
                    s = await ac.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"soak {i} " + "x" * rng.randint(1, 40)}],
                        max_tokens=rng.randint(2, 16), temperature=rng.choice([0.0, 0.8]), stream=True)
                    reason = None
                    async for chunk in s:
                        if chunk.choices and chunk.choices[0].finish_reason:
                            reason = chunk.choices[0].finish_reason
                    assert reason in ("stop", "length"), reason
                    stats["ok"] += 1
                except Exception as e:
                    stats["errors"].append(f"{type(e).__name__}: {e}")

        async def main() -> None:
            deadline = time.monotonic() + SOAK_S
            async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0, timeout=120) as ac:
                await asyncio.gather(*(client(i, ac, deadline) for i in range(CLIENTS)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        asyncio.run(main())
        stop.set()
        sampler.join()
        m = wait_idle(srv)

    assert not stats["errors"], stats["errors"][:5]
    assert stats["ok"] == stats["started"] > CLIENTS
    assert m["hybrid_kv_slots_in_use"] == 0 and m["hybrid_requests_running"] == 0
    assert m['hybrid_requests_total{outcome="stop"}'] + m['hybrid_requests_total{outcome="length"}'] == stats["ok"]
    warm = [rss for t, rss in samples if t - t0 >= WARMUP_S]
    window = max(1, len(warm) // 4)
    first, last = sum(warm[:window]) / window, sum(warm[-window:]) / window
    print(f"soak: {stats['ok']} requests in {SOAK_S:.0f} s; RSS first window {first:.1f} MB, last {last:.1f} MB")
    assert last - first <= RSS_TOLERANCE_MB, f"RSS grew from {first:.1f} MB to {last:.1f} MB"
