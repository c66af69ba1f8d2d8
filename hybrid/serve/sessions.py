"""Multi-turn load for `bench=serve`: sessions that share one system prompt and grow turn by turn, streamed at an
OpenAI-compatible server's /v1/completions through the official `openai` AsyncOpenAI client, as an agent's chat client
re-sends its conversation.

    w = Sessions("agent", sessions=4, concurrency=2, system_tokens=1024, message_tokens=(500, 4000),
                 output_tokens=(100, 300), context_tokens=32768, ttft_limit_s=10.0, tpot_limit_s=0.2)
    run(w, base_url="http://127.0.0.1:8000/v1", vocab_size=129280).report()      # per turn and in aggregate

Turn k's prompt is turn k-1's prompt, the ids turn k-1 generated (vLLM's `return_token_ids` extension) and the new
message's random ids. Every length is drawn up front from the seed and each answer is exactly its drawn length
(`ignore_eos`), so two runs of one workload send prompts of the same lengths; the ids generated may differ. With
text prompts (`prompts=Prompts.text(tok)`, hybrid/serve/prompts.py) the conversation is sent as text and each answer
is re-sent as a stand-in of as many tokens (a random model's answer does not survive a round trip through text):
the next turn finds the previous prompt cached, not the answer.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from hybrid.serve.load import Prompts, Result, pool, report as load_report


@dataclass(frozen=True)
class Sessions:
    name: str
    sessions: int
    concurrency: int  # sessions in flight, each sending its next turn when its last one ends
    system_tokens: int  # the one system prompt every session starts with
    message_tokens: tuple[int, int]  # lo, hi (inclusive), drawn uniformly per turn
    output_tokens: tuple[int, int]
    context_tokens: int  # a session ends before a turn whose prompt and answer would exceed this
    ttft_limit_s: float
    tpot_limit_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        for what, (lo, hi) in (("message_tokens", self.message_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"workload {self.name}: {what} must be 1 <= lo <= hi, got ({lo}, {hi})")
        if self.sessions < 1 or self.concurrency < 1 or self.system_tokens < 0:
            raise ValueError(f"workload {self.name}: sessions and concurrency must be >= 1, system_tokens >= 0")
        first = self.system_tokens + self.message_tokens[1] + self.output_tokens[1]
        if first > self.context_tokens:
            raise ValueError(f"workload {self.name}: a first turn takes up to {first} tokens, over context_tokens "
                             f"{self.context_tokens}")


@dataclass(frozen=True)
class Turn:
    """One planned turn: its message's ids, its answer's length, and the prompt's length and new tokens (the
    message and the previous answer; turn 0's: its message) that follow from the plan."""
    message: tuple[int, ...]
    output_tokens: int
    context_tokens: int
    new_tokens: int


def plan_sessions(w: Sessions, vocab: Union[int, Prompts]) -> tuple[list[int], list[list[Turn]]]:
    """(the system prompt's ids, each session's turns), reproducible by the workload's seed (`vocab`: the vocabulary
    size, or the Prompts to draw from)."""
    prompts = pool(vocab)
    rng = random.Random(w.seed)
    system = prompts.draw(rng, w.system_tokens)
    sessions = []
    for _ in range(w.sessions):
        turns: list[Turn] = []
        context, answer = w.system_tokens, 0
        while True:
            m, o = rng.randint(*w.message_tokens), rng.randint(*w.output_tokens)
            prompt = context + answer + m
            if prompt + o > w.context_tokens:
                break
            turns.append(Turn(tuple(prompts.draw(rng, m)), o, prompt, answer + m))
            context, answer = prompt, o
        sessions.append(turns)
    return system, sessions


def next_prompt(prompt: list[int], answer: list[int], message) -> list[int]:
    """What a chat client sends next: the last prompt, its answer, the new message."""
    return [*prompt, *answer, *message]


@dataclass
class TurnResult(Result):
    """A turn as the client saw it (prompt_tokens: the context it sent)."""
    session: int = 0
    turn: int = 0
    new_tokens: int = 0
    prompt: list[int] = field(default_factory=list, repr=False)
    answer: list[int] = field(default_factory=list, repr=False)  # the ids generated

    def row(self) -> dict:
        return {"session": self.session, "turn": self.turn, "context_tokens": self.prompt_tokens,
                "new_tokens": self.new_tokens, "output_tokens": self.output_tokens, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "ok": self.ok, "error": self.error}


@dataclass
class Run:
    workload: Sessions
    model: str
    turns: list[TurnResult]  # in the order they ended
    planned: int  # turns in the plan (a failed turn ends its session)
    duration_s: float

    def report(self) -> dict:
        """The load driver's statistics over the turns (`requests`: turns sent), and a row per turn."""
        rep = load_report(self.workload, self.model, self.turns, self.duration_s)
        rows = sorted((t.row() for t in self.turns), key=lambda r: (r["session"], r["turn"]))
        return {**rep, "sessions": self.workload.sessions, "turns_planned": self.planned, "turns": rows}

    def largest(self) -> Optional[TurnResult]:
        """The completed turn of the longest context."""
        return max((t for t in self.turns if t.ok), key=lambda t: t.prompt_tokens, default=None)


async def _turn(client, model: str, prompt: list[int], max_tokens: int, prompts: Prompts) -> TurnResult:
    """One turn streamed; its answer's ids (vLLM's return_token_ids; with text prompts, as many ids as the usage
    counts where the server has no such extension)."""
    res = TurnResult(len(prompt), 0, prompt=prompt)
    t0 = time.perf_counter()
    first = last = None
    counted = 0
    try:
        stream = await client.completions.create(
            model=model, prompt=prompts.payload(prompt), max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            counted = chunk.usage.completion_tokens if chunk.usage is not None else counted
            ids = getattr(chunk.choices[0], "token_ids", None) if chunk.choices else None
            if ids or (chunk.choices and chunk.choices[0].text):
                last = time.perf_counter()
                first = first or last
                res.answer += ids or []
        if not res.answer and prompts.texts is not None:
            res.answer = list(range(counted))
        if first is None or not res.answer:
            raise RuntimeError("no token ids in the stream: the server lacks vLLM's return_token_ids")
    except Exception as e:  # a failed turn counts as an error and ends its session; the run goes on
        res.error = f"{type(e).__name__}: {e}"
        return res
    end = time.perf_counter()
    res.ok, res.output_tokens = True, len(res.answer)
    res.ttft_s, res.e2e_s = first - t0, end - t0
    res.tpot_s = (last - first) / (res.output_tokens - 1) if res.output_tokens > 1 else 0.0
    return res


async def drive(w: Sessions, base_url: str, model: Optional[str] = None, api_key: str = "EMPTY",
                vocab_size: int = 256, timeout_s: float = 600.0, prompts: Optional[Prompts] = None) -> Run:
    """Runs the sessions against base_url (…/v1); `model` None: the first the server lists; `prompts` None: random
    ids below vocab_size."""
    from openai import AsyncOpenAI

    prompts = prompts or Prompts.ids(vocab_size)
    system, plans = plan_sessions(w, prompts)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
    results: list[TurnResult] = []

    async def session(i: int) -> None:
        prompt, answer = system, []
        for k, t in enumerate(plans[i]):
            prompt = next_prompt(prompt, answer, t.message)
            res = await _turn(client, model, prompt, t.output_tokens, prompts)
            res.session, res.turn, res.new_tokens = i, k, len(answer) + len(t.message)
            results.append(res)
            print(f"  session {i} turn {k}: context {len(prompt)}, {res.new_tokens} new, "
                  + (f"TTFT {res.ttft_s:.3f} s" if res.ok else f"failed: {res.error}"), file=sys.stderr, flush=True)
            if not res.ok:
                return
            answer = prompts.stand_in(res.answer)

    queue = list(range(w.sessions))[::-1]

    async def worker() -> None:
        while queue:
            await session(queue.pop())
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(w.concurrency, w.sessions))))
        duration = time.perf_counter() - t0
    finally:
        await client.close()
    return Run(w, model, results, sum(len(p) for p in plans), duration)


def run(w: Sessions, base_url: str, model: Optional[str] = None, api_key: str = "EMPTY", vocab_size: int = 256,
        timeout_s: float = 600.0, prompts: Optional[Prompts] = None) -> Run:
    """`drive` from synchronous code (a fresh event loop)."""
    return asyncio.run(drive(w, base_url, model, api_key, vocab_size, timeout_s, prompts))
