"""Prompts in, completions out: the engine's public surface stepped until every request has finished (tests,
benchmarks and warm-up; the server streams through hybrid/serve/loop.py instead)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from hybrid.engine.requests import FinishReason, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from hybrid.engine.engine import Engine


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""
    id: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason]
    error: str
    ttft_s: float
    tpot_s: float
    token_times: list[float]


def generate(engine: "Engine", prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
             on_output: Optional[Callable[[int, RequestOutput], None]] = None) -> list[Completion]:
    """Every prompt as a request (all queued at once), stepped until all finish; on_output(prompt index, output)
    as each step hands back progress (streaming)."""
    many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    for p, sp in zip(prompts, many):  # all or none queued
        engine.check([int(t) for t in p], sp)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, many)]
    index = {rid: i for i, rid in enumerate(ids)}
    reqs = {rid: engine.request(rid) for rid in ids}
    while any(not r.finished for r in reqs.values()):
        for out in engine.step():
            if on_output is not None and out.id in index:
                on_output(index[out.id], out)
    return [Completion(rid, list(r.prompt), list(r.output), r.text, r.finish_reason, r.error, r.ttft_s, r.tpot_s,
                       list(r.token_times)) for rid, r in reqs.items()]
