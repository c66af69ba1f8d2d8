"""An agent turn on the service's request path (hybrid/serve/service.py), for the endpoints that translate to it
(/v1/messages, /v1/responses): the turn prepared off the event loop (hybrid/serve/agent.py), one engine request with
its grammar, and the output as parser events while it streams."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request

from hybrid.engine.requests import RequestError, RequestOutput, SamplingParams
from hybrid.serve import agent
from hybrid.serve.loop import Job
from hybrid.serve.parsers import Event, Parsed
from hybrid.serve.service import APIError, Service


@dataclass
class TurnSpec:
    """What a request asks of one turn, in the OpenAI chat shape."""
    messages: list[dict]
    tools: Optional[list[dict]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict] = None
    template_kwargs: Optional[dict] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop: tuple[str, ...] = ()


@dataclass
class Running:
    turn: agent.Turn
    job: Job
    params: SamplingParams
    ids: list[int] = field(default_factory=list)  # the output's tokens so far
    text: str = ""  # the output's text so far (as the engine shows it: before a stop string)


async def start(service: Service, request: Request, spec: TurnSpec) -> Running:
    engine = service.ready_engine()
    tok = service.tokenizer()
    service.check_text_size(sum(len(str(m.get("content") or "")) for m in spec.messages), "messages")
    try:
        turn = await service.offload(agent.prepare, tok, engine.model.args.vocab_size, spec.messages, spec.tools,
                                     spec.tool_choice, spec.parallel_tool_calls, spec.response_format,
                                     spec.template_kwargs)
    except agent.TurnError as e:
        raise APIError(400, str(e), param=e.param)
    except RequestError as e:  # a schema the grammar library cannot enforce
        raise APIError(400, str(e), param="response_format" if spec.response_format else "tools")
    max_tokens = spec.max_tokens or max(1, engine.plan.kv.max_context - len(turn.prompt))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if spec.temperature is None else
                                spec.temperature, top_p=1.0 if spec.top_p is None else spec.top_p,
                                top_k=spec.top_k or 0, stop=tuple(spec.stop), logits_processors=turn.processors())
    except RequestError as e:
        raise APIError(400, str(e))
    return Running(turn, service.submit(request, turn.prompt, params), params)


async def events(service: Service, run: Running) -> AsyncIterator[tuple[list[Event], Optional[RequestOutput],
                                                                          Optional[Parsed]]]:
    """(events, None, None) while the output grows; last (events, final output, the whole output parsed).
    Raises the APIError of a request the engine failed or aborted."""
    stream = run.turn.stream()
    async for out in service.outputs(run.job):
        run.ids += out.new_token_ids
        run.text += out.text_delta
        evs = stream.feed(out.text_delta) if out.text_delta else []
        if out.finished:
            failure = service.failure(out)
            if failure is not None:
                raise failure
            tail, parsed = stream.finish()
            yield evs + tail, out, parsed
            return
        if evs:
            yield evs, None, None


async def collect(service: Service, run: Running) -> tuple[Parsed, RequestOutput]:
    async for _evs, out, parsed in events(service, run):
        if out is not None:
            return parsed, out
    raise AssertionError("the output ended without a last event")


def matched_stop(service: Service, run: Running) -> Optional[str]:
    """The stop string that ended the output, if one did."""
    if not run.params.stop:
        return None
    rest = service.tokenizer().decode(run.ids)[len(run.text):]
    return next((s for s in run.params.stop if rest.startswith(s)), None)
