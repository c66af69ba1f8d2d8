"""Continuous batching: which requests hold KV slots, which prefill work runs in a step, which requests decode.

Each step: waiting requests are admitted into free KV slots in arrival order while fewer than `batch_cap` requests
hold one; then prefill work is picked — prompts up to `long_cutoff` tokens go in chunks, at most `chunk_tokens`
prompt tokens per step over the admitted requests in order (chunked prefill: the running requests keep decoding
between chunks). A prompt's chunks always end at multiples of `chunk_tokens`, whatever its batch mates leave of a
step's budget (a chunk that does not fit waits for the next step): how a prompt is cut changes its logits in the
last bits, and a request's tokens must not depend on its batch mates. A longer prompt, first in line, is prefilled
whole by stream-loading in that step (it holds decode meanwhile) — or, with `beside_decode`, on a thread of its own
while the steps go on (one such prompt at a time; the chunks behind it are not held up). Then every request that
was decoding at the start of the step decodes one token. Pure bookkeeping: the engine runs the model.

With two GPUs (`prefill_gpus` 2), a stream-loaded prompt is marked for both GPUs only when no request is decoding
in its step (`prefill_gpus`, the rule); otherwise one GPU prefills while the other GPU and the CPU decode.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from hybrid.engine.requests import Request, State


@dataclass(frozen=True)
class Chunk:
    request: Request
    start: int
    end: int
    streamed: bool  # stream-loading prefill (the whole rest of the prompt)
    gpus: int = 1  # GPUs the chunk's stream-loading prefill takes (prefill_gpus)
    beside: bool = False  # streamed on a thread of its own while the other requests go on (beside_decode)

    @property
    def last(self) -> bool:
        return self.end == len(self.request.prompt)


@dataclass
class StepPlan:
    prefill: list[Chunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def prefill_gpus(prompt_tokens: int, decoding: int, gpus: int, long_cutoff: Optional[int]) -> int:
    """GPUs a prompt's prefill takes: all `gpus` (policy.prefill.gpus, resolved) for a stream-loaded prompt (longer
    than long_cutoff) when no request is decoding; else one — the other GPU and the CPU keep serving decode."""
    if gpus < 1:
        raise ValueError(f"prefill needs at least one GPU to plan for, got {gpus}")
    streamed = long_cutoff is not None and prompt_tokens > long_cutoff
    return gpus if streamed and decoding == 0 else 1


class Scheduler:
    def __init__(self, slots: int, batch_cap: int, chunk_tokens: int, long_cutoff: Optional[int] = None,
                 gpus: int = 1, beside_decode: bool = False,
                 admitted: Callable[[Request], None] = lambda req: None):
        """long_cutoff: prompts whose part left to prefill is longer than this are stream-loaded (None: every prompt
        goes in chunks); gpus: the most GPUs a stream-loaded prompt may take (prefill_gpus); beside_decode: a
        stream-loaded prompt runs beside the other requests' decode and chunks (one at a time) instead of alone in
        its step; admitted(req): a request just took its slot (the engine sets what of its prompt is cached)."""
        if not 1 <= batch_cap <= slots:
            raise ValueError(f"batch_cap ({batch_cap}) must be between 1 and the {slots} KV slots")
        if chunk_tokens < 1:
            raise ValueError(f"prefill chunk must be >= 1 token, got {chunk_tokens}")
        self.batch_cap, self.chunk_tokens, self.long_cutoff = batch_cap, chunk_tokens, long_cutoff
        self.gpus, self.beside_decode, self.admitted = gpus, beside_decode, admitted
        self.free: list[int] = list(range(slots))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding a slot (prefilling or decoding), in admission order

    @property
    def slots_in_use(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        req.state = State.waiting
        self.waiting.append(req)

    def streamed(self, req: Request) -> bool:
        return self.long_cutoff is not None and len(req.prompt) - req.prefilled > self.long_cutoff

    def admit(self) -> list[Request]:
        admitted = []
        while self.waiting and self.free and len(self.running) < self.batch_cap:
            req = self.waiting.popleft()
            req.slot, req.state = self.free.pop(0), State.prefilling
            self.admitted(req)
            self.running.append(req)
            admitted.append(req)
        return admitted

    def plan(self) -> StepPlan:
        """Admit, then this step's prefill chunks and decode batch."""
        self.admit()
        plan = StepPlan(decode=[r for r in self.running if r.state is State.decoding])
        budget = self.chunk_tokens
        streaming = any(r.state is State.streaming for r in self.running)
        for req in self.running:
            if req.state is not State.prefilling or budget <= 0:
                continue
            if self.streamed(req) and self.beside_decode:
                if not streaming:  # one stream at a time; the chunks behind it go on
                    gpus = prefill_gpus(len(req.prompt) - req.prefilled, len(plan.decode), self.gpus, self.long_cutoff)
                    plan.prefill.append(Chunk(req, req.prefilled, len(req.prompt), streamed=True, gpus=gpus,
                                              beside=True))
                    streaming = True
                continue
            if self.streamed(req):
                if not plan.prefill:  # alone in its step: the whole prompt through the streamed weights
                    gpus = prefill_gpus(len(req.prompt) - req.prefilled, len(plan.decode), self.gpus, self.long_cutoff)
                    plan.prefill.append(Chunk(req, req.prefilled, len(req.prompt), streamed=True, gpus=gpus))
                break
            end = min(len(req.prompt), (req.prefilled // self.chunk_tokens + 1) * self.chunk_tokens)
            if end - req.prefilled > budget:
                break  # the next chunk goes first in a later step, in arrival order
            plan.prefill.append(Chunk(req, req.prefilled, end, streamed=False))
            budget -= end - req.prefilled
        return plan

    def one_device(self, beside_decode: bool, streams: bool) -> None:
        """The prefill peer is gone: a stream-loaded prompt takes this one device (beside decode as `beside_decode`
        says); where this process streams nothing itself (`streams` False), every prompt goes in chunks."""
        self.gpus, self.beside_decode = 1, beside_decode
        if not streams:
            self.long_cutoff = None

    def finish(self, req: Request) -> None:
        """Out of the queue or its slot (the slot is free for the next request)."""
        if req in self.running:
            self.running.remove(req)
            self.free.append(req.slot)
            self.free.sort()
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = State.finished
