"""A stream-loading prefill beside decode (policy.prefill.beside_decode): one prompt at a time on a thread of its own
(and its own CUDA stream, on the SMs plan.prefill_sms leaves it), or on the prefill peer's device
(peer_link.py `PrefillPeer.beside`), while the engine's thread goes on stepping decode. The weights stay one
copy in host memory: decode's CPU experts read them there, the prefill streams them through the GPU.

While it runs, its stream's limits apply while requests decode (plan.prefill.stream_cap_gbps, stream_queue_mb,
stream_duty; none when nothing decodes) and decode's CPU experts leave it plan.prefill.beside_cores of the native
thread pool (Plan.decode_threads). The engine's thread collects it once it has ended."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid.plan.plan import Plan
from hybrid.engine.peer_link import BesideJob, PrefillPeer
from hybrid.engine.requests import Request
from hybrid.engine.runner import ModelRunner
from hybrid.engine.scheduler import Chunk
from hybrid.engine.streams import PrefillSide
from hybrid.kernels import thread_pool
from hybrid.prefill.throttle import Throttle


@dataclass
class Beside:
    """A prompt's stream-loading prefill on a thread of this process."""
    chunk: Chunk
    thread: threading.Thread
    done: threading.Event
    cancelled: threading.Event  # aborted: the prefill stops at its next stream-loading chunk
    side: Optional[torch.cuda.Stream]
    logits: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None

    @classmethod
    def start(cls, runner: ModelRunner, chunk: Chunk, side: Optional[torch.cuda.Stream],
              throttle: Throttle) -> "Beside":
        req = chunk.request
        if side is not None:  # what the engine's stream wrote (e.g. a cleared slot) before the prefill reads
            side.wait_stream(torch.cuda.current_stream(runner.device))
        b = cls(chunk, threading.Thread(target=lambda: b._run(runner, throttle), name=f"prefill-{req.id}",
                                        daemon=True), threading.Event(), threading.Event(), side)
        b.thread.start()
        return b

    def cancel(self) -> None:
        self.cancelled.set()

    def _run(self, runner: ModelRunner, throttle: Throttle) -> None:
        c = self.chunk
        try:
            with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
                self.logits = runner.prefill(c.request.prompt, c.start, c.end, c.request.slot, True,
                                             throttle=throttle, cancelled=self.cancelled)[0]
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, which fails the request
            self.error = e
        finally:
            self.done.set()


class BesideDecode:
    """The prefill running beside decode, if any, and what decode leaves it while it runs."""

    def __init__(self, runner: ModelRunner, plan: Plan):
        self.runner, self.plan = runner, plan
        self.job: Optional[BesideJob] = None
        self.throttle = Throttle()
        self._side = PrefillSide(runner.device, plan.prefill_sms)  # where a prompt beside decode computes

    @property
    def running(self) -> bool:
        return self.job is not None

    @property
    def chunk(self) -> Optional[Chunk]:
        """The chunk being prefilled beside decode."""
        return self.job.chunk if self.job is not None else None

    def start(self, chunk: Chunk, peer: Optional[PrefillPeer]) -> None:
        """A stream-loaded prompt beside decode: on the peer's device when there is a peer (this device keeps
        decoding at full speed), else on a thread of this process. Raises where neither can start."""
        if peer is not None and chunk.streamed and chunk.start == 0:
            self.job = peer.beside(chunk, self.runner.cache, self.plan.prefill, self.plan.gpu.memory_budget_gb)
        else:
            self.job = Beside.start(self.runner, chunk, self._side.stream(), self.throttle)

    def cancel(self, req: Request) -> bool:
        """Whether `req` is the one prefilled beside decode: then stopped at its next expert (its slot is written
        until then; it finishes when collected)."""
        if self.job is None or self.job.chunk.request is not req:
            return False
        self.job.cancel()
        return True

    def collect(self, wait: bool) -> Optional[BesideJob]:
        """The prefill, once it has ended (its thread joined, its KV writes and logits ordered before what the
        engine's stream runs next); None while it runs. `wait`: wait a moment for it."""
        b = self.job
        if b is None or not b.done.wait(0.01 if wait else 0):
            return None
        self.job = None
        b.thread.join()
        if b.side is not None:
            main = torch.cuda.current_stream(self.runner.device)
            main.wait_stream(b.side)
            if b.logits is not None:
                b.logits.record_stream(main)  # made on the side stream, read on this one
        return b

    def close(self, timeout_s: float) -> None:
        """Stops the prefill (at its next expert) and waits for its thread."""
        if self.job is not None:
            self.job.cancel()
            self.job.thread.join(timeout_s)

    def pace(self, decoding: bool) -> None:
        """The stream's limits for this step: paced while requests decode, at full speed when none does."""
        if decoding:
            p = self.plan.prefill
            self.throttle.set_limits(p.stream_cap_gbps * 1e9 or None, int(p.stream_queue_mb * 2 ** 20) or None,
                                     p.stream_duty)
        else:
            self.throttle.set_limits(None, None, None)

    def release(self) -> None:
        """A rest the step held (`threads`) ends as it was to."""
        self.throttle.release()

    def threads(self) -> Optional[int]:
        """The native pool's threads for this step's CPU work (Plan.decode_threads) where the pool has another count;
        None where it is right. With plan.prefill.cores_back_in_rests, a step begun while the prefill rests (its duty
        cycle) takes its cores too, the rest held until the step is done (`release`)."""
        if not self.plan.prefill.beside_cores:
            return None
        beside = self.job is not None and not (self.plan.prefill.cores_back_in_rests and self.throttle.hold())
        want = self.plan.decode_threads(beside)
        return want if thread_pool.threads() != want else None
