"""The serving engine: one object that owns the placed model, its KV slots, the decode strategy (eager or CUDA
graphs), the stream-loading prefill and the hot experts, and serves requests as they come.

    engine = build(settings, hw)                    # hybrid/engine/build.py
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7, seed=1))
    while engine.has_work():
        for out in engine.step():                   # new tokens and text per request; why it finished
            ...
    engine.abort(rid)                               # from any thread: its slot is free after the next step

`add_request` and `abort` may be called from any thread; `step` from one (the engine's) at a time. A request's
greedy tokens do not depend on its batch mates with policy.decode.batch_invariant (without it: on the CPU, but
for AMX tiles and avx512_bf16's outer-product form, which an expert takes from enough tokens), and a seeded
request samples the same tokens whatever they are.
Scheduling: hybrid/engine/scheduler.py.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable, Optional, Sequence

import torch

from hybrid.engine.plan import Plan, decode_threads
from hybrid.engine.requests import FinishReason, Request, RequestError, RequestOutput, SamplingParams, State
from hybrid.engine.sampler import Sampler, choose
from hybrid.engine.scheduler import Chunk, Scheduler
from hybrid.engine.streams import PrefillSide, decode_stream, on
from hybrid.kernels import thread_pool
from hybrid.model.kv_cache import KVCache
from hybrid.model.transformer import Transformer
from hybrid.prefill.throttle import Throttle
from hybrid.tokenizer import Tokenizer

if TYPE_CHECKING:
    from hybrid.parallel.peer import Knobs, Peer

# decode(tokens_B1, pos_B1, slots_B, kv_len, capture=True) -> logits_BV: eager, or replayed CUDA graphs (capture:
# a graph not made yet may be captured now; False while another thread uses the GPU)
DecodeFn = Callable[..., torch.Tensor]


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""
    id: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason]
    error: str
    ttft_s: float
    tpot_s: float
    token_times: list[float]


class Engine:
    def __init__(self, model: Transformer, plan: Plan, tokenizer: Optional[Tokenizer] = None,
                 cache: Optional[KVCache] = None, decode: Optional[DecodeFn] = None,
                 long_prefill: Optional[Callable[[int], ContextManager]] = None,
                 after_prefill: Optional[Callable[[], None]] = None, parts: Optional[dict] = None,
                 peer: Optional["Peer"] = None):
        """cache: the KV slots (default: plan.max_batch x plan.max_context on plan.device); decode: the decode step
        (default: eager); long_prefill(tokens): the context in which a prompt's chunk of that many tokens is
        prefilled by stream-loading (None: every prompt takes the chunked path); after_prefill: called once a
        prompt is prefilled (e.g. move the hottest experts onto the GPU). `parts`: the placement's objects, for benchmarks and tests (staging,
        graphs, stream loader, hot experts). `peer`: the second prefill device's process (hybrid/parallel/peer.py,
        started by build() for policy.prefill.gpus=2; the engine does not make processes itself): a long prompt
        goes to both devices when nothing decodes (chunks the scheduler marks gpus=2), and to the peer alone,
        beside decode, while requests decode (§5.1); the engine closes it."""
        self.model, self.tokenizer, self.plan = model, tokenizer, plan
        self.cache = cache or model.new_cache(plan.max_batch, plan.max_context, plan.device)
        self.device = plan.device
        self._decode = decode or self._eager_decode
        self._decoders: dict[str, DecodeFn] = {plan.cuda_graphs: decode} if decode is not None else {}
        self._long_prefill, self._after_prefill = long_prefill, after_prefill
        self.parts = dict(parts or {})
        # the ids that end a request (unless it asks to ignore them): the model's eos, the tokenizer's
        self.eos_ids = frozenset({model.args.eos_token_id} - {None})
        if tokenizer is not None:
            self.eos_ids |= tokenizer.eos_ids
        # with a peer, prompts above the cutoff take the two-device paths (on the CPU stand-in too, where this
        # process streams nothing itself), and one stream-loaded at a time runs beside decode: on the peer's device
        # while requests decode, so decode is never held for it. Without one, a chunk marked for two GPUs runs on
        # this engine's one device.
        self._peer = peer
        self.scheduler = Scheduler(self.cache.slots, plan.batch_cap, plan.prefill_chunk_tokens,
                                   plan.slp_cutoff_tokens if long_prefill is not None or peer is not None else None,
                                   plan.prefill_gpus, beside_decode=plan.prefill_beside_decode or peer is not None)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: set[int] = set()
        self._requests: dict[int, Request] = {}
        self._samplers: dict[int, Sampler] = {}
        self._throttle = Throttle()  # limits a stream-loading prefill beside decode (plan.stream_cap_bytes_s,
        # stream_queue_bytes, stream_duty)
        self._beside: Optional[_Beside] = None  # the stream-loading prefill running beside decode, if any
        self._ahead: Optional[_Ahead] = None  # staggered dual-batch decode: the micro-batch step launched ahead
        self._given: set[int] = set()  # requests whose token this step came from the step launched ahead
        self._held: dict[int, Request] = {}  # ... collected between steps (close, prefill): reported by the next
        self._refresh_due = False  # after_prefill put off until no step runs ahead
        # the steps' GPU work, at the device's highest priority: ahead of a prefill streaming beside decode
        self.stream = decode_stream(self.device)
        self._side = PrefillSide(self.device, plan.prefill_sms)  # where a prompt beside decode computes
        self.last_step_s = 0.0

    # -- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        """Queues a request; raises RequestError (nothing queued) when it cannot be served."""
        prompt = [int(t) for t in prompt_ids]
        self.check(prompt, params)
        with self._lock:
            rid = next(self._ids)
            self._inbox.append(Request(rid, prompt, params))
        return rid

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Why a request cannot be served, as a RequestError (naming the numbers and the knob)."""
        if not prompt:
            raise RequestError("empty prompt")
        vocab = self.model.args.vocab_size
        bad = [t for t in prompt + list(params.token_ids) if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} out of range 0..{vocab - 1}")
        need, room = len(prompt) + params.max_tokens, self.plan.max_context
        if need > room:
            raise RequestError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {need} exceeds "
                               f"the {room} tokens a KV slot holds (policy.kv.max_context)")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the checkpoint's tokenizer")

    def abort(self, rid: int) -> None:
        """Ends the request at the next step (reason `abort`); unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.add(rid)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts) or self.scheduler.has_work()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops a prefill running beside decode (at its next expert) and waits for its thread, then stops the
        prefill peer's process; steps may follow (the request then finishes as aborted; later prompts on this
        one device)."""
        self._drain_between_steps()
        b = self._beside
        if b is not None:
            b.cancel()
            b.thread.join(timeout_s)
        if self._peer is not None:
            self._peer.close(timeout_s)
            self._drop_peer()

    @property
    def peer(self) -> Optional["Peer"]:
        """The second prefill device's process, while it serves (None: one device)."""
        return self._peer

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self.scheduler.waiting) + len(self._inbox)

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admits waiting requests, runs this step's prefill work and one decode step for the decoding requests;
        returns the progress of every request that made some (and of those that ended)."""
        t0 = time.perf_counter()
        changed: dict[int, Request] = {}
        with on(self.stream):
            self._step(changed)
        self.last_step_s = time.perf_counter() - t0
        return [self._output(r) for r in changed.values()]

    def _step(self, changed: dict[int, Request]) -> None:
        self._given = set(self._held)  # collected between steps: this step's token is theirs already
        changed.update(self._held)
        self._held = {}
        if self._refresh_due:  # a prefill beside decode ended while a step ran ahead: refreshed now
            self._drain_ahead(changed)
            self._refresh_due = False
            self._refresh()
        self._take_inbox(changed)
        plan = self.scheduler.plan()
        if plan.prefill:
            self._drain_ahead(changed)  # a prefill calls the layers' native ops
        # a stream-loading prefill beside decode is paced while requests decode, at full speed when none does
        if plan.decode:
            self._throttle.set_limits(self.plan.stream_cap_bytes_s, self.plan.stream_queue_bytes,
                                      self.plan.stream_duty)
        else:
            self._throttle.set_limits(None, None, None)
        try:
            self._size_pool(changed)
            for chunk in plan.prefill:
                if chunk.beside and self._beside_applies(chunk):
                    try:
                        self._beside = self._start_beside(chunk)
                        chunk.request.state = State.streaming
                    except Exception as e:  # no stream or thread to run it: this request fails, the others go on
                        self._fail([chunk.request], e, changed)
                    self._size_pool(changed)
                else:
                    self._prefill(chunk, changed)
            live = [r for r in plan.decode if not r.finished and r.id not in self._given]
            if self._ahead is not None:  # it goes on if its requests are one of this step's micro-batches
                self._drain_ahead(changed, micro_batches(live) if self.plan.dual_batch else None)
                live = [r for r in live if not r.finished and r.id not in self._given]
            if live:
                self._decode_step(live, changed)
        finally:
            self._throttle.release()  # a rest this step held (_size_pool) ends as it was to
        self._collect_beside(changed, wait=not live and not plan.prefill)

    def _take_inbox(self, changed: dict[int, Request]) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        if new or aborts:  # requests come or go: the micro-batch step launched ahead is collected first
            self._drain_ahead(changed)
        for req in new:
            self._requests[req.id] = req
            self._samplers[req.id] = Sampler(req.params, req.prompt)
            self.scheduler.add(req)
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None and self._beside is not None and self._beside.chunk.request is req:
                self._beside.cancel()  # its slot is written until the prefill stops: it finishes then
            elif req is not None and not req.finished:
                self._finish(req, FinishReason.abort, changed)

    def _prefill(self, chunk: Chunk, changed: dict[int, Request]) -> None:
        try:
            logits = self._prefill_logits(chunk)
        except Exception as e:  # this request fails; the others go on
            self._fail([chunk.request], e, changed)
            return
        self._prefilled(chunk, logits, changed)

    def _prefilled(self, chunk: Chunk, logits: torch.Tensor, changed: dict[int, Request]) -> None:
        """A chunk's prefill is done: the first token sampled after the prompt's last chunk."""
        req = chunk.request
        try:
            token = self._samplers[req.id].sample(logits) if chunk.last else None
        except Exception as e:
            self._fail([req], e, changed)
            return
        req.prefilled = chunk.end
        if token is not None:
            req.state = State.decoding
            self._append(req, token, changed)
            self._refresh()

    def _refresh(self) -> None:
        """after_prefill (e.g. moving the hottest experts in): a failure there warns and the requests go on. Not
        while a micro-batch's step runs ahead (it reads the hot experts): then at the start of the next step."""
        if self._after_prefill is None:
            return
        if self._ahead is not None:
            self._refresh_due = True
            return
        try:
            self._after_prefill()
        except Exception as e:  # noqa: BLE001 - an optimisation failed, not a request
            warnings.warn(f"after a prefill: {type(e).__name__}: {e} (the engine goes on without it)")

    def _prefill_logits(self, chunk: Chunk) -> torch.Tensor:
        req = chunk.request
        if self._together(chunk):  # both devices: this process is rank 0 of the two-rank prefill
            return self._peer.together(self.model, self.cache, req.prompt[chunk.start:chunk.end], req.slot,
                                       chunk.start, self._knobs())
        return self._prefill_range(req.prompt, chunk.start, chunk.end, req.slot, chunk.streamed)[0]

    # -- the prefill peer (hybrid/parallel/peer.py) ------------------------------------------------------------
    def _live_peer(self) -> Optional["Peer"]:
        """The peer while it can take commands; one that died or broke is let go here (with a warning), once."""
        p = self._peer
        if p is not None and not p.alive:
            warnings.warn(f"the prefill peer is gone ({p.why_not()}): the engine goes on on one device")
            p.close()
            self._drop_peer()
        return self._peer

    def _drop_peer(self) -> None:
        """One device from now on: the scheduler's rules as without a peer."""
        self._peer = None
        s = self.scheduler
        s.gpus, s.beside_decode = 1, self.plan.prefill_beside_decode
        if self._long_prefill is None:
            s.long_cutoff = None

    def _together(self, chunk: Chunk) -> bool:
        """A chunk for both devices (the scheduler's rule: a long prompt when nothing decodes) with a peer to
        share it with; a prompt's first positions must be on both (it starts at 0)."""
        return chunk.gpus > 1 and chunk.streamed and chunk.start == 0 and self._live_peer() is not None

    def _beside_applies(self, chunk: Chunk) -> bool:
        """Whether a chunk planned beside decode runs so: not when it goes to both devices (this process takes part),
        nor where nothing can stream it (a CPU stand-in whose peer is gone: prefilled in the step instead, as the
        model's own experts must not run on two threads)."""
        if self._together(chunk):
            return False
        return self._live_peer() is not None or self._long_prefill is not None

    def _start_beside(self, chunk: Chunk):
        """A stream-loaded prompt beside decode: on the peer's device when there is a peer (this device keeps
        decoding at full speed), else on a thread of this process."""
        peer = self._live_peer()
        if peer is not None and chunk.streamed and chunk.start == 0:
            from hybrid.parallel.peer import PeerPrefill

            return PeerPrefill.start(peer, chunk, self.cache, self._knobs())
        return _Beside.start(self, chunk)

    def _knobs(self) -> "Knobs":
        from hybrid.parallel.peer import Knobs

        p = self.plan
        return Knobs(ring_len=p.ring_len, group=p.slp_group_experts, chunk_tokens=p.slp_chunk_tokens, ep=p.prefill_ep,
                     budget_gb=self._peer.budget_gb if self._peer is not None else None)

    def _prefill_range(self, prompt: list[int], start: int, end: int, slot: int, streamed: bool,
                       cancelled: Optional[threading.Event] = None, **stream) -> tuple[torch.Tensor, list]:
        """prompt[start:end] into `slot` (the positions before it already there): the last token's logits, and the
        statistics of each stream-loading pass it took (one per SLP chunk). `cancelled`: set, no further chunk
        starts (the logits are then None)."""
        if not streamed or self._long_prefill is None:  # nothing to stream with (a CPU whose peer is gone)
            return self._forward(prompt[start:end], start, slot), []
        pipes, step = [], self.plan.slp_chunk_tokens or (end - start)
        for at in range(start, end, step):
            if cancelled is not None and cancelled.is_set():
                return None, pipes
            stop = min(end, at + step)
            with self._long_prefill(stop - at, cancel=cancelled, **stream) as pipe:
                logits = self._forward(prompt[at:stop], at, slot, pipe.experts)
            pipes.append(pipe.stats())  # not the pipeline: its ring and buffers go back before the next chunk
        return logits, pipes

    def _forward(self, tokens: list[int], start: int, slot: int, experts=None) -> torch.Tensor:
        """Prefill of tokens at positions start.. into `slot` (`experts`: a stream-loading prefill's routed
        experts, by layer): the last token's logits."""
        dev, end = self.device, start + len(tokens)
        logits = self.model(torch.tensor([tokens], device=dev), torch.arange(start, end, device=dev)[None],
                            self.cache, torch.tensor([slot], device=dev), last_only=True, kv_len=end,
                            experts=experts)
        return logits[0, -1]

    def _collect_beside(self, changed: dict[int, Request], wait: bool) -> None:
        """The prefill beside decode, once it has ended: its request decodes from the next step (or fails, or
        finishes as aborted). `wait`: nothing else to do in this step, so wait a moment for it."""
        b = self._beside
        if b is None or not b.done.wait(0.01 if wait else 0):
            return
        self._beside = None
        req = b.chunk.request
        b.thread.join()
        if b.side is not None:  # its KV writes and logits before anything the engine's stream runs next
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(b.side)
            if b.logits is not None:
                b.logits.record_stream(main)  # made on the side stream, read on this one
        if b.cancelled.is_set():
            self._finish(req, FinishReason.abort, changed)
        elif b.error is not None:
            self._fail([req], b.error, changed)
        else:
            req.state = State.prefilling
            self._prefilled(b.chunk, b.logits, changed)

    def _size_pool(self, changed: dict[int, Request]) -> None:
        """The native kernels' threads for this step's CPU work (decode_threads). Called from the engine's thread
        between its jobs (a step launched ahead is collected first); the prefill beside decode runs none of its
        own on the pool. With plan.cores_back_in_rests, a step begun while that prefill rests (its duty cycle)
        takes its cores too, the rest held until the step is done (`_step` releases it)."""
        if self.plan.prefill_beside_cores:
            beside = self._beside is not None and not (self.plan.cores_back_in_rests and self._throttle.hold())
            want = decode_threads(self.plan, beside)
            if thread_pool.threads() != want:
                self._drain_ahead(changed)
                thread_pool.set_threads(want)

    def _decode_step(self, live: list[Request], changed: dict[int, Request]) -> None:
        groups = micro_batches(live) if self.plan.dual_batch else [live]
        capture = self._beside is None  # no graph capture while another thread uses the GPU
        if len(groups) == 2 and self.plan.dual_stagger and hasattr(self._decode, "launch"):
            live = self._staggered(groups, changed, capture)
            if not live:
                return
            groups = micro_batches(live)
        try:
            parts = [self._decode_inputs(g) for g in groups]
            dual = getattr(self._decode, "dual", None)
            if len(parts) == 2 and dual is not None:  # overlapped: one's GPU work beside the other's CPU experts
                outs = dual(parts, capture=capture)
            else:  # eager decode and the CPU: the micro-batches in turn
                outs = [self._decode(*part, capture=capture) for part in parts]
            logits = torch.cat(outs) if len(outs) > 1 else outs[0]
        except Exception as e:  # the batch's requests fail together; the engine goes on
            self._fail(live, e, changed)
            return
        self._sampled(live, logits, changed)

    def _sampled(self, reqs: list[Request], logits: torch.Tensor, changed: dict[int, Request]) -> None:
        """Each request's token from its row of the step's logits."""
        try:
            tokens = choose(logits, [self._samplers[r.id] for r in reqs])
        except Exception as e:
            self._fail(reqs, e, changed)
            return
        for req, token in zip(reqs, tokens):
            if isinstance(token, Exception):
                self._fail([req], token, changed)
            else:
                self._append(req, token, changed)

    def _staggered(self, groups: list[list[Request]], changed: dict[int, Request], capture: bool) -> list[Request]:
        """Dual-batch decode with the micro-batches half a step apart (policy.decode.dual_stagger): the step of the
        micro-batch launched ahead (in the last step) is already running; the other's is launched now; the first is
        collected and sampled and its next step launched at once, so that its GPU work (the layers before its first
        CPU experts and after its last) runs while the CPU computes the other's routed experts: the CPU does not
        wait for a step to start or end. Then the other is collected. Returns the requests still to decode this
        step the usual way (where a shape's graph is not there yet): none, or the micro-batch not launched."""
        first, self._ahead = self._ahead, None
        dec = self._decode
        if first is None:  # both launched now: the first micro-batch's step first
            try:
                parts = [self._decode_inputs(g) for g in groups]
                if not all(dec.prepare(i, part, capture) for i, part in enumerate(parts)):
                    return [r for g in groups for r in g]
            except Exception as e:  # nothing runs yet: the step's requests fail together
                self._fail([r for g in groups for r in g], e, changed)
                return []
            first = self._launch(0, groups[0], parts[0], changed)
            if first is None:
                return groups[1]
        other = groups[1] if first.ids == [r.id for r in groups[0]] else groups[0]
        second = self._launch(1 - first.lane, other, None, changed)
        if second is None:  # not captured (the usual way then), or failed: the first one's step stands
            self._collect(first, changed)
            return [r for r in other if not r.finished]
        self._collect(first, changed)
        nxt = [r for r in first.reqs if not r.finished]
        if nxt and not self._inbox_busy():
            self._ahead = self._launch(first.lane, nxt, None, changed)
        self._collect(second, changed)
        return []

    def _launch(self, lane: int, reqs: list[Request], part, changed: dict[int, Request]) -> Optional["_Ahead"]:
        """The micro-batch's step launched on `lane` (part: its inputs, made here if None); None where its graph is
        not captured, or where the launch failed (its requests then fail)."""
        try:
            handle = self._decode.launch(lane, part or self._decode_inputs(reqs))
        except Exception as e:
            self._fail(reqs, e, changed)
            return None
        return None if handle is None else _Ahead(reqs, lane, handle)

    def _collect(self, a: "_Ahead", changed: dict[int, Request]) -> None:
        """A launched micro-batch's step: its tokens sampled and appended."""
        try:
            logits = self._decode.collect(a.handle)
        except Exception as e:
            self._fail(a.reqs, e, changed)
            return
        self._sampled(a.reqs, logits, changed)

    def _inbox_busy(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts)

    def _drain_ahead(self, changed: dict[int, Request], keep: Optional[list[list[Request]]] = None) -> None:
        """The micro-batch step launched ahead, collected now — unless `keep` (this step's micro-batches) holds its
        requests as one of them, so that the staggering goes on. Its requests have had this step's token."""
        a = self._ahead
        if a is None or (keep is not None and len(keep) == 2 and a.ids in ([r.id for r in g] for g in keep)):
            return
        self._ahead = None
        self._collect(a, changed)
        self._given.update(a.ids)

    def _drain_between_steps(self) -> None:
        """The step launched ahead collected outside a step; its requests' progress goes out with the next step."""
        with on(self.stream):
            self._drain_ahead(self._held)

    def _decode_inputs(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A decode step's (tokens_B1, pos_B1, slots_B, kv_len) for these requests: each one's last token at its
        position."""
        positions = [r.position - 1 for r in reqs]
        # one host-to-device copy for the three (each copy may wait behind a prefill's expert copies beside decode)
        both = torch.tensor([[r.output[-1], p, r.slot] for r, p in zip(reqs, positions)], device=self.device)
        return both[:, 0:1].contiguous(), both[:, 1:2].contiguous(), both[:, 2].contiguous(), max(positions) + 1

    def _eager_decode(self, tokens_B1, pos_B1, slots_B, kv_len: int, capture: bool = True) -> torch.Tensor:
        return self.model(tokens_B1, pos_B1, self.cache, slots_B, kv_len=kv_len)[:, -1]

    # -- probes: benchmarks and warm-up, outside the scheduler ------------------------------------------------
    def prefill(self, prompt_ids: Sequence[int], slot: int = 0, streamed: Optional[bool] = None,
                **stream) -> tuple[torch.Tensor, list]:
        """Prefills prompt_ids into KV slot `slot` (no request may hold it) and returns the last token's logits and
        the statistics of each stream-loading pass (dicts: expert_loop_s, expert_loop_cpu_s, group_sizes). streamed: None = as the scheduler would (longer
        than policy.prefill.slp_cutoff_tokens where stream-loading applies); `stream` (ring_len, group, gemm)
        replaces the plan's for this call."""
        prompt = list(prompt_ids)
        self._drain_between_steps()  # the layers' ops are free
        if streamed is None:
            streamed = self._long_prefill is not None and len(prompt) > self.plan.slp_cutoff_tokens
        if streamed and self._long_prefill is None:
            raise RuntimeError("stream-loading prefill needs a GPU and policy.cpu.moe_backend=native")
        if any(r.slot == slot for r in self.scheduler.running):
            raise RuntimeError(f"KV slot {slot} is held by a request")
        return self._prefill_range(prompt, 0, len(prompt), slot, streamed, **stream)

    def decoder(self, mode: Optional[str] = None) -> DecodeFn:
        """The decode step (tokens_B1, pos_B1, slots_B, kv_len) -> logits_BV: eager for `off`, else under CUDA
        graphs in that mode (hostfn | segments; captured on first use); None = the plan's."""
        mode = mode or self.plan.cuda_graphs
        if mode == "off":
            return self._eager_decode
        if mode not in self._decoders:
            from hybrid.engine.cuda_graphs import GraphedDecode  # GPU only

            self._decoders[mode] = GraphedDecode(self.model, self.cache, self.parts["staging"], mode,
                                                 self.plan.max_batch, self.plan.cpu_join)
        return self._decoders[mode]

    # -- tokens, text, endings --------------------------------------------------------------------------------
    def _append(self, req: Request, token: int, changed: dict[int, Request]) -> None:
        req.output.append(token)
        if req.params.logprobs is not None:
            req.logprobs.append(self._samplers[req.id].last)
        req.token_times.append(time.perf_counter())
        changed[req.id] = req
        p = req.params
        stop_token = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.output[:-1] if stop_token else req.output)
            cut = _first_stop(req.text, p.stop, max(0, req.shown - max(map(len, p.stop), default=0)))
            if cut is not None:
                req.text = req.text[:cut]
                return self._finish(req, FinishReason.stop, changed)
        if stop_token:
            self._finish(req, FinishReason.stop, changed)
        elif len(req.output) >= p.max_tokens:
            self._finish(req, FinishReason.length, changed)

    def _finish(self, req: Request, reason: FinishReason, changed: dict[int, Request], error: str = "") -> None:
        req.finish_reason, req.error = reason, error
        if req.slot >= 0 and req.state is not State.waiting:
            self._clear_slot(req.slot, req.position)
        self.scheduler.finish(req)
        self._samplers.pop(req.id, None)
        changed[req.id] = req

    def _clear_slot(self, slot: int, written: int) -> None:
        """Zeroes what a request wrote into its KV slot: batch mates' decode steps read a slot past its own length
        (masked, but 0 x NaN is NaN), so nothing non-finite may stay behind for the next occupant."""
        for layer in self.cache.layers:
            layer.kv[slot, :written].zero_()
            layer.pe[slot, :written].zero_()

    def _fail(self, reqs: Iterable[Request], e: Exception, changed: dict[int, Request]) -> None:
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        msg = f"{type(e).__name__}: {e}" + (f" ({where.filename}:{where.lineno})" if where else "")
        for req in reqs:
            self._finish(req, FinishReason.error, changed, msg)

    def _output(self, req: Request) -> RequestOutput:
        """What is new since the last output: tokens, and text that can no longer change (no partial UTF-8
        character, nothing that may be the start of a stop string) unless the request ended."""
        new_tokens = req.output[req.tokens_out:]
        req.tokens_out = len(req.output)
        text = req.text
        if not req.finished:
            text = text.rstrip("\ufffd")
            hold = _stop_prefix(text, req.params.stop)
            text = text[:len(text) - hold]
        delta = text[req.shown:] if len(text) > req.shown else ""
        req.shown = max(req.shown, len(text))
        if req.finished:
            self._requests.pop(req.id, None)
        logprobs = req.logprobs[len(req.output) - len(new_tokens):] if req.params.logprobs is not None else None
        return RequestOutput(req.id, new_tokens, delta, req.finished, req.finish_reason, req.error,
                             len(req.prompt), len(req.output), logprobs)

    # -- convenience ------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_output: Optional[Callable[[int, RequestOutput], None]] = None) -> list[Completion]:
        """Every prompt as a request (all queued at once), stepped until all finish; on_output(prompt index, output)
        as each step hands back progress (streaming)."""
        many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        for p, sp in zip(prompts, many):  # all or none queued
            self.check([int(t) for t in p], sp)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, many)]
        index = {rid: i for i, rid in enumerate(ids)}
        reqs = {rid: self._requests_soon(rid) for rid in ids}
        while any(not r.finished for r in reqs.values()):
            for out in self.step():
                if on_output is not None and out.id in index:
                    on_output(index[out.id], out)
        return [Completion(rid, list(r.prompt), list(r.output), r.text, r.finish_reason, r.error, r.ttft_s, r.tpot_s,
                           list(r.token_times)) for rid, r in reqs.items()]

    def _requests_soon(self, rid: int) -> Request:
        with self._lock:
            for req in self._inbox:
                if req.id == rid:
                    return req
        return self._requests[rid]


@dataclass
class _Ahead:
    """A micro-batch's decode step launched and not yet collected (staggered dual-batch decode): its requests, its
    lane (0 or 1) and the decoder's handle."""
    reqs: list[Request]
    lane: int
    handle: object

    @property
    def ids(self) -> list[int]:
        return [r.id for r in self.reqs]


@dataclass
class _Beside:
    """A prompt's stream-loading prefill on a thread of its own (and its own CUDA stream), while the engine's
    thread goes on stepping decode: the weights stay one copy in host memory — decode's CPU experts read them there,
    the prefill streams them through the GPU."""
    chunk: Chunk
    thread: threading.Thread
    done: threading.Event
    cancelled: threading.Event  # aborted: the prefill stops at its next stream-loading chunk
    side: Optional[torch.cuda.Stream]
    logits: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None

    @classmethod
    def start(cls, engine: "Engine", chunk: Chunk) -> "_Beside":
        req = chunk.request
        side = engine._side.stream()
        if side is not None:  # what the engine's stream wrote (e.g. a cleared slot) before the prefill reads
            side.wait_stream(torch.cuda.current_stream(engine.device))
        b = cls(chunk, threading.Thread(target=lambda: b._run(engine), name=f"prefill-{req.id}", daemon=True),
                threading.Event(), threading.Event(), side)
        b.thread.start()
        return b

    def cancel(self) -> None:
        self.cancelled.set()

    def _run(self, engine: "Engine") -> None:
        c = self.chunk
        try:
            with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
                self.logits = engine._prefill_range(c.request.prompt, c.start, c.end, c.request.slot, True,
                                                    throttle=engine._throttle, cancelled=self.cancelled)[0]
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, which fails the request
            self.error = e
        finally:
            self.done.set()


def micro_batches(live: list[Request]) -> list[list[Request]]:
    """Dual-batch decode's two micro-batches of a step's decoding requests, in admission order (the first the
    larger by one when odd), so that the concatenated halves are `live` again; one request stays one batch."""
    if len(live) < 2:
        return [live]
    half = (len(live) + 1) // 2
    return [live[:half], live[half:]]


def _first_stop(text: str, stops: tuple[str, ...], since: int) -> Optional[int]:
    """Where the earliest stop string starts in text (searching from `since`), or None."""
    found = [i for i in (text.find(s, since) for s in stops) if i >= 0]
    return min(found) if found else None


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of text that may begin a stop string (held back while streaming)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
