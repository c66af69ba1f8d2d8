"""OpenAI's chat and text completions over the service's request path (hybrid/serve/service.py): the request's
fields to SamplingParams, its choices (n of each prompt: n requests to the engine), and the answer or its
server-sent events, with log-probabilities in OpenAI's shapes."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybrid.engine.requests import FinishReason, RequestError, RequestOutput, SamplingParams, TokenLogprobs
from hybrid.serve import agent, gateway
from hybrid.serve.loop import Job
from hybrid.serve.protocol import (IGNORED_CHAT, IGNORED_COMPLETION, ChatCompletion, ChatCompletionRequest,
                                   Completion, CompletionRequest, ErrorResponse, error_body)
from hybrid.serve.service import APIError, Service

IGNORED_HEADER = "X-Hybrid-Ignored-Fields"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_RESPONSES = {
    200: {"content": {"text/event-stream": {}},
          "description": "the completion; with stream=true, server-sent events (`data: {chunk}` ... `data: [DONE]`)",
          "headers": {IGNORED_HEADER: {"schema": {"type": "string"},
                                       "description": "the request's fields that had no effect, comma-separated"}}},
    **{s: {"model": ErrorResponse} for s in (400, 401, 404, 500, 503)},
    429: {"model": ErrorResponse, "description": "too many requests waiting for a KV slot",
          "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}},
}
Body = Union[ChatCompletionRequest, CompletionRequest]


def router(service: Service) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/chat/completions", response_model=ChatCompletion, responses=_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat through the checkpoint's chat template."""
        turn, max_tokens, top = await chat_turn(service, body)
        prompt = turn.prompt
        jobs = service_submit(service, request, [prompt], body, max_tokens, top, turn.processors)
        answer = _Answer(service, "chatcmpl", "chat.completion", jobs, [prompt], body, turn=turn)
        headers = _ignored(body, IGNORED_CHAT)
        if body.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream",
                                     headers={**_SSE_HEADERS, **headers})
        return JSONResponse(await answer.whole(), headers=headers)

    @r.post("/v1/completions", response_model=Completion, responses=_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of prompts given as text or as token ids (one or a batch)."""
        prompts, texts = await completion_prompts(service, body)
        jobs = service_submit(service, request, prompts, body, body.max_tokens or 16, body.logprobs)
        echo = [t for t in texts for _ in range(body.n or 1)] if body.echo else None
        answer = _Answer(service, "cmpl", "text_completion", jobs, prompts, body, echo)
        headers = _ignored(body, IGNORED_COMPLETION)
        if body.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream",
                                     headers={**_SSE_HEADERS, **headers})
        return JSONResponse(await answer.whole(), headers=headers)
    return r


async def chat_turn(service: Service, body: ChatCompletionRequest) -> tuple[agent.Turn, int, Optional[int]]:
    """A chat request's turn (prompt, grammar, parser), max_tokens and top logprobs (None: none), or its 400."""
    engine = service.ready_engine()
    service.check_model(body.model)
    service.tokenizer()
    gateway.check(body)
    messages = chat_messages(body)
    service.check_text_size(sum(len(m["content"]) for m in messages), "messages")
    turn = await prepare_turn(service, body, messages)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, engine.plan.kv.max_context -
                                                                      len(turn.prompt))
    return turn, max_tokens, (body.top_logprobs or 0) if body.logprobs else None


async def completion_prompts(service: Service, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """A text completion request's prompts as token ids, and their texts (for echo), or its 400."""
    service.ready_engine()
    service.check_model(body.model)
    gateway.check(body)
    prompts, texts = [], []
    for p in body.prompts():
        if isinstance(p, str):
            service.check_text_size(len(p), "prompt")
            tok = service.tokenizer()
            try:
                prompts.append(await service.offload(tok.encode, p))
            except Exception as e:  # text the tokenizer cannot take (lone surrogates)
                raise APIError(400, f"the prompt cannot be tokenized: {type(e).__name__}: {e}", param="prompt")
            texts.append(p)
        else:
            service.check_token_ids(p, "prompt")
            prompts.append(list(p))
            texts.append(None)
    if body.echo:
        texts = [t if t is not None else await service.offload(service.tokenizer().decode, p)
                 for t, p in zip(texts, prompts)]
    return prompts, texts


async def prepare_turn(service: Service, body: ChatCompletionRequest, messages: list[dict]) -> agent.Turn:
    """The prompt (tools in it), the grammar of tool_choice / response_format and the output's parser
    (hybrid/serve/agent.py), off the event loop."""
    dump = (lambda v: v.model_dump() if hasattr(v, "model_dump") else v)
    try:
        return await service.offload(
            agent.prepare, service.tokenizer(), service.ready_engine().model.args.vocab_size, messages,
            [dump(t) for t in body.tools or ()], dump(body.tool_choice), body.parallel_tool_calls,
            dump(body.response_format), body.chat_template_kwargs, bool(body.continue_final_message))
    except agent.TurnError as e:
        raise APIError(400, str(e), param=e.param, code=e.code)
    except RequestError as e:  # a schema the grammar library cannot enforce
        raise APIError(400, str(e), param="response_format" if body.response_format else "tools")


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; `developer` is the template's `system`. Parts other than text
    are refused."""
    out = []
    for i, m in enumerate(body.messages):
        other = m.other_parts()
        if other:
            raise APIError(400, f"messages[{i}]: only text content parts are served, not {', '.join(other)}",
                           param=f"messages.{i}.content", code="unsupported_content")
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        out.append(msg)
    return out


def sampling_params(body: Body, max_tokens: int, logprobs: Optional[int], choice: int = 0,
                    processors: tuple = ()) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed if body.seed is None or choice == 0 else _seed(body.seed, choice)
    try:
        bias = {int(t): b for t, b in (body.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0, min_p=body.min_p or 0.0, seed=seed,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos),
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, logit_bias=bias, logprobs=logprobs,
            logits_processors=processors)
    except RequestError as e:
        raise APIError(400, str(e))


def service_submit(service: Service, request: Request, prompts: list[list[int]], body: Body, max_tokens: int,
                   logprobs: Optional[int], processors: Callable[[], tuple] = tuple) -> list[Job]:
    """n jobs per prompt (choice index = prompt index x n + j), queued together or not at all; `processors()`:
    each choice's logits processors (a grammar's state is a choice's own)."""
    n = body.n or 1
    work = [(p, sampling_params(body, max_tokens, logprobs, j, processors())) for p in prompts for j in range(n)]
    return service.submit_all(request, work)


def _seed(seed: int, choice: int) -> int:
    return seed + choice if seed + choice < 2**64 else seed - choice


def _ignored(body: Body, ignored: frozenset[str]) -> dict[str, str]:
    named = sorted(f for f in body.model_fields_set & ignored if getattr(body, f) is not None)
    return {IGNORED_HEADER: ",".join(named)} if named else {}


class _Answer:
    """The answer to one request of several choices: whole, or as server-sent events."""

    def __init__(self, service: Service, prefix: str, kind: str, jobs: list[Job], prompts: list[list[int]],
                 body: Body, echo: Optional[list[str]] = None, turn: Optional[agent.Turn] = None):
        self.service, self.kind, self.jobs, self.prompts, self.echo = service, kind, jobs, prompts, echo
        self.chat = kind == "chat.completion"
        separate = getattr(body, "separate_reasoning", True) is not False
        self.parsers = [turn.stream(separate) for _ in jobs] if turn is not None else None  # reasoning, tool calls
        self.reasoning = [gateway.Reasoning(body) for _ in jobs]
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        self.include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        self.stop_ids = frozenset(body.stop_token_ids or ()) | (
            frozenset() if body.ignore_eos else service.engine.eos_ids)
        self.retexts = gateway.retexts(body, service.engine.tokenizer, self.stop_ids, len(jobs))
        self.offsets = [len(e) for e in echo] if echo else [0] * len(jobs)
        self.n = body.n or 1  # choice i answers prompts[i // n]
        self.token_ids = bool(getattr(body, "return_token_ids", None))  # vLLM's extension (text completions)
        self.prompt_ids_sent: set[int] = set()

    def base(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.service.model_name}

    async def whole(self) -> dict[str, Any]:
        texts, lps, ids = [[] for _ in self.jobs], [[] for _ in self.jobs], [[] for _ in self.jobs]
        finals: dict[int, RequestOutput] = {}
        async for i, out in merged(self.service, self.jobs):
            texts[i].append(self.text(i, out))
            lps[i] += self.shown(out)
            ids[i] += out.new_token_ids
            if out.finished:
                failure = self.service.failure(out)
                if failure is not None:
                    raise failure
                finals[i] = out
        choices = []
        for i in range(len(self.jobs)):
            text, reason = "".join(texts[i]), finals[i].finish_reason.value
            if self.chat:
                parser = self.parsers[i]
                parser.feed(text)
                parsed = parser.finish()[1]
                choices.append({"index": i, "message": self.reasoning[i].message(agent.chat_message(parsed)),
                                "logprobs": self.chat_logprobs(lps[i]),
                                "finish_reason": agent.finish_reason(parsed, reason)})
            else:
                choices.append({"index": i, "text": (self.echo[i] if self.echo else "") + text,
                                "logprobs": self.completion_logprobs(i, lps[i]), "finish_reason": reason,
                                **self.ids_of(i, ids[i])})
        return {**self.base(False), "choices": choices, "usage": self.usage(finals)}

    async def events(self) -> AsyncIterator[str]:
        extra = {"usage": None} if self.include_usage else {}

        def chunk(i: int, delta: Union[str, dict], lps: list[TokenLogprobs], finish: Optional[str],
                  ids: tuple = ()) -> dict:
            if self.chat:
                delta = delta if isinstance(delta, dict) else {"content": delta} if delta else {}
                payload = {"delta": delta, "logprobs": self.chat_logprobs(lps)}
            else:
                payload = {"text": delta, "logprobs": self.completion_logprobs(i, lps)}
            return {**self.base(True), "choices": [{"index": i, **payload, "finish_reason": finish,
                                                    **self.ids_of(i, ids)}], **extra}
        for i in range(len(self.jobs)):
            if self.chat:
                yield _sse({**self.base(True), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None}], **extra})
            elif self.echo:
                yield _sse(chunk(i, self.echo[i], [], None))
        finals: dict[int, RequestOutput] = {}
        async for i, out in merged(self.service, self.jobs):
            lps, text = self.shown(out), self.text(i, out)
            if self.chat:
                events = self.parsers[i].feed(text) if text else []
                if out.finished:
                    tail, parsed = self.parsers[i].finish()
                    events += tail
                events = self.reasoning[i](events, out.finished)
                deltas = [agent.chat_delta(e) for e in events] or ([{}] if lps else [])
                for k, d in enumerate(deltas):
                    yield _sse(chunk(i, d, lps if k == 0 else [], None))
            elif text or lps or (self.token_ids and out.new_token_ids):
                yield _sse(chunk(i, text, lps, None, out.new_token_ids))
            if out.finished:
                failure = self.service.failure(out)
                if failure is not None:
                    yield _sse(error_body(failure.message, failure.type, failure.param, failure.code))
                    yield "data: [DONE]\n\n"
                    return
                finals[i] = out
                reason = out.finish_reason.value
                yield _sse(chunk(i, "", [], agent.finish_reason(parsed, reason) if self.chat else reason))
        if self.include_usage:
            yield _sse({**self.base(True), "choices": [], "usage": self.usage(finals)})
        yield "data: [DONE]\n\n"

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(max(out.completion_tokens, job.completion_tokens)
                         for job, out in zip(self.jobs, (finals[i] for i in range(len(self.jobs)))))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def text(self, i: int, out: RequestOutput) -> str:
        """Choice i's new text: the engine's, or decoded here (hybrid/serve/gateway.py Retext)."""
        return self.retexts[i].delta(out) if self.retexts else out.text_delta

    def ids_of(self, i: int, ids) -> dict[str, Any]:
        """return_token_ids: choice i's generated ids, and the prompt's on its first chunk (or its whole answer)."""
        if not self.token_ids or self.chat:
            return {}
        out: dict[str, Any] = {}
        if i not in self.prompt_ids_sent:
            self.prompt_ids_sent.add(i)
            out["prompt_token_ids"] = list(self.prompts[i // self.n])
        return {**out, "token_ids": list(ids)}

    def shown(self, out: RequestOutput) -> list[TokenLogprobs]:
        """The output's log-probabilities, but for a stop token that ended it (not in the text)."""
        lps = out.logprobs or []
        if lps and out.finished and out.finish_reason is FinishReason.stop and lps[-1].token in self.stop_ids:
            lps = lps[:-1]
        return lps

    def token(self, tid: int) -> str:
        return self.service.engine.tokenizer.decode([tid]) if self.service.engine.tokenizer else str(tid)

    def chat_logprobs(self, lps: list[TokenLogprobs]) -> Optional[dict]:
        if not lps:
            return None

        def entry(tid: int, logprob: float) -> dict:
            text = self.token(tid)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps], "refusal": None}

    def completion_logprobs(self, i: int, lps: list[TokenLogprobs]) -> Optional[dict]:
        if not lps:
            return None
        tokens = [self.token(lp.token) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(t)
        tops = []
        for lp in lps:  # tokens of one text (partial characters): the likelier one's
            top: dict[str, float] = {}
            for t, v in lp.top:
                top.setdefault(self.token(t), v)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": tops,
                "text_offset": offsets}


async def merged(service: Service, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of several jobs as they come, until each has its last; the unfinished are aborted
    if the caller stops early."""
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        async for out in service.outputs(job):
            queue.put_nowait((i, out))
    pumps = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            i, out = await queue.get()
            yield i, out
            left -= out.finished
    finally:
        for p in pumps:
            p.cancel()
        service.abort(jobs)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
