"""What one app serves: the engine (once loaded) and its thread, the metrics, the requests in flight, whether the
server is draining for a shutdown — and the request path every API's handlers share:

    service.ready_engine(); service.check_model(name)
    prompt = await service.offload(tok.encode, text)        # tokenising and templating off the event loop
    job = service.submit(request, prompt, params)           # 429 when too many requests found no free KV slot
    async for out in service.outputs(job): ...              # the engine's outputs; aborted if the caller stops
    failure = service.failure(out)                          # the APIError of a request the engine failed or aborted
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from hybrid.config.schema import ServerConfig
from hybrid.engine.engine import Engine
from hybrid.engine.requests import FinishReason, RequestError, RequestOutput, SamplingParams
from hybrid.errors import ConfigError
from hybrid.serve.loop import EngineLoop, Job
from hybrid.serve.metrics import Metrics
from hybrid.serve.protocol import error_body

log = logging.getLogger("hybrid.serve")

DRAIN_ABORT_WAIT_S = 10.0  # after the grace: how long aborted requests get to hand back their last output
API_KEY_ENV = "HYBRID_API_KEY"
TOKENIZER_THREADS = 2  # tokenising and chat templates run here, never on the event loop
MIN_TOKEN_BYTES = 64  # the bound on a token's bytes (special tokens included) is at least this

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


def api_key(cfg: ServerConfig) -> Optional[str]:
    """server.api_key, else the first line of server.api_key_file, else $HYBRID_API_KEY (None: no key)."""
    if cfg.api_key is not None:
        return cfg.api_key
    if cfg.api_key_file is not None:
        try:
            lines = Path(cfg.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"server.api_key_file: cannot read the key: {e}")
        if not lines or not lines[0].strip():
            raise ConfigError(f"server.api_key_file {cfg.api_key_file} is empty")
        return lines[0].strip()
    return os.environ.get(API_KEY_ENV) or None


class Service:
    def __init__(self, source: Union[Engine, Loader], cfg: ServerConfig, model_name: str):
        if not hasattr(source, "step") and not callable(source):
            raise TypeError(f"create_app needs an Engine or a callable that builds one, got {type(source).__name__}")
        self.cfg, self.model_name = cfg, cfg.model_name or model_name
        self.api_key = api_key(cfg)
        self.metrics = Metrics()
        self.created = int(time.time())
        self._source = source
        self.engine: Optional[Engine] = None
        self.loop: Optional[EngineLoop] = None
        self.load_error: Optional[BaseException] = None
        self.on_load_failed: Optional[Callable[[BaseException], None]] = None
        self.draining = False
        self.jobs: set[Job] = set()
        self.executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="hybrid-tokenize")
        self.token_bytes: Optional[int] = None  # the most bytes of text one token covers (once measured)

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
        if engine.tokenizer is not None:
            done = self.executor.submit(_longest_token, engine.tokenizer)
            done.add_done_callback(lambda f: setattr(self, "token_bytes", max(MIN_TOKEN_BYTES, f.result())))
        loop = EngineLoop(engine, on_step=lambda e, _outs: self.metrics.step.observe(e.last_step_s))
        loop.start()
        self.metrics.bind(engine)
        self.loop, self.engine = loop, engine

    def _failed(self, e: BaseException) -> None:
        self.load_error = e
        if self.on_load_failed is not None:
            self.on_load_failed(e)

    def stop_engine(self, timeout_s: float = 10.0) -> None:
        """Aborts what is left and joins the engine's thread (which closes the engine); from any thread, twice is
        fine."""
        if self.loop is not None:
            self.loop.stop(timeout_s)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def stop(self) -> None:
        """At shutdown: aborts what is left, then ends the engine's thread."""
        await asyncio.to_thread(self.stop_engine)

    async def drain(self, grace_s: float) -> None:
        """Stops taking requests (503), waits up to grace_s for those in flight, then aborts the rest."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.jobs and self.loop is not None:
            log.warning("shutdown: aborting %d request(s) still running", len(self.jobs))
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

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    def tokenizer(self):
        tok = self.ready_engine().tokenizer
        if tok is None:
            raise APIError(400, "this model was loaded without a tokenizer: send the prompt as token ids to "
                                "/v1/completions", param="prompt")
        return tok

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.ready_engine().model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} out of range 0..{vocab - 1}", param=param)

    def check_text_size(self, chars: int, param: str) -> None:
        """Refuses at once, without tokenising, text too long for any prompt to fit the context."""
        context = self.ready_engine().plan.kv.max_context
        if self.token_bytes is not None and chars > context * self.token_bytes:
            raise APIError(400, f"the prompt's {chars} characters are more than {context} tokens (policy.kv."
                                f"max_context) can hold: at most {self.token_bytes} characters per token",
                           param=param, code="context_length_exceeded")

    async def offload(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the tokenizer's threads (tokenising, templating, decoding)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor,
                                                                functools.partial(fn, *args, **kwargs))

    def queued(self, engine: Engine) -> int:
        """Requests waiting, less the free KV slots the next step admits them into (up to the batch cap)."""
        s = engine.scheduler
        room = max(0, min(len(s.free), s.batch_cap - len(s.running)))
        return engine.waiting - room

    def submit(self, request: Request, prompt: list[int], params: SamplingParams) -> Job:
        return self.submit_all(request, [(prompt, params)])[0]

    def submit_all(self, request: Request, work: list[tuple[list[int], SamplingParams]]) -> list[Job]:
        """Queues requests together, or none: 429 when more than server.max_waiting would then wait for a KV slot
        (those the next step admits do not count), 400 when the engine cannot take one."""
        engine = self.ready_engine()
        queued = self.queued(engine) + len(work)
        if queued > self.cfg.max_waiting:
            raise APIError(429, f"{queued} requests would wait for a KV slot (server.max_waiting "
                                f"{self.cfg.max_waiting}); retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}, outcome="queue_full")
        jobs = []
        try:
            for prompt, params in work:
                jobs.append(self.loop.submit(prompt, params, on_finish=self._finished))
        except RequestError as e:
            self.abort(jobs)
            raise APIError(400, str(e), param="max_tokens" if "max_tokens" in str(e) else None)
        for job, (prompt, _) in zip(jobs, work):
            self.jobs.add(job)
            self.metrics.prompt_tokens.inc(len(prompt))
            job.watcher = asyncio.ensure_future(self._watch(request, job))
        return jobs

    def abort(self, jobs: list[Job]) -> None:
        for job in jobs:
            if not job.finished and self.loop is not None:
                self.loop.abort(job.id)

    async def _watch(self, request: Request, job: Job) -> None:
        """Aborts the job when its client disconnects (the body is read: the next message is the disconnect)."""
        with contextlib.suppress(Exception):
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.abort([job])
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
            self.abort([job])

    def failure(self, out: RequestOutput) -> Optional[APIError]:
        """Why a finished request has no answer: the engine failed it (500) or it was aborted (503)."""
        if out.finish_reason is FinishReason.error:
            return APIError(500, f"the engine failed this request: {out.error}", "server_error", code="engine_error",
                            outcome=None)
        if out.finish_reason is FinishReason.abort:
            why = "the server is shutting down" if self.draining else "aborted"
            return APIError(503, f"the request was aborted: {why}", "server_error", code="aborted", outcome=None)
        return None


def _longest_token(tok) -> int:
    """The most UTF-8 bytes one token's text takes: a text of n characters needs at least n / this many tokens."""
    return max(len(tok.decode([i]).encode()) for i in range(tok.vocab_size))
