"""Anthropic's Messages API over the same turn as chat completions (hybrid/serve/turns.py):

    POST /v1/messages               system, text / tool_use / tool_result / thinking blocks, tools, tool_choice
                                    (auto, any, tool, none; disable_parallel_tool_use), thinking (the template's
                                    `thinking` switch), stop_sequences, max_tokens, temperature, top_p, top_k;
                                    stream: message_start, content_block_start/_delta/_stop, message_delta,
                                    message_stop
    POST /v1/messages/count_tokens  the prompt's tokens

Blocks are translated to the OpenAI chat shape (tool_use -> an assistant's tool_calls, tool_result -> a `tool`
message), answers back to content blocks: thinking (the reasoning), text, tool_use (input: the arguments parsed)."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hybrid.serve import turns
from hybrid.serve.parsers import CallArgs, CallStart, Text
from hybrid.serve.service import APIError, Service

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[str, list[_Open]]


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, list[_Open]]] = None
    tools: Optional[list[_Open]] = None
    tool_choice: Optional[_Open] = None
    thinking: Optional[_Open] = None


class CountTokensRequest(_Base):
    pass


class MessagesRequest(_Base):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = Field(None, max_length=16)
    stream: Optional[bool] = False
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    metadata: Optional[_Open] = None
    output_config: Optional[_Open] = None
    # accepted, without effect here
    service_tier: Optional[str] = None
    cache_control: Optional[_Open] = None
    container: Optional[Any] = None
    diagnostics: Optional[Any] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None


def router(service: Service) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API."""
        service.check_model(body.model)
        spec = turns.TurnSpec(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, stop=tuple(body.stop_sequences or ()), **_turn(service, body))
        run = await turns.start(service, request, spec)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            return StreamingResponse(_stream(service, run, mid, body.model), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        parsed, out = await turns.collect(service, run)
        stop = turns.matched_stop(service, run)
        return JSONResponse({
            "id": mid, "type": "message", "role": "assistant", "model": body.model, "content": _blocks(parsed),
            "stop_reason": _stop_reason(parsed, out.finish_reason.value, stop), "stop_sequence": stop,
            "usage": {"input_tokens": len(run.turn.prompt), "output_tokens": len(run.ids)}})

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        """The tokens of the prompt a /v1/messages request would send the model."""
        service.check_model(body.model)
        spec = turns.TurnSpec(**_turn(service, body))
        engine, tok = service.ready_engine(), service.tokenizer()
        service.check_text_size(sum(len(str(m.get("content") or "")) for m in spec.messages), "messages")
        from hybrid.serve import agent
        try:
            turn = await service.offload(agent.prepare, tok, engine.model.args.vocab_size, spec.messages, spec.tools,
                                         "none" if spec.tool_choice == "none" else "auto", None, None,
                                         spec.template_kwargs)
        except agent.TurnError as e:
            raise APIError(400, str(e), param=e.param)
        return JSONResponse({"input_tokens": len(turn.prompt)})

    return r


# -- requests -----------------------------------------------------------------------------------------------------
def _turn(service: Service, body: _Base) -> dict[str, Any]:
    """The turn's messages, tools and switches from an Anthropic request."""
    chat: list[dict] = []
    if body.system:
        chat.append({"role": "system", "content": _joined(body.system, "system")})
    for i, m in enumerate(body.messages):
        chat += _messages(m, i)
    tools = [_tool(t.model_dump(), i) for i, t in enumerate(body.tools or ())]
    choice, parallel = _choice(body.tool_choice.model_dump() if body.tool_choice else None)
    kwargs = None
    if body.thinking is not None:
        on = body.thinking.model_dump().get("type") == "enabled"
        kwargs = {"thinking": on, "enable_thinking": on}
    return {"messages": chat, "tools": tools or None, "tool_choice": choice if tools else None,
            "parallel_tool_calls": parallel, "template_kwargs": kwargs}


def _joined(content: Union[str, list[_Open]], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = [b.model_dump() for b in content]
    for p in parts:
        if p.get("type") != "text":
            raise APIError(400, f"{where}: only text blocks are served here, got {p.get('type')!r}", param=where)
    return "\n".join(p.get("text", "") for p in parts)


def _messages(m: AnthropicMessage, i: int) -> list[dict]:
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict] = []
    text, calls, reasoning = [], [], []
    for b in (b.model_dump() for b in m.content):
        kind = b.get("type")
        if kind == "text":
            text.append(b.get("text", ""))
        elif kind == "tool_result" and m.role == "user":
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                        "content": _result_text(b.get("content"), where)})
        elif kind == "tool_use" and m.role == "assistant":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name", ""), "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "thinking" and m.role == "assistant":
            reasoning.append(b.get("thinking", ""))
        elif kind == "redacted_thinking" and m.role == "assistant":
            continue
        else:
            raise APIError(400, f"{where}: a {m.role} message cannot hold a {kind!r} block here", param=where)
    if m.role == "assistant":
        msg = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        return [msg]
    return out + ([{"role": "user", "content": "\n".join(text)}] if text or not out else [])


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for b in content:
        if not isinstance(b, dict) or b.get("type") != "text":
            raise APIError(400, f"{where}: tool_result content: only text blocks are served", param=where)
        texts.append(b.get("text", ""))
    return "\n".join(texts)


def _tool(t: dict, i: int) -> dict:
    if t.get("type") not in (None, "custom") or "name" not in t:
        raise APIError(400, f"tools[{i}]: only client tools ({{name, description, input_schema}}) are served",
                       param=f"tools[{i}]")
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                             "parameters": t.get("input_schema") or {"type": "object"}}}


def _choice(choice: Optional[dict]) -> tuple[Any, Optional[bool]]:
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    mapping = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in mapping:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    return mapping[kind], parallel


# -- answers ------------------------------------------------------------------------------------------------------
def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"_raw_arguments": arguments}  # the model wrote no valid JSON: handed back as it is


def _blocks(parsed) -> list[dict]:
    blocks: list[dict] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.calls:
        blocks.append({"type": "text", "text": parsed.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)} for c in parsed.calls]
    return blocks


def _stop_reason(parsed, engine_reason: str, stop: Optional[str]) -> str:
    if stop is not None:
        return "stop_sequence"
    if parsed.calls and engine_reason == "stop":
        return "tool_use"
    return STOP_REASONS.get(engine_reason, "end_turn")


def _sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


async def _stream(service: Service, run: turns.Running, mid: str, model: str) -> AsyncIterator[str]:
    """Anthropic's events: a block per reasoning, text and tool call, in the order the model writes them."""
    yield _sse("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": len(run.turn.prompt), "output_tokens": 0}}})
    index, open_kind = -1, None

    def close() -> list[str]:
        out = []
        if open_kind == "thinking":
            out.append(_sse("content_block_delta", {"index": index, "delta": {"type": "signature_delta",
                                                                               "signature": ""}}))
        if open_kind is not None:
            out.append(_sse("content_block_stop", {"index": index}))
        return out

    try:
        async for evs, out, parsed in turns.events(service, run):
            for e in evs:
                if isinstance(e, Text):
                    kind = "thinking" if e.kind == "reasoning" else "text"
                    if open_kind != kind:
                        for s in close():
                            yield s
                        index, open_kind = index + 1, kind
                        yield _sse("content_block_start", {"index": index, "content_block":
                                                           {"type": kind, kind: "", **({"signature": ""} if kind ==
                                                                                       "thinking" else {})}})
                    key = "thinking_delta" if kind == "thinking" else "text_delta"
                    yield _sse("content_block_delta", {"index": index, "delta": {"type": key, kind: e.text}})
                elif isinstance(e, CallStart):
                    for s in close():
                        yield s
                    index, open_kind = index + 1, "tool_use"
                    yield _sse("content_block_start", {"index": index, "content_block": {
                        "type": "tool_use", "id": e.id, "name": e.name, "input": {}}})
                elif isinstance(e, CallArgs):
                    yield _sse("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                                  "partial_json": e.text}})
            if out is not None:
                if index < 0:  # an empty answer: one empty text block
                    index, open_kind = 0, "text"
                    yield _sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                for s in close():
                    yield s
                stop = turns.matched_stop(service, run)
                yield _sse("message_delta", {"delta": {"stop_reason": _stop_reason(parsed, out.finish_reason.value,
                                                                                   stop), "stop_sequence": stop},
                                             "usage": {"output_tokens": len(run.ids)}})
                yield _sse("message_stop", {})
    except APIError as e:
        kind = "overloaded_error" if e.status == 503 else "api_error"
        yield _sse("error", {"error": {"type": kind, "message": e.message}})
