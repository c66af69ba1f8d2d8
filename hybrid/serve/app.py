"""The OpenAI-compatible HTTP app over the serving engine (hybrid/engine/engine.py).

    app = create_app(engine, ServerConfig(), "tiny")        # or create_app(loader, ...): loader() builds the engine
    # POST /v1/chat/completions, POST /v1/completions (stream: server-sent events), GET /v1/models, GET /health,
    # GET /metrics (Prometheus), GET /openapi.json

The engine runs on its own thread (hybrid/serve/loop.py); the handlers only queue requests and await their outputs.
Every error is OpenAI's body {"error": {"message", "type", "param", "code"}}, never FastAPI's 422 shape:
400 bad JSON, field or request (the engine's RequestError names the numbers), 401 missing or wrong key, 404 unknown
route or model (`model_not_found`, as OpenAI), 429 + Retry-After when `max_waiting` requests already wait for a KV
slot, 500 when the engine fails a request (the others go on; in a stream: an error event), 503 while the engine
loads and while the server shuts down. A client that goes away has its request aborted: its KV slot is free after
the engine's next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid.engine.engine import Engine
from hybrid.engine.requests import FinishReason, RequestError, RequestOutput, SamplingParams
from hybrid.errors import CheckpointError
from hybrid.config.schema import ServerConfig
from hybrid.serve.loop import EngineLoop, Job
from hybrid.serve.metrics import CONTENT_TYPE, Metrics
from hybrid.serve.protocol import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest,
                                   ErrorResponse, Health, Model, ModelList, error_body)

log = logging.getLogger("hybrid.serve")

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
DRAIN_ABORT_WAIT_S = 10.0  # after the grace: how long aborted requests get to hand back their last output

Loader = Callable[[], Engine]


class APIError(Exception):
    """An error response in OpenAI's shape. `outcome`: the metrics' request outcome it counts as (None: counted
    elsewhere)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None,
                 outcome: Optional[str] = "rejected"):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers, self.outcome = headers, outcome

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status, self.headers)


class Service:
    """What one app serves: the engine (once loaded) and its thread, the metrics, the requests in flight, and
    whether the server is draining for a shutdown."""

    def __init__(self, source: Union[Engine, Loader], cfg: ServerConfig, model_name: str):
        if not hasattr(source, "step") and not callable(source):
            raise TypeError(f"create_app needs an Engine or a callable that builds one, got {type(source).__name__}")
        self.cfg, self.model_name = cfg, cfg.model_name or model_name
        self.metrics = Metrics()
        self.created = int(time.time())
        self._source = source
        self.engine: Optional[Engine] = None
        self.loop: Optional[EngineLoop] = None
        self.load_error: Optional[BaseException] = None
        self.on_load_failed: Optional[Callable[[BaseException], None]] = None
        self.draining = False
        self.jobs: set[Job] = set()

    # -- life ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """On the event loop at start-up: the engine's thread, or a thread that builds the engine first."""
        if hasattr(self._source, "step"):
            self._ready(self._source)
            return
        aloop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = self._source()
            except BaseException as e:  # reported by /health, and by serve() on exit
                log.error("loading the engine failed: %s: %s", type(e).__name__, e)
                done = functools.partial(self._failed, e)
            else:
                done = functools.partial(self._ready, engine)
            with contextlib.suppress(RuntimeError):  # the server stopped while the engine loaded
                aloop.call_soon_threadsafe(done)
        threading.Thread(target=load, name="hybrid-load", daemon=True).start()

    def _ready(self, engine: Engine) -> None:
        loop = EngineLoop(engine, on_step=lambda e, _outs: self.metrics.step.observe(e.last_step_s))
        loop.start()
        self.metrics.bind(engine)
        self.loop, self.engine = loop, engine

    def _failed(self, e: BaseException) -> None:
        self.load_error = e
        if self.on_load_failed is not None:
            self.on_load_failed(e)

    async def stop(self) -> None:
        """At shutdown: aborts what is left, then ends the engine's thread."""
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)

    async def drain(self, grace_s: float) -> None:
        """Stops taking requests (503), waits up to grace_s for those in flight, then aborts the rest."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.jobs and self.loop is not None:
            log.warning("shutdown: aborting %d request(s) still running after %.1f s", len(self.jobs), grace_s)
            for job in list(self.jobs):
                self.loop.abort(job.id)
            deadline = time.monotonic() + DRAIN_ABORT_WAIT_S
            while self.jobs and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    def status(self) -> tuple[str, str]:
        if self.load_error is not None:
            return "failed", f"{type(self.load_error).__name__}: {self.load_error}"
        if self.engine is None:
            return "loading", "the engine is loading"
        if self.draining:
            return "draining", "the server is shutting down"
        if self.loop is not None and not self.loop.alive:
            return "failed", "the engine thread has stopped"
        return "ok", ""

    # -- requests -----------------------------------------------------------------------------------------------
    def ready_engine(self) -> Engine:
        status, message = self.status()
        if status != "ok":
            raise APIError(503, message, "server_error", code=f"server_{status}", outcome="unavailable")
        return self.engine

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    def params(self, body: Union[ChatCompletionRequest, CompletionRequest], max_tokens: int) -> SamplingParams:
        if body.n is not None and body.n > 1:
            raise APIError(400, f"n={body.n}: only one choice per request is served (n=1)", param="n")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        temperature = 1.0 if body.temperature is None else body.temperature
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                                  seed=body.seed, stop=stop, ignore_eos=bool(body.ignore_eos))
        except RequestError as e:
            raise APIError(400, str(e))

    def submit(self, request: Request, prompt: list[int], params: SamplingParams) -> Job:
        engine = self.ready_engine()
        waiting = engine.waiting
        if waiting >= self.cfg.max_waiting:
            raise APIError(429, f"{waiting} requests are already waiting for a KV slot (server.max_waiting "
                                f"{self.cfg.max_waiting}); retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}, outcome="queue_full")
        try:
            job = self.loop.submit(prompt, params, on_finish=self._finished)
        except RequestError as e:
            raise APIError(400, str(e), param="max_tokens" if "max_tokens" in str(e) else None)
        self.jobs.add(job)
        self.metrics.prompt_tokens.inc(len(prompt))
        job.watcher = asyncio.ensure_future(self._watch(request, job))
        return job

    async def _watch(self, request: Request, job: Job) -> None:
        """Aborts the job when its client disconnects (the body is read: the next message is the disconnect)."""
        with contextlib.suppress(Exception):
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    if not job.finished and self.loop is not None:
                        self.loop.abort(job.id)
                    return

    def _finished(self, job: Job) -> None:
        self.jobs.discard(job)
        out, m = job.final, self.metrics
        reason = out.finish_reason.value if out.finish_reason is not None else FinishReason.error.value
        m.outcome(reason)
        m.generated_tokens.inc(job.completion_tokens)
        if job.first_token_at is not None:
            m.ttft.observe(job.first_token_at - job.arrival)
            if job.completion_tokens > 1:
                m.tpot.observe((job.last_token_at - job.first_token_at) / (job.completion_tokens - 1))
        if out.finish_reason in (FinishReason.stop, FinishReason.length):
            m.e2e.observe(time.perf_counter() - job.arrival)

    async def outputs(self, job: Job) -> AsyncIterator[RequestOutput]:
        """The job's outputs until its last; the job is aborted if the caller stops early (cancelled, closed)."""
        try:
            while True:
                out = await job.next()
                yield out
                if out.finished:
                    return
        finally:
            if not job.finished and self.loop is not None:
                self.loop.abort(job.id)

    def failure(self, out: RequestOutput) -> Optional[APIError]:
        """Why a finished request has no answer: the engine failed it (500) or it was aborted (503)."""
        if out.finish_reason is FinishReason.error:
            return APIError(500, f"the engine failed this request: {out.error}", "server_error", code="engine_error",
                            outcome=None)
        if out.finish_reason is FinishReason.abort:
            why = "the server is shutting down" if self.draining else "aborted"
            return APIError(503, f"the request was aborted: {why}", "server_error", code="aborted", outcome=None)
        return None


# -- the app ----------------------------------------------------------------------------------------------------
_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 500, 503)}
_GENERATE_RESPONSES = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "the completion; with stream=true, server-sent events (`data: {chunk}` ... `data: [DONE]`)"},
    **_ERRORS,
    429: {"model": ErrorResponse, "description": "too many requests waiting for a KV slot",
          "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}},
}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(engine_or_loader: Union[Engine, Loader], cfg: ServerConfig = ServerConfig(),
               model_name: str = "model") -> FastAPI:
    """The app over an engine, or over a loader (called on a thread at start-up; /health answers 503 until it
    returns). The app's Service is `app.state.service`."""
    service = Service(engine_or_loader, cfg, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        service.start()
        yield
        await service.stop()

    app = FastAPI(title="hybrid", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat and text completions over the hybrid serving engine.")
    app.state.service = service
    app.add_middleware(_Gate, service=service)
    _install_errors(app, service)
    _routes(app, service)
    app.openapi = lambda: _openapi(app, cfg)
    return app


def _routes(app: FastAPI, service: Service) -> None:
    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        """200 once the engine is loaded and running; 503 while it loads, if it failed, and while shutting down."""
        status, message = service.status()
        return JSONResponse({"status": status, "message": message}, 200 if status == "ok" else 503)

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
        401: {"model": ErrorResponse}})
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(service)]})

    @app.get("/v1/models/{model:path}", response_model=Model, responses={401: {"model": ErrorResponse},
                                                                    404: {"model": ErrorResponse}})
    async def model(model: str) -> JSONResponse:
        service.check_model(model)
        return JSONResponse(_model_card(service))

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_GENERATE_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat through the checkpoint's chat template."""
        engine = service.ready_engine()
        service.check_model(body.model)
        tok = _tokenizer(engine)
        try:
            prompt = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        except CheckpointError as e:
            raise APIError(400, f"{e}: use /v1/completions with this model", param="messages",
                           code="no_chat_template")
        except Exception as e:  # the template's own checks (jinja2 raise_exception) or its errors
            raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           param="messages")
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, engine.plan.max_context - len(prompt))
        job = service.submit(request, prompt, service.params(body, max_tokens))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_chat_events(service, job, rid, created, usage), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        text, out = await _collect(service, job)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": service.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": out.finish_reason.value}],
            "usage": _usage(job, out)})

    @app.post("/v1/completions", response_model=Completion, responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of a prompt given as text or as token ids."""
        engine = service.ready_engine()
        service.check_model(body.model)
        if isinstance(body.prompt, list):
            prompt = list(body.prompt)
        else:
            tok = _tokenizer(engine)
            try:
                prompt = tok.encode(body.prompt)
            except Exception as e:  # text the tokenizer cannot take (lone surrogates)
                raise APIError(400, f"the prompt cannot be tokenized: {type(e).__name__}: {e}", param="prompt")
        job = service.submit(request, prompt, service.params(body, body.max_tokens or 16))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_completion_events(service, job, rid, created, usage),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        text, out = await _collect(service, job)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": service.model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason.value}],
            "usage": _usage(job, out)})


def _tokenizer(engine: Engine):
    if engine.tokenizer is None:
        raise APIError(400, "this model was loaded without a tokenizer: send the prompt as token ids to "
                            "/v1/completions", param="prompt")
    return engine.tokenizer


def _model_card(service: Service) -> dict[str, Any]:
    context = service.engine.plan.max_context if service.engine is not None else 0
    return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "hybrid",
            "max_model_len": context}


def _usage(job: Job, out: RequestOutput) -> dict[str, int]:
    completion = max(out.completion_tokens, job.completion_tokens)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


async def _collect(service: Service, job: Job) -> tuple[str, RequestOutput]:
    parts = []
    async for out in service.outputs(job):
        parts.append(out.text_delta)
    failure = service.failure(out)
    if failure is not None:
        raise failure
    return "".join(parts), out


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(service: Service, job: Job, chunk: Callable[[str, Optional[str]], dict], head: Optional[dict],
                  base: dict, include_usage: bool) -> AsyncIterator[str]:
    """The stream of one request: chunks as the text grows, the one with finish_reason, the usage chunk, [DONE];
    or an error event when the engine fails or aborts the request."""
    if head is not None:
        yield _sse(head)
    async for out in service.outputs(job):
        if out.text_delta:
            yield _sse(chunk(out.text_delta, None))
    failure = service.failure(out)
    if failure is not None:
        yield _sse(error_body(failure.message, failure.type, failure.param, failure.code))
    else:
        yield _sse(chunk("", out.finish_reason.value))
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(job, out)})
    yield "data: [DONE]\n\n"


def _chat_events(service: Service, job: Job, rid: str, created: int, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": service.model_name}
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str, finish: Optional[str], delta: Optional[dict] = None) -> dict:
        delta = delta if delta is not None else ({"content": text} if text else {})
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
    return _events(service, job, chunk, chunk("", None, {"role": "assistant", "content": ""}), base, include_usage)


def _completion_events(service: Service, job: Job, rid: str, created: int,
                       include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": service.model_name}
    extra = {"usage": None} if include_usage else {}

    def chunk(text: str, finish: Optional[str]) -> dict:
        return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra}
    return _events(service, job, chunk, None, base, include_usage)


# -- auth, shutdown, errors -------------------------------------------------------------------------------------
class _Gate:
    """ASGI middleware: the API key on every route but /health; 503 for new requests while shutting down (but
    /health and /metrics)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        path, key = scope["path"], self.service.cfg.api_key
        error = None
        if key is not None:
            given = _bearer(scope)
            if given is None:
                error = APIError(401, "You didn't provide an API key: send it as `Authorization: Bearer KEY`",
                                 code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
            elif not hmac.compare_digest(given.encode(), key.encode()):
                error = APIError(401, "Incorrect API key provided", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
        if error is None and self.service.draining and path != "/metrics":
            error = APIError(503, "the server is shutting down", "server_error", code="server_draining",
                             outcome="unavailable")
        if error is None:
            return await self.app(scope, receive, send)
        if path in GENERATE_PATHS and error.outcome:
            self.service.metrics.outcome(error.outcome)
        await error.response()(scope, receive, send)


def _bearer(scope) -> Optional[str]:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _install_errors(app: FastAPI, service: Service) -> None:
    def count(request: Request, outcome: Optional[str]) -> None:
        if outcome and request.url.path in GENERATE_PATHS:
            service.metrics.outcome(outcome)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count(request, exc.outcome)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(request, "rejected")
        message, param = _validation_message(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
        elif exc.status_code == 405:
            message, code = f"Method {request.method} not allowed for {request.url.path}", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, kind, None, code), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        count(request, "error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)


def _validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """One line for pydantic's errors, and the parameter at fault (dotted path into the body)."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None

    def where(e: dict) -> str:
        return ".".join(str(p) for p in e.get("loc", ()) if p != "body")
    shown = [f"{where(e) or 'request body'}: {e.get('msg')}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(shown) + more, where(first) or None


def _openapi(app: FastAPI, cfg: ServerConfig) -> dict:
    """FastAPI's schema, without the 422 responses the app never sends, with the bearer key when one is set."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            if not isinstance(op, dict):
                continue
            op.get("responses", {}).pop("422", None)
            if cfg.api_key is not None and path != "/health":
                op["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if cfg.api_key is not None:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema
