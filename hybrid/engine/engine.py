"""The serving engine: requests in (`add_request`, `abort`: from any thread), one `step` at a time (from one thread),
each request's progress out. A step: schedule (scheduler.py) -> run (runner.py: prefill chunks and a decode step
through the plan's Decoder; beside.py: a prefill beside decode) -> process outputs (outputs.py: sampling, text,
endings); the parts hand their results back to this loop. Usage: docs/design/engine.md.

A request's greedy tokens do not depend on its batch mates with policy.decode.batch_invariant (without it: on the
CPU, but for AMX tiles and avx512_bf16's outer-product form, which an expert takes from enough tokens), and a
seeded request samples the same tokens whatever they are.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, Sequence

import torch

from hybrid.engine.beside import BesideDecode
from hybrid.engine.decoder import DecodeFn, Decoder
from hybrid.engine.generate import Completion, generate
from hybrid.engine.inbox import Inbox, check
from hybrid.engine.outputs import OutputProcessor, error_text
from hybrid.plan.plan import Plan
from hybrid.engine.requests import FinishReason, Request, RequestOutput, SamplingParams, State
from hybrid.engine.peer_link import PeerLink, PrefillPeer
from hybrid.engine.runner import ModelRunner
from hybrid.engine.scheduler import Chunk, Scheduler
from hybrid.engine.staggered import micro_batches
from hybrid.engine.streams import decode_stream, on
from hybrid.kernels import thread_pool
from hybrid.model.kv_cache import KVCache
from hybrid.model.transformer import Transformer
from hybrid.placement.hot_experts import HotExperts
from hybrid.tokenizer import Tokenizer

if TYPE_CHECKING:
    from hybrid.engine.build import Placed
    from hybrid.engine.cuda_graphs import GraphedDecode


class Engine:
    def __init__(self, model: Transformer, plan: Plan, tokenizer: Optional[Tokenizer] = None,
                 cache: Optional[KVCache] = None, decode: Optional[Decoder | DecodeFn] = None,
                 long_prefill: Optional[Callable[..., ContextManager]] = None,
                 after_prefill: Optional[Callable[[], None]] = None, placed: Optional["Placed"] = None,
                 hot: Sequence[HotExperts] = (), peer: Optional[PrefillPeer] = None):
        """cache, decode (a Decoder or a step function), long_prefill, after_prefill: the model runner's
        (ModelRunner). `placed`: what placement made (build.py's Placed: staging, stream loader, GEMM, ...), `hot`:
        the hot experts. `peer`: the second prefill device's process (hybrid/parallel/peer.py, started by build()
        for policy.prefill.gpus=2): a long prompt goes to both devices when nothing decodes, to the peer alone
        beside decode while requests decode; the engine closes it."""
        self.model, self.tokenizer, self.plan, self.device = model, tokenizer, plan, torch.device(plan.device)
        self.placed, self.hot = placed, list(hot)
        self.runner = ModelRunner(model, plan, cache, decode, long_prefill, after_prefill,
                                  placed.staging if placed else None)
        self.cache = self.runner.cache
        self.outputs = OutputProcessor(tokenizer, model.args.eos_token_id)
        # with a peer, prompts above the cutoff take the two-device paths (on the CPU stand-in too)
        long_cutoff = plan.prefill.slp_cutoff_tokens if long_prefill is not None or peer is not None else None
        self.scheduler = Scheduler(self.cache.slots, plan.decode.batch_cap, plan.prefill.chunk_tokens, long_cutoff,
                                   plan.prefill.gpus, beside_decode=plan.prefill.beside_decode or peer is not None,
                                   admitted=self.runner.admit)
        self.kv = self.runner.kv
        self._link = PeerLink(peer, self.scheduler, plan.prefill.beside_decode, streams=long_prefill is not None)
        self.inbox = Inbox()
        self._requests: dict[int, Request] = {}
        self._given: set[int] = set()  # requests whose token this step came from the step launched ahead
        self._held: dict[int, Request] = {}  # ... collected between steps (close, prefill): reported by the next
        # the steps' GPU work, at the device's highest priority: ahead of a prefill streaming beside decode
        self.stream = decode_stream(self.device)
        self.beside = BesideDecode(self.runner, plan)  # the prompt prefilled beside decode (`job`), if any
        self.last_step_s = 0.0

    # -- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        """Queues a request; raises RequestError (nothing queued) when it cannot be served."""
        prompt = [int(t) for t in prompt_ids]
        self.check(prompt, params)
        return self.inbox.add(prompt, params)

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Why a request cannot be served, as a RequestError (naming the numbers and the knob)."""
        check(prompt, params, self.model.args.vocab_size, self.plan.kv.max_context, self.tokenizer is not None)

    def abort(self, rid: int) -> None:
        """Ends the request at the next step (reason `abort`); unknown or finished ids are ignored."""
        self.inbox.abort(rid)

    def has_work(self) -> bool:
        return self.inbox.busy() or self.scheduler.has_work()

    def request(self, rid: int) -> Request:
        """A request queued or running (or finished, until its last output)."""
        return self.inbox.find(rid) or self._requests[rid]

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops a prefill beside decode (at its next expert; its request then finishes as aborted) and waits for its
        thread, then the prefill peer's process; steps may follow, on this one device."""
        self._drain_between_steps()
        self.beside.close(timeout_s)
        self._link.close(timeout_s)

    @property
    def peer(self) -> Optional[PrefillPeer]:
        """The second prefill device's process, while it serves (None: one device)."""
        return self._link.peer

    @property
    def graphs(self) -> Optional["GraphedDecode"]:
        """The plan's graphed decoder (its captured graphs and native jobs); None where decode runs eagerly."""
        return self.runner.graphed.get(self.plan.decode.cuda_graphs)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a request (unless it asks to ignore them): the model's eos, the tokenizer's."""
        return self.outputs.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self.outputs.eos_ids = ids

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.inbox)

    # -- one step: schedule, run, process outputs -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admits waiting requests, runs this step's prefill work and one decode step for the decoding requests;
        returns the progress of every request that made some (and of those that ended)."""
        t0 = time.perf_counter()
        changed = dict(self._held)  # collected between steps: this step's token is theirs already
        self._given, self._held = set(changed), {}
        with on(self.stream):
            self._step(changed)
        self.last_step_s = time.perf_counter() - t0
        return [self._output(r) for r in changed.values()]

    def _step(self, changed: dict[int, Request]) -> None:
        if self.runner.refresh_due:  # a prefill beside decode ended while a step ran ahead: refreshed now
            self._drain_ahead(changed)
            self.runner.refresh()
        self._take_inbox(changed)
        plan = self.scheduler.plan()
        if plan.prefill:
            self._drain_ahead(changed)  # a prefill calls the layers' native ops
        self.beside.pace(decoding=bool(plan.decode))
        try:
            self._size_pool(changed)
            for chunk in plan.prefill:
                self._prefill(chunk, changed)
            live = [r for r in plan.decode if not r.finished and r.id not in self._given]
            if self.runner.ahead is not None:  # it goes on if its requests are one of this step's micro-batches
                self._drain_ahead(changed, micro_batches(live) if self.plan.decode.dual_batch else None)
                live = [r for r in live if not r.finished and r.id not in self._given]
            if live:
                self.runner.decode(live, functools.partial(self._sampled, changed), capture=not self.beside.running,
                                   busy=self.inbox.busy)  # no graph capture while another thread uses the GPU
        finally:
            self.beside.release()
        self._collect_beside(changed, wait=not live and not plan.prefill)

    def _take_inbox(self, changed: dict[int, Request]) -> None:
        new, aborts = self.inbox.take()
        if new or aborts:  # requests come or go: the micro-batch step launched ahead is collected first
            self._drain_ahead(changed)
        for req in new:
            self._requests[req.id] = req
            self.outputs.add(req)
            self.scheduler.add(req)
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None and not self.beside.cancel(req) and not req.finished:
                self._finish(req, FinishReason.abort, changed)

    def _prefill(self, chunk: Chunk, changed: dict[int, Request]) -> None:
        if chunk.beside and self._link.beside(chunk):
            try:
                self.runner.kv.reserve(chunk.request.slot, chunk.end)
                self.beside.start(chunk, self._link.live())
                chunk.request.state = State.streaming
            except Exception as e:  # no stream or thread to run it: this request fails, the others go on
                self._fail(chunk.request, e, changed)
            return self._size_pool(changed)
        try:
            logits = self.runner.prefill_chunk(chunk, self._link.together(chunk))
        except Exception as e:  # this request fails; the others go on
            return self._fail(chunk.request, e, changed)
        self._prefilled(chunk, logits, changed)

    def _prefilled(self, chunk: Chunk, logits: torch.Tensor, changed: dict[int, Request]) -> None:
        """A chunk's prefill is done: the first token sampled after the prompt's last chunk."""
        req = chunk.request
        try:
            token = self.outputs.first(req, logits) if chunk.last else None
        except Exception as e:
            return self._fail(req, e, changed)
        req.prefilled = chunk.end
        self.runner.prefilled(req, chunk.end)
        if token is not None:
            req.state = State.decoding
            self._append(req, token, changed)
            self.runner.refresh()

    def _collect_beside(self, changed: dict[int, Request], wait: bool) -> None:
        """The prefill beside decode, once it has ended: its request decodes from the next step (or fails, or
        finishes as aborted). `wait`: nothing else to do in this step, so wait a moment for it."""
        b = self.beside.collect(wait)
        if b is None:
            return
        if b.cancelled.is_set():
            self._finish(b.chunk.request, FinishReason.abort, changed)
        elif b.error is not None:
            self._fail(b.chunk.request, b.error, changed)
        else:
            b.chunk.request.state = State.prefilling
            self._prefilled(b.chunk, b.logits, changed)

    def _size_pool(self, changed: dict[int, Request]) -> None:
        """The native pool's threads for this step's CPU work, set between jobs (a step launched ahead collected)."""
        want = self.beside.threads()
        if want is not None:
            self._drain_ahead(changed)
            thread_pool.set_threads(want)

    def _drain_ahead(self, changed: dict[int, Request], keep: Optional[list[list[Request]]] = None) -> None:
        self._given.update(self.runner.drain(functools.partial(self._sampled, changed), keep))

    def _drain_between_steps(self) -> None:
        """The step launched ahead collected outside a step; its requests' progress goes out with the next step."""
        with on(self.stream):
            self._drain_ahead(self._held)

    # -- process outputs --------------------------------------------------------------------------------------
    def _sampled(self, changed: dict[int, Request], reqs: list[Request], logits: torch.Tensor | Exception) -> None:
        """A decode step's result: each request's token from its row of the logits, or the error that fails it."""
        for req, token in zip(reqs, self.outputs.sample(reqs, logits)):
            if isinstance(token, Exception):
                self._fail(req, token, changed)
            else:
                self._append(req, token, changed)

    def _append(self, req: Request, token: int, changed: dict[int, Request]) -> None:
        changed[req.id] = req
        reason = self.outputs.append(req, token)
        if reason is not None:
            self._finish(req, reason, changed)

    def _finish(self, req: Request, reason: FinishReason, changed: dict[int, Request], error: str = "") -> None:
        req.finish_reason, req.error = reason, error
        if req.slot >= 0 and req.state is not State.waiting:
            self.runner.release(req)
        self.scheduler.finish(req)
        self.outputs.drop(req)
        changed[req.id] = req

    def _fail(self, req: Request, e: BaseException, changed: dict[int, Request]) -> None:
        self._finish(req, FinishReason.error, changed, error_text(e))

    def _output(self, req: Request) -> RequestOutput:
        if req.finished:
            self._requests.pop(req.id, None)
        return self.outputs.output(req)

    # -- probes and convenience: benchmarks, warm-up, tests ---------------------------------------------------
    def prefill(self, prompt_ids: Sequence[int], slot: int = 0, streamed: Optional[bool] = None,
                **stream) -> tuple[torch.Tensor, list]:
        """Prefills prompt_ids into KV slot `slot` (no request may hold it; it gets blocks for its whole context, for
        decode steps the caller runs there) and returns the last token's logits and
        the statistics of each stream-loading pass (dicts: expert_loop_s, expert_loop_cpu_s, group_sizes).
        streamed: None = as the scheduler would; `stream` (ring_len, group, gemm) replaces the plan's for this call."""
        prompt = list(prompt_ids)
        self._drain_between_steps()  # the layers' ops are free
        streamed = self.runner.streamed(len(prompt), streamed)
        if any(r.slot == slot for r in self.scheduler.running):
            raise RuntimeError(f"KV slot {slot} is held by a request")
        self.runner.kv.hold(slot)
        return self.runner.prefill(prompt, 0, len(prompt), slot, streamed, **stream)

    def decoder(self, mode: Optional[str] = None) -> Decoder:
        """The decode step (tokens_B1, pos_B1, slots_B, kv_len) -> logits_BV: eager for `off`, else under CUDA
        graphs in that mode (hostfn | segments; captured on first use); None = the plan's."""
        return self.runner.decoder_for(mode or self.plan.decode.cuda_graphs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_output: Optional[Callable[[int, RequestOutput], None]] = None) -> list[Completion]:
        """Every prompt as a request, stepped until all finish; on_output(prompt index, output): see generate.py."""
        return generate(self, prompts, params, on_output)
