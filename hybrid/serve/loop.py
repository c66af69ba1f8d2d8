"""The engine's own thread, between the asyncio HTTP side and `Engine.step`.

The thread steps the engine while it has work and sleeps on a condition when it has none; each step's outputs go to
their request's `Job` (an asyncio queue) through `loop.call_soon_threadsafe`, so the event loop never waits on the
model. `submit` and `abort` are called from the event loop: adding a request and aborting one only queue work for
the engine's next step (hybrid/engine/engine.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from typing import Callable, Optional, Sequence

from hybrid.engine.engine import Engine
from hybrid.engine.requests import FinishReason, RequestOutput, SamplingParams

log = logging.getLogger("hybrid.serve")


class Job:
    """One engine request as the HTTP side sees it: its outputs in order (`next`), and the times of its first and
    last tokens. `on_finish(job)` runs on the event loop when the engine hands back the request's last output."""

    def __init__(self, rid: int, loop: asyncio.AbstractEventLoop, prompt_tokens: int,
                 on_finish: Optional[Callable[["Job"], None]] = None):
        self.id, self.loop, self.prompt_tokens = rid, loop, prompt_tokens
        self.on_finish = on_finish
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None
        self.completion_tokens = 0
        self.final: Optional[RequestOutput] = None  # the last output, once the engine is done with the request
        self.watcher: Optional[asyncio.Task] = None  # aborts the request when its client goes away

    @property
    def finished(self) -> bool:
        return self.final is not None

    def put(self, out: RequestOutput) -> None:
        """On the event loop: one output from the engine thread."""
        if self.finished:
            return
        if out.new_token_ids:
            now = time.perf_counter()
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.completion_tokens += len(out.new_token_ids)
        self.queue.put_nowait(out)
        if out.finished:
            self.final = out
            if self.watcher is not None:
                self.watcher.cancel()
            if self.on_finish is not None:
                self.on_finish(self)

    async def next(self) -> RequestOutput:
        return await self.queue.get()


class EngineLoop:
    def __init__(self, engine: Engine, on_step: Optional[Callable[[Engine, Sequence[RequestOutput]], None]] = None):
        """on_step(engine, outputs): called on the engine thread after each step (metrics)."""
        self.engine, self._on_step = engine, on_step
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._stopping = False
        self._stop_by = 0.0  # when stopping: steps end by then even if the engine still has work
        self._thread = threading.Thread(target=self._run, name="hybrid-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Aborts what is left, lets the engine hand the aborts back, then ends the thread."""
        for rid in self.pending():
            self.engine.abort(rid)
        with self._cond:
            self._stopping, self._stop_by = True, time.monotonic() + timeout_s / 2
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               on_finish: Optional[Callable[[Job], None]] = None) -> Job:
        """From the event loop: queues a request (RequestError when the engine cannot take it)."""
        loop = asyncio.get_running_loop()
        with self._lock:  # registered before the engine thread can route its first output
            rid = self.engine.add_request(prompt_ids, params)
            job = self._jobs[rid] = Job(rid, loop, len(prompt_ids), on_finish)
        self._wake()
        return job

    def abort(self, rid: int) -> None:
        self.engine.abort(rid)
        self._wake()

    def pending(self) -> list[int]:
        """Requests submitted whose last output has not been routed yet."""
        with self._lock:
            return list(self._jobs)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.engine.has_work():
                    self._cond.wait(1.0)
                if self._stopping and (not self.engine.has_work() or time.monotonic() > self._stop_by):
                    break
            try:
                outs = self.engine.step()
            except Exception as e:  # a bug outside the model's forward (which the engine catches per request)
                log.error("engine step failed:\n%s", traceback.format_exc())
                outs = self._fail_all(f"{type(e).__name__}: {e}")
                time.sleep(0.05)
            self._route(outs)
            if self._on_step is not None:
                try:
                    self._on_step(self.engine, outs)
                except Exception:
                    log.exception("on_step failed")
        self.engine.close()  # a prefill still running beside decode stops at its next expert
        self._route(self._fail_all("the engine stopped"))

    def _route(self, outs: Sequence[RequestOutput]) -> None:
        for out in outs:
            with self._lock:
                job = self._jobs.pop(out.id, None) if out.finished else self._jobs.get(out.id)
            if job is None:
                continue
            try:
                job.loop.call_soon_threadsafe(job.put, out)
            except RuntimeError:  # its event loop has closed: nobody is waiting
                pass

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every request still registered with an error output (and tells the engine to drop them)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self.engine.abort(job.id)
        return [RequestOutput(job.id, [], "", True, FinishReason.error, message, job.prompt_tokens,
                              job.completion_tokens) for job in jobs]
