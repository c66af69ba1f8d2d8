"""The stream-loading prefill's pipeline (hybrid/prefill/slp.py runs it): the routed experts stream through the
ring buffer (hybrid/prefill/ring.py) from pinned host memory, one expert at a time.

Three threads, each with its own CUDA stream on a GPU:
- loader: for every MoE layer, every expert in order: take a free slot, copy the expert in, record ON;
- model (the caller): runs the model; at a MoE layer, for each expert: wait for ON, compute the tokens routed to
  it, record OFF. With `group` > 1 the experts already on the device when the model gets to them (a deep ring
  fills during attention) go together: their weights dequantised into one buffer, two grouped GEMMs, one OFF —
  a handful of host calls per group instead of ~10 per expert (H200 traces: the host's side of the per-expert
  loop, not the GPU, set the pace of long prompts' MoE phase);
- unloader: waits for OFF to have run on the device, then frees the slot.
The attention, router and shared experts are already resident (hybrid placement); only routed experts stream.
On the CPU the same code runs with no streams (CI covers the ordering, events, ring reuse and budget).

Legend: T tokens, D hidden, K experts per token.
"""
from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.prefill.events import PairedEvent
from hybrid.prefill.ring import expert_tensors, layout
from hybrid.prefill.throttle import Throttle
from hybrid.kernels import int4_linear
from hybrid.kernels.fp8_linear import Fp8Gemm, dequantize, stored_linear
from hybrid.model.layers import Int4Linear

if TYPE_CHECKING:
    from hybrid.prefill.slp import StreamLoader

@runtime_checkable
class HostExpertLayer(Protocol):
    """A MoE layer's routed experts as placement leaves them (hybrid/engine/placement.py CpuExperts): the experts'
    host weights, the pinned arena holding them slot by slot (or None), its slot size, the GPU-resident hot experts
    (or None)."""
    host_experts: nn.ModuleList
    arena: Optional[torch.Tensor]
    slot_bytes: int
    hot: Optional[nn.Module]



# A limited copy (a prefill beside decode while requests decode: policy.prefill.stream_cap_gbps, stream_queue_mb)
# goes in pieces of this size: 8 MB take ~0.15 ms at 55 GB/s.
PACED_COPY_BYTES = 8 << 20


class PrefillCancelled(RuntimeError):
    """A stream-loading prefill stopped because it was cancelled (its request aborted)."""


class Pipeline:
    """The loader and unloader threads around a ring, for one prefill over `layers` (their host experts). The ring
    comes from `loader` (a new StreamLoader when none is given) and goes back to it at the end; the streamed
    experts' FP8 weights go through `gemm` (the loader's when None)."""

    def __init__(self, layers: list[HostExpertLayer], device: torch.device, ring_len: int, budget_bytes: float,
                 group: int = 1, loader: Optional["StreamLoader"] = None, gemm: Optional[Fp8Gemm] = None,
                 throttle: Optional[Throttle] = None, cancel: Optional[threading.Event] = None):
        if loader is None:
            from hybrid.prefill.slp import StreamLoader  # the loader's module runs pipelines: imported when used
            loader = StreamLoader()
        self.loader = loader
        self.throttle, self.cancel = throttle, cancel
        self.experts: dict[int, nn.Module] = {}  # layer index -> StreamedExperts, for the model call (streaming)
        self.gemm = gemm if gemm is not None else self.loader.gemm
        self.layers, self.device, self.group = layers, device, max(1, group)
        self.group_sizes: list[int] = []  # experts per step of the model thread, in order
        # the model thread in the expert loops (after each layer's counts arrived): wall seconds, and its own CPU
        # seconds — near the wall time when the host's calls bound the loop; far below it when it waits (copies, GIL)
        self.expert_loop_s = self.expert_loop_cpu_s = 0.0
        self.throttled_s = 0.0  # the loader held back by the throttle's rate (prefill beside decode)
        self.queue_wait_s = 0.0  # ... and waiting for room in the copy queue (its queue bound)
        self.rested_s = 0.0  # the model thread resting under the throttle's duty cycle (beside decode)
        self._queued: "collections.deque" = collections.deque()  # the loader's copies in flight: (bytes, PairedEvent)
        self._queued_bytes = 0
        self._group_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.n_experts = len(layers[0].host_experts)
        first = layers[0].host_experts[0]
        # INT4 experts: their group size, the packed words and group scales (else FP8 or BF16: block, weight, scale)
        self.int4 = first.gate_proj.group if isinstance(first.gate_proj, Int4Linear) else None
        self.block = None if self.int4 else first.gate_proj.block
        self._w, self._s = ("weight_packed", "weight_scale") if self.int4 else ("weight", "weight_scale_inv")
        fields, slot_bytes = layout(expert_tensors(first))
        self.ring = self.loader.take_ring(ring_len, fields, slot_bytes, device, budget_bytes)
        # gate and up read as one [2I, D] matrix when they (and their scales) lie back to back in the slot; FP8's
        # 128-row scale blocks must not straddle the two, INT4's groups run along rows
        self.inter, self.hidden = first.gate_proj.out_features, first.down_proj.out_features
        gate, up = fields[f"gate_proj.{self._w}"], fields[f"up_proj.{self._w}"]
        self.fused = up.offset == gate.offset + getattr(first.gate_proj, self._w).nbytes
        if self.block is not None or self.int4:
            gs, us = fields[f"gate_proj.{self._s}"], fields[f"up_proj.{self._s}"]
            self.fused &= ((self.int4 is not None or self.inter % self.block[0] == 0)
                           and us.offset == gs.offset + getattr(first.gate_proj, self._s).nbytes)
        self.ready: "queue.Queue" = queue.Queue()
        self.done: "queue.Queue" = queue.Queue()
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        cuda = device.type == "cuda"
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        self.counts_host = torch.empty(self.n_experts, dtype=torch.int64, pin_memory=cuda)
        self.threads = [threading.Thread(target=self._guard, args=(f,), daemon=True)
                        for f in (self._load, self._unload)]

    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced to the model thread by take()
            self.error = e
            self.stop.set()

    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _load(self) -> None:
        with self._on(self.streams[0]):
            for li, layer in enumerate(self.layers):
                for e, expert in enumerate(layer.host_experts):
                    slot = self.ring.acquire((li, e), self.stop)
                    if slot is None:
                        return
                    if layer.arena is not None and layer.slot_bytes == self.ring.slot_bytes:  # one copy
                        src = layer.arena[e * layer.slot_bytes:(e + 1) * layer.slot_bytes]
                        dst = self.ring.slot_memory(slot)
                        # limited (beside decode, while requests decode): in pieces, each waiting its turn and for
                        # room in the copy queue, so that decode's own small copies never queue behind a whole
                        # expert's (44 MB: 0.8 ms at 55 GB/s), nor behind a ring's worth of them
                        limited = self.throttle is not None and self.throttle.limited
                        piece = PACED_COPY_BYTES if limited else layer.slot_bytes
                        for at in range(0, layer.slot_bytes, piece):
                            end = min(layer.slot_bytes, at + piece)
                            self._pace(end - at)
                            self._room(end - at)
                            dst[at:end].copy_(src[at:end], non_blocking=True)
                            self._queue(end - at)
                    else:
                        self._pace(self.ring.slot_bytes)
                        for name, src in expert_tensors(expert):
                            self.ring.view(slot, name).copy_(src, non_blocking=True)
                    on = PairedEvent(self.device)
                    on.record()
                    self.ready.put((li, e, slot, on))

    def _pace(self, nbytes: int) -> None:
        if self.throttle is not None:
            self.throttled_s += self.throttle.wait(nbytes, self.stop)

    def breathe(self) -> None:
        """The model thread between groups of experts: rests when the throttle's duty cycle says so."""
        if self.throttle is not None:
            self.rested_s += self.throttle.breathe(self.cancel)

    def _bound(self) -> Optional[int]:
        return None if self.throttle is None else self.throttle.queued_bytes

    def _room(self, nbytes: int) -> None:
        """Waits (asleep) for the oldest queued copies to be done until `nbytes` more fit the throttle's queue bound
        (one copy goes whatever its size when none is queued); with no bound, forgets the queue."""
        bound = self._bound()
        if bound is None:
            self._queued.clear()
            self._queued_bytes = 0
            return
        t0 = time.perf_counter()
        while self._queued and self._queued_bytes + nbytes > bound:
            n, done = self._queued.popleft()
            done.synchronize()
            self._queued_bytes -= n
        self.queue_wait_s += time.perf_counter() - t0

    def _queue(self, nbytes: int) -> None:
        """Notes a copy just queued on the loader's stream (when a queue bound is kept)."""
        if self._bound() is not None:
            done = PairedEvent(self.device)  # on the CPU stand-in the copy is done once made
            done.record()
            self._queued.append((nbytes, done))
            self._queued_bytes += nbytes

    def _unload(self) -> None:
        with self._on(self.streams[1]):
            while True:
                item = self.done.get()
                if item is None:
                    return
                slot, off, tag = item
                off.synchronize()
                self.ring.release(slot, tag)

    def take(self, layer: int, expert: int) -> int:
        """The slot holding (layer, expert), once its weights are on the device (stream-ordered)."""
        while True:
            if self.cancel is not None and self.cancel.is_set():
                raise PrefillCancelled("stream-loading prefill: cancelled")
            try:
                li, e, slot, on = self.ready.get(timeout=0.05)
                break
            except queue.Empty:
                if self.error is not None:
                    raise RuntimeError("stream-loading prefill: the loader failed") from self.error
        return self._arrived(layer, expert, li, e, slot, on)

    @staticmethod
    def _arrived(layer: int, expert: int, li: int, e: int, slot: int, on: PairedEvent) -> int:
        if (li, e) != (layer, expert):
            raise RuntimeError(f"stream-loading order broken: expected layer {layer} expert {expert}, got {li}/{e}")
        on.wait_on_stream()
        return slot

    def take_group(self, layer: int, first: int, end: int) -> list[int]:
        """Slots for experts first, first + 1, ... of `layer` (before `end`): the first one waited for as take()
        does, then those whose copies have already landed, up to the group size — never waiting for a copy (a
        posted copy may still be in flight: the group would wait for its last one)."""
        slots = [self.take(layer, first)]
        while len(slots) < self.group and first + len(slots) < end:
            with self.ready.mutex:  # only this thread takes from `ready`: the head stays the head
                head = self.ready.queue[0] if self.ready.queue else None
            if head is None or not head[3].done():
                break
            slots.append(self._arrived(layer, first + len(slots), *self.ready.get_nowait()))
        return slots

    def host_counts(self, counts: torch.Tensor) -> list[int]:
        """Rows per expert, read on the host once the model's stream gets there. On a GPU through pinned memory
        and an event wait: a pageable read (tensor.tolist(), or torch.bincount's own) held up the loader's copies in
        the driver until the GPU caught up (H200 traces at 32K tokens: 100-250 ms without a copy issued)."""
        if self.device.type != "cuda":
            return counts.tolist()
        self.counts_host.copy_(counts, non_blocking=True)
        arrived = torch.cuda.Event(blocking=True)  # the model thread sleeps while the GPU catches up (events.py)
        arrived.record()
        arrived.synchronize()
        return self.counts_host.tolist()

    def give_back(self, slots: list[int], tags: list) -> None:
        """The model is done with these slots once the work enqueued so far has run (one OFF for all)."""
        off = PairedEvent(self.device)
        off.record()
        for slot, tag in zip(slots, tags):
            self.done.put((slot, off, tag))

    def _stored(self, slot: int, proj: str, rows: int = 0):
        """The weight of `proj` in `slot` (INT4: its packed words) and its scales (None for BF16); `rows` reads that
        many output rows from the weight's start (gate and up together)."""
        w = self.ring.view(slot, f"{proj}.{self._w}")
        if rows:
            w = self.ring.view(slot, f"{proj}.{self._w}", (rows, w.shape[1]))
        s = None
        if self.block is not None or self.int4:
            s = self.ring.view(slot, f"{proj}.{self._s}")
            if rows:
                scale_rows = rows if self.int4 else -(-rows // self.block[0])
                s = self.ring.view(slot, f"{proj}.{self._s}", (scale_rows, s.shape[1]))
        return w, s

    def linear(self, slot: int, proj: str, x: torch.Tensor, rows: int = 0, out=None) -> torch.Tensor:
        """x through the projection `proj` of the expert in `slot` (FP8: hybrid/kernels/fp8_linear.py; INT4:
        int4_linear.py, by the same GEMM policy)."""
        w, s = self._stored(slot, proj, rows)
        if self.int4:
            return int4_linear.linear(x, w, s, x.shape[-1], self.int4, self.gemm, out=out)
        return stored_linear(x, w, s, self.block, self.gemm, out=out)

    def _dequantize(self, slot: int, proj: str, out: torch.Tensor, rows: int = 0) -> None:
        w, s = self._stored(slot, proj, rows)
        if self.int4:
            int4_linear.dequantize(w, s, out.shape[1], self.int4, out=out)
        elif self.block is None:
            out.copy_(w)
        else:
            dequantize(w, s, self.block, out=out)

    def grouped(self, slots: list[int], counts: torch.Tensor, live: list[bool], x: torch.Tensor,
                out: torch.Tensor) -> None:
        """The rows x — expert by expert, counts[j] (a device tensor) for slots[j], zero allowed — through the
        experts in `slots`: their weights dequantised to x's dtype into one buffer (`live` ones only), then gate+up
        and down as grouped GEMMs. Raises where torch has no grouped GEMM for this device and dtype."""
        g, i = len(slots), self.inter
        if self._group_weights is None or self._group_weights[0].dtype != x.dtype:
            self._group_weights = (torch.empty(self.group, 2 * i, self.hidden, dtype=x.dtype, device=x.device),
                                   torch.empty(self.group, self.hidden, i, dtype=x.dtype, device=x.device))
        gate_up, down = (w[:g] for w in self._group_weights)
        for j, slot in enumerate(slots):
            if not live[j]:
                continue
            if self.fused:
                self._dequantize(slot, "gate_proj", gate_up[j], rows=2 * i)
            else:
                self._dequantize(slot, "gate_proj", gate_up[j, :i])
                self._dequantize(slot, "up_proj", gate_up[j, i:])
            self._dequantize(slot, "down_proj", down[j])
        ends = counts.cumsum(0).to(torch.int32)  # on the device: no host->device copy behind the loader's
        h = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=ends)
        gate, up = h.split(i, dim=-1)
        out.copy_(torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends))

    def activation(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate(x)) ⊙ up(x): one GEMM over gate and up when they lie back to back in the slot."""
        if self.fused:
            gate, up = self.linear(slot, "gate_proj", x, rows=2 * self.inter).split(self.inter, dim=-1)
        else:
            gate, up = self.linear(slot, "gate_proj", x), self.linear(slot, "up_proj", x)
        return F.silu(gate) * up

    def __enter__(self) -> "Pipeline":
        if self.throttle is not None:
            self.throttle.begin()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.done.put(None)
        for t in self.threads:
            t.join()
        if self.device.type == "cuda":  # the model's last reads of the ring and the loader's last copies have run:
            torch.cuda.current_stream(self.device).synchronize()  # the next prefill may write (the device is not
            for stream in self.streams:  # waited for: decode may run beside)
                stream.synchronize()
        self.loader.keep_ring(self.ring)
        self._group_weights = None  # the group buffer goes back with the prefill

    def stats(self) -> dict:
        """What the prefill's expert loops measured: wall and model-thread CPU seconds, experts per step."""
        return {"expert_loop_s": self.expert_loop_s, "expert_loop_cpu_s": self.expert_loop_cpu_s,
                "group_sizes": list(self.group_sizes),
                "throttled_s": self.throttled_s, "queue_wait_s": self.queue_wait_s, "rested_s": self.rested_s}
