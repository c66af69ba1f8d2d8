"""OpenAI's Responses API, stateless, over the same turn as chat completions (hybrid/serve/turns.py):

    POST /v1/responses   input (text, or items: messages, function_call, function_call_output), instructions,
                         function tools, tool_choice, parallel_tool_calls, text.format (json_object, json_schema),
                         max_output_tokens, temperature, top_p, reasoning (accepted); stream: response.created,
                         output_item / content_part / output_text / function_call_arguments / reasoning_text
                         events, response.completed

Nothing is stored: `previous_response_id` and `store: true`'s retrieval are not served (send the whole input)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hybrid.serve import turns
from hybrid.serve.parsers import CallArgs, CallStart, Text
from hybrid.serve.service import APIError, Service

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: Union[str, list[_Open]]
    instructions: Optional[str] = None
    tools: Optional[list[_Open]] = None
    tool_choice: Optional[Union[str, _Open]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[_Open] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: Optional[bool] = False
    reasoning: Optional[_Open] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[str] = None
    include: Optional[list[str]] = None
    service_tier: Optional[str] = None
    background: Optional[bool] = None
    stream_options: Optional[_Open] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None


def router(service: Service) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (stateless: the whole conversation comes in `input`)."""
        service.check_model(body.model)
        if body.previous_response_id is not None:
            raise APIError(400, "previous_response_id: responses are not stored here; send the whole conversation "
                                "in `input`", param="previous_response_id")
        if body.background:
            raise APIError(400, "background responses are not served", param="background")
        run = await turns.start(service, request, _spec(body))
        head = _head(body)
        if body.stream:
            return StreamingResponse(_stream(service, run, head), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        parsed, out = await turns.collect(service, run)
        return JSONResponse(_done(head, _items(head["id"], parsed), run, out.finish_reason.value))

    return r


# -- requests -----------------------------------------------------------------------------------------------------
def _spec(body: ResponsesRequest) -> turns.TurnSpec:
    chat: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else \
        [i.model_dump() for i in body.input]
    for i, item in enumerate(items):
        chat += _message(item, i, chat)
    tools = []
    for i, t in enumerate(t.model_dump() for t in body.tools or ()):
        if t.get("type") != "function" or "name" not in t:
            raise APIError(400, f"tools[{i}]: only function tools are served", param=f"tools[{i}]")
        tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                       if t.get(k) is not None}})
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, _Open) else body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fmt = (body.text.model_dump().get("format") if body.text else None) or None
    if fmt and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return turns.TurnSpec(messages=chat, tools=tools or None, tool_choice=choice if tools else None,
                          parallel_tool_calls=body.parallel_tool_calls, response_format=fmt,
                          max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p)


def _message(item: dict, i: int, chat: list[dict]) -> list[dict]:
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if not isinstance(content, str):
            texts = []
            for p in content or ():
                if p.get("type") not in ("input_text", "output_text", "text"):
                    raise APIError(400, f"input[{i}]: only text content is served, got {p.get('type')!r}",
                                   param=f"input[{i}].content")
                texts.append(p.get("text", ""))
            content = "\n".join(texts)
        return [{"role": item.get("role", "user"), "content": content}]
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}
        last = chat[-1] if chat else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls: one assistant message
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        out = item.get("output")
        return [{"role": "tool", "tool_call_id": item.get("call_id"),
                 "content": out if isinstance(out, str) else json.dumps(out)}]
    if kind == "reasoning":
        return []
    raise APIError(400, f"input[{i}]: items of type {kind!r} are not served", param=f"input[{i}].type")


# -- answers ------------------------------------------------------------------------------------------------------
def _head(body: ResponsesRequest) -> dict[str, Any]:
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": body.model, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, _Open)
            else (body.tool_choice or "auto"), "tools": [t.model_dump() for t in body.tools or ()],
            "text": body.text.model_dump() if body.text else {"format": {"type": "text"}},
            "metadata": body.metadata or {}, "store": False, "error": None, "incomplete_details": None,
            "output": [], "status": "in_progress", "usage": None}


def _reasoning_item(rid: str, text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _items(rid: str, parsed) -> list[dict]:
    items = [_reasoning_item(rid, parsed.reasoning)] if parsed.reasoning else []
    if parsed.content or not parsed.calls:
        items.append(_message_item(rid, parsed.content))
    return items + [_call_item(c.id, c.name, c.arguments) for c in parsed.calls]


def _done(head: dict, items: list[dict], run: turns.Running, reason: str) -> dict:
    out_tokens = len(run.ids)
    incomplete = reason == "length"
    return {**head, "output": items, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": len(run.turn.prompt), "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": len(run.turn.prompt) + out_tokens}}


class _Events:
    """The stream's events, numbered, with the output items as they open and close."""

    def __init__(self, head: dict):
        self.head, self.seq, self.items = head, 0, []
        self.open: Optional[dict] = None
        self.text = ""

    def sse(self, kind: str, **payload: Any) -> str:
        self.seq += 1
        data = json.dumps({'type': kind, 'sequence_number': self.seq, **payload}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def start(self, item: dict) -> list[str]:
        out = self.close()
        self.open, self.text = item, ""
        out.append(self.sse("response.output_item.added", output_index=len(self.items), item=item))
        if item["type"] == "message":
            out.append(self.sse("response.content_part.added", item_id=item["id"], output_index=len(self.items),
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def delta(self, text: str) -> list[str]:
        item, idx = self.open, len(self.items)
        self.text += text
        kind = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                "function_call": "response.function_call_arguments.delta"}[item["type"]]
        extra = {"content_index": 0} if item["type"] != "function_call" else {}
        return [self.sse(kind, item_id=item["id"], output_index=idx, delta=text, **extra)]

    def close(self) -> list[str]:
        item, idx, out = self.open, len(self.items), []
        if item is None:
            return out
        if item["type"] == "message":
            out.append(self.sse("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                                text=self.text))
            part = {"type": "output_text", "text": self.text, "annotations": []}
            out.append(self.sse("response.content_part.done", item_id=item["id"], output_index=idx,
                                content_index=0, part=part))
            item = {**item, "status": "completed", "content": [part]}
        elif item["type"] == "reasoning":
            out.append(self.sse("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                content_index=0, text=self.text))
            item = _reasoning_item(self.head["id"], self.text)
        else:
            out.append(self.sse("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                arguments=self.text))
            item = {**item, "arguments": self.text, "status": "completed"}
        out.append(self.sse("response.output_item.done", output_index=idx, item=item))
        self.items.append(item)
        self.open = None
        return out


async def _stream(service: Service, run: turns.Running, head: dict) -> AsyncIterator[str]:
    ev = _Events(head)
    yield ev.sse("response.created", response=head)
    yield ev.sse("response.in_progress", response=head)
    rid = head["id"]
    try:
        async for evs, out, parsed in turns.events(service, run):
            for e in evs:
                if isinstance(e, Text):
                    kind = "reasoning" if e.kind == "reasoning" else "message"
                    if ev.open is None or ev.open["type"] != kind:
                        for s in ev.start(_reasoning_item(rid, "") if kind == "reasoning" else
                                          _message_item(rid, "", "in_progress")):
                            yield s
                    for s in ev.delta(e.text):
                        yield s
                elif isinstance(e, CallStart):
                    for s in ev.start(_call_item(e.id, e.name, "", "in_progress")):
                        yield s
                elif isinstance(e, CallArgs):
                    for s in ev.delta(e.text):
                        yield s
            if out is not None:
                if not ev.items and ev.open is None:
                    for s in ev.start(_message_item(rid, "", "in_progress")):
                        yield s
                for s in ev.close():
                    yield s
                final = _done(head, ev.items, run, out.finish_reason.value)
                yield ev.sse("response.completed" if final["status"] == "completed" else "response.incomplete",
                             response=final)
    except APIError as e:
        yield ev.sse("error", code=e.code or "server_error", message=e.message, param=None)
