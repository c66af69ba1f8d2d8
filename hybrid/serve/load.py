"""Load driver for `bench=serve`: streams completions at an OpenAI-compatible server (this one, or any other) through
the official `openai` AsyncOpenAI client, at a fixed concurrency or with Poisson arrivals, and reports what clients
see: TTFT (to the first chunk with text), TPOT and end-to-end latency percentiles, throughput, and goodput
(requests per second that met both the TTFT and the TPOT limit).

    w = Workload("chat", prompt_tokens=(64, 256), output_tokens=(16, 64), ttft_limit_s=2.0, tpot_limit_s=0.2,
                 requests=64, concurrency=8)
    report = run(w, base_url="http://127.0.0.1:8000/v1", vocab_size=129280)     # a plain dict

Prompts are random token ids (exact lengths, no tokenizer needed on the client) sent to /v1/completions with
`ignore_eos`, so each request generates exactly the output length drawn for it; or, with `prompts=Prompts.text(tok)`
(hybrid/serve/prompts.py), the text of such ids, for endpoints that take text prompts only.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Optional, Union

from hybrid.serve.prompts import FIRST_TOKEN_ID, Prompts

__all__ = ["FIRST_TOKEN_ID", "Prompts", "Result", "Workload", "drive", "plan_requests", "pool", "report", "run"]


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: tuple[int, int]  # lo, hi (inclusive), drawn uniformly per request
    output_tokens: tuple[int, int]
    ttft_limit_s: float
    tpot_limit_s: float
    requests: int
    concurrency: Optional[int] = None  # clients, each sending its next request when the last one ends
    rate: Optional[float] = None  # or: requests per second, Poisson arrivals, no bound on those in flight
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(f"workload {self.name}: set exactly one of concurrency and rate")
        if (self.concurrency is not None and self.concurrency < 1) or (self.rate is not None and self.rate <= 0):
            raise ValueError(f"workload {self.name}: concurrency must be >= 1 and rate > 0")
        for what, (lo, hi) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"workload {self.name}: {what} must be 1 <= lo <= hi, got ({lo}, {hi})")
        if self.requests < 1:
            raise ValueError(f"workload {self.name}: requests must be >= 1, got {self.requests}")


@dataclass
class Result:
    prompt_tokens: int
    output_tokens: int
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0


def pool(vocab: Union[int, Prompts]) -> Prompts:
    """Prompts of random ids below a vocabulary size, or the Prompts given."""
    return Prompts.ids(vocab) if isinstance(vocab, int) else vocab


def plan_requests(w: Workload, vocab: Union[int, Prompts]) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per request, reproducible by the workload's seed (`vocab`: the vocabulary
    size, or the Prompts to draw from)."""
    prompts = pool(vocab)
    rng = random.Random(w.seed)
    out = []
    for _ in range(w.requests):
        n = rng.randint(*w.prompt_tokens)
        out.append((prompts.draw(rng, n), rng.randint(*w.output_tokens)))
    return out


async def _one(client, model: str, prompt: list[int], max_tokens: int, prompts: Prompts) -> Result:
    res = Result(len(prompt), 0)
    t0 = time.perf_counter()
    first = last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompts.payload(prompt), max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
            if chunk.usage is not None:
                res.prompt_tokens, res.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
    except Exception as e:  # a failed request counts as an error, the run goes on
        res.error = f"{type(e).__name__}: {e}"
        return res
    end = time.perf_counter()
    first = first or end
    last = last or end
    res.ok, res.ttft_s, res.e2e_s = True, first - t0, end - t0
    res.tpot_s = (last - first) / (res.output_tokens - 1) if res.output_tokens > 1 else 0.0
    return res


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    s = sorted(xs)

    def pct(q: float) -> float:  # nearest rank
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "mean": sum(s) / len(s)}


async def drive(w: Workload, base_url: str, model: Optional[str] = None, api_key: str = "EMPTY",
                vocab_size: int = 256, timeout_s: float = 600.0, prompts: Optional[Prompts] = None) -> dict:
    """Runs the workload against base_url (…/v1); `model` None: the first the server lists; `prompts` None: random
    ids below vocab_size."""
    from openai import AsyncOpenAI

    prompts = prompts or Prompts.ids(vocab_size)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        todo = plan_requests(w, prompts)
        t0 = time.perf_counter()
        if w.concurrency is not None:
            queue = list(reversed(todo))
            results: list[Result] = []

            async def worker() -> None:
                while queue:
                    prompt, n = queue.pop()
                    results.append(await _one(client, model, prompt, n, prompts))
            await asyncio.gather(*(worker() for _ in range(min(w.concurrency, len(todo)))))
        else:
            rng = random.Random(w.seed + 1)
            tasks = []
            for prompt, n in todo:
                tasks.append(asyncio.ensure_future(_one(client, model, prompt, n, prompts)))
                await asyncio.sleep(rng.expovariate(w.rate))
            results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    finally:
        await client.close()
    return report(w, model, results, duration)


def report(w: Workload, model: str, results: list[Result], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft_s <= w.ttft_limit_s and r.tpot_s <= w.tpot_limit_s]
    out_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "workload": asdict(w), "model": model, "requests": len(results), "completed": len(ok),
        "errors": len(results) - len(ok), "error_messages": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "ttft_s": _percentiles([r.ttft_s for r in ok]), "tpot_s": _percentiles([r.tpot_s for r in ok]),
        "e2e_s": _percentiles([r.e2e_s for r in ok]),
        "throughput_req_s": len(ok) * per_s, "output_tok_s": out_tokens * per_s,
        "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) * per_s,
        "goodput_req_s": len(good) * per_s, "slo_attainment": len(good) / len(results) if results else 0.0,
    }


def run(w: Workload, base_url: str, model: Optional[str] = None, api_key: str = "EMPTY", vocab_size: int = 256,
        timeout_s: float = 600.0, prompts: Optional[Prompts] = None) -> dict:
    """`drive` from synchronous code (a fresh event loop)."""
    return asyncio.run(drive(w, base_url, model, api_key, vocab_size, timeout_s, prompts))
