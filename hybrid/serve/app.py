"""The OpenAI-compatible HTTP app over the serving engine (hybrid/engine/engine.py).

    app = create_app(engine, ServerConfig(), "tiny")        # or create_app(loader, ...): loader() builds the engine
    # POST /v1/chat/completions, POST /v1/completions (hybrid/serve/completions.py; stream: server-sent events),
    # GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics (Prometheus), GET /openapi.json,
    # GET /docs (Swagger UI from the swagger-ui-bundle package: no network needed); what the SGLang and vLLM
    # gateways call on a worker (hybrid/serve/worker_api.py); X-Request-Id on every response (gateway.py)

The engine runs on its own thread (hybrid/serve/loop.py); the handlers only queue requests and await their outputs;
tokenising and chat templates run on a small thread pool (Service.offload). Every error is OpenAI's body
{"error": {"message", "type", "param", "code"}}, never FastAPI's 422 shape: 400 bad JSON, field or request, 401
missing or wrong key, 404 unknown route or model (`model_not_found`), 413 a body over server.max_body_mb (refused
before it is read), 429 + Retry-After when `max_waiting` requests already found no free KV slot, 500 when the engine
fails a request (the others go on; in a stream: an error event), 503 while the engine loads and while the server
shuts down (a request cut off by the shutdown gets one too, or an error event in its stream). A client that goes
away has its request aborted: its KV slot is free after the engine's next step. docs/design/serving-api.md: what
each endpoint serves. More APIs mount as routers on the same Service: `app.include_router(router(service))`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid.config.schema import ServerConfig
from hybrid.engine.engine import Engine
from hybrid.errors import CheckpointError
from hybrid.serve import anthropic, completions, gateway, responses, worker_api
from hybrid.serve.metrics import CONTENT_TYPE
from hybrid.serve.protocol import (DetokenizeRequest, DetokenizeResponse, ErrorResponse, Health, Model, ModelList,
                                   TokenizeRequest, TokenizeResponse, error_body)
from hybrid.serve.service import APIError, Loader, Service

log = logging.getLogger("hybrid.serve")

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
OPEN_PATHS = ("/health", "/docs", "/docs/oauth2-redirect")  # and /docs/assets/...: no key needed
DOCS_ASSETS = "/docs/assets"

__all__ = ["APIError", "Loader", "Service", "create_app"]


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

    app = FastAPI(title="hybrid", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible chat and text completions over the hybrid serving engine.")
    app.state.service = service
    app.add_middleware(_Gate, service=service)
    if cfg.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins), allow_methods=["*"],
                           allow_headers=["*"],
                           expose_headers=[completions.IGNORED_HEADER, "Retry-After", gateway.REQUEST_ID])
    app.add_middleware(_BodyLimit, service=service)
    app.add_middleware(_CutOff)
    app.add_middleware(gateway.RequestId)
    _install_errors(app, service)
    _routes(app, service)
    app.include_router(completions.router(service))
    app.include_router(anthropic.router(service))
    app.include_router(responses.router(service))
    app.include_router(worker_api.router(service))
    _docs(app)
    app.openapi = lambda: _openapi(app, service)
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

    @app.post("/tokenize", response_model=TokenizeResponse, responses={
        s: {"model": ErrorResponse} for s in (400, 401, 404, 503)})
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        """A prompt's token ids (`prompt`), or a chat's through the template (`messages`)."""
        engine = service.ready_engine()
        service.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        tok = service.tokenizer()
        if body.prompt is not None:
            service.check_text_size(len(body.prompt), "prompt")
            tokens = await service.offload(tok.encode, body.prompt, None if body.add_special_tokens else False)
        else:
            messages = completions.chat_messages(body)
            service.check_text_size(sum(len(m["content"]) for m in messages), "messages")
            try:
                tokens = await service.offload(tok.apply_chat_template, messages)
            except CheckpointError as e:
                raise APIError(400, str(e), param="messages", code="no_chat_template")
            except Exception as e:
                raise APIError(400, f"the chat template failed: {type(e).__name__}: {e}", param="messages")
        return JSONResponse({"count": len(tokens), "max_model_len": engine.plan.kv.max_context, "tokens": tokens})

    @app.post("/detokenize", response_model=DetokenizeResponse, responses={
        s: {"model": ErrorResponse} for s in (400, 401, 404, 503)})
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        """The text of token ids (special tokens dropped, as in completions)."""
        service.check_model(body.model)
        service.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": await service.offload(service.tokenizer().decode, body.tokens)})


def _docs(app: FastAPI) -> None:
    """Swagger UI from the swagger-ui-bundle package's files: the page works without the network."""
    import swagger_ui_bundle

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


def _model_card(service: Service) -> dict[str, Any]:
    context = service.engine.plan.kv.max_context if service.engine is not None else 0
    return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "hybrid",
            "max_model_len": context}


# -- auth, shutdown, errors -------------------------------------------------------------------------------------
class _Gate:
    """ASGI middleware: the API key on every route but /health and /docs; 503 for new requests while shutting down
    (but /health and /metrics)."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(DOCS_ASSETS + "/"):
            return await self.app(scope, receive, send)
        key, error = self.service.api_key, None
        if key is not None and scope["method"] != "OPTIONS":  # a CORS preflight carries no key
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


class _BodyLimit:
    """ASGI middleware: a body over server.max_body_mb gets 413 — at once when its Content-Length says so, else as
    soon as that much of it has come."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service
        self.limit = int(service.cfg.max_body_mb * 2**20)

    def error(self) -> APIError:
        return APIError(413, f"the request body is larger than server.max_body_mb ({self.service.cfg.max_body_mb:g} "
                             f"MiB)", code="body_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        if length.isdigit() and int(length) > self.limit:
            if scope["path"] in GENERATE_PATHS:
                self.service.metrics.outcome("rejected")
            return await self.error().response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # through FastAPI's body parsing: the 413 handler answers it
                    raise StarletteHTTPException(413, self.error().message)
            return message
        await self.app(scope, limited, send)


class _CutOff:
    """ASGI middleware: a request whose handler is cancelled (a forced shutdown) still ends with an error in
    OpenAI's shape — a 503 body, or an error event and [DONE] in a stream already begun — never a plain-text 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "stream": False, "ended": False}

        async def watched(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                state["stream"] = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                      for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)
        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await _cut_off(state, send)
            raise


async def _cut_off(state: dict, send) -> None:
    error = error_body("the request was cut off: the server is shutting down", "server_error", None, "aborted")
    if not state["started"]:
        await APIError(503, error["error"]["message"], "server_error", code="aborted").response()(
            {"type": "http"}, None, send)
    elif state["stream"] and not state["ended"]:
        event = f"data: {json.dumps(error, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": event, "more_body": False})


def _bearer(scope) -> Optional[str]:
    """The key of `Authorization: Bearer KEY`, or of `x-api-key: KEY` (Anthropic's clients)."""
    headers = dict(scope.get("headers", ()))
    if b"authorization" in headers:
        scheme, _, token = headers[b"authorization"].decode("latin-1").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


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
            message, code = str(exc.detail), "body_too_large" if exc.status_code == 413 else None
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


def _openapi(app: FastAPI, service: Service) -> dict:
    """FastAPI's schema, without the 422 responses the app never sends, with the bearer key when one is set."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    keyed = service.api_key is not None
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            if not isinstance(op, dict):
                continue
            op.get("responses", {}).pop("422", None)
            if keyed and path not in OPEN_PATHS:
                op["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if keyed:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema
