"""Stream-loading prefill (SLP): the whole prefill runs on the compute device while the routed experts stream
through it from pinned host memory, one expert at a time, through the ring buffer (hybrid/prefill/ring.py).

Three threads, each with its own CUDA stream on a GPU:
- loader: for every MoE layer, every expert in order: take a free slot, copy the expert in, record ON;
- model (the caller): runs the model; at a MoE layer, for each expert: wait for ON, compute the tokens routed to
  it, record OFF;
- unloader: waits for OFF to have run on the device, then frees the slot.
The attention, router and shared experts are already resident (hybrid placement); only routed experts stream.
On the CPU the same code runs with no streams (CI covers the ordering, events, ring reuse and budget).

Legend: T tokens, D hidden, K experts per token.
"""
from __future__ import annotations

import contextlib
import queue
import sys
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.engine.placement import CpuExperts
from hybrid.model.moe import Done, MoE
from hybrid.prefill.events import PairedEvent
from hybrid.prefill.ring import Ring, layout
from hybrid.kernels.fp8_linear import fp8_linear

PROJ = ("gate_proj", "up_proj", "down_proj")
# The loader and unloader need the GIL for a moment per expert while the model thread launches kernels; at
# Python's default 5 ms switch interval a hand-off can wait longer than an expert's copy takes (~0.8 ms).
SWITCH_INTERVAL_S = 2e-4


def expert_tensors(expert: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(f"{p}.{n}", t) for p in PROJ for n, t in getattr(expert, p).named_parameters(recurse=False)]


class Pipeline:
    """The loader and unloader threads around a ring, for one prefill over `layers` (their host experts)."""

    def __init__(self, layers: list[CpuExperts], device: torch.device, ring_len: int, budget_bytes: float):
        self.layers, self.device = layers, device
        self.n_experts = len(layers[0].host_experts)
        self.block = layers[0].host_experts[0].gate_proj.block
        fields, slot_bytes = layout(expert_tensors(layers[0].host_experts[0]))
        self.ring = Ring(ring_len, fields, slot_bytes, device, budget_bytes)
        self.ready: "queue.Queue" = queue.Queue()
        self.done: "queue.Queue" = queue.Queue()
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        cuda = device.type == "cuda"
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
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
                    for name, src in expert_tensors(expert):
                        self.ring.view(slot, name).copy_(src, non_blocking=True)
                    on = PairedEvent(self.device)
                    on.record()
                    self.ready.put((li, e, slot, on))

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
            try:
                li, e, slot, on = self.ready.get(timeout=0.05)
                break
            except queue.Empty:
                if self.error is not None:
                    raise RuntimeError("stream-loading prefill: the loader failed") from self.error
        if (li, e) != (layer, expert):
            raise RuntimeError(f"stream-loading order broken: expected layer {layer} expert {expert}, got {li}/{e}")
        on.wait_on_stream()
        return slot

    def give_back(self, slot: int, tag) -> None:
        off = PairedEvent(self.device)
        off.record()
        self.done.put((slot, off, tag))

    def linear(self, slot: int, proj: str, x: torch.Tensor) -> torch.Tensor:
        """x through the projection `proj` of the expert in `slot` (FP8: hybrid/kernels/fp8_linear.py)."""
        w = self.ring.view(slot, f"{proj}.weight")
        if self.block is None:
            return F.linear(x, w.to(x.dtype))
        return fp8_linear(x, w, self.ring.view(slot, f"{proj}.weight_scale_inv"), self.block)

    def __enter__(self) -> "Pipeline":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.done.put(None)
        for t in self.threads:
            t.join()


class StreamedExperts(nn.Module):
    """RoutedExperts' interface for one MoE layer during SLP: every expert comes through the pipeline in turn."""

    def __init__(self, pipeline: Pipeline, layer: int):
        super().__init__()
        object.__setattr__(self, "pipeline", pipeline)
        self.layer = layer

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> Done:
        p, k = self.pipeline, ids_TK.shape[1]
        # Grouping by expert stays on the device; one device->host read per layer (the counts). No host->device
        # copy here: it would queue behind the loader's expert copies on the copy engine (tens of ms, deep rings).
        flat = ids_TK.flatten()
        order_d = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=p.n_experts).tolist()
        out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
        start = 0
        for e, n in enumerate(counts):
            slot = p.take(self.layer, e)
            if n:
                sel = order_d[start:start + n]
                tok = sel // k
                x_tok = x_TD[tok]
                h = F.silu(p.linear(slot, "gate_proj", x_tok)) * p.linear(slot, "up_proj", x_tok)
                y = p.linear(slot, "down_proj", h).float()
                out_TD.index_add_(0, tok, y * weights_TK.flatten()[sel, None].float())
            p.give_back(slot, (self.layer, e))
            start += n
        return Done(out_TD.to(x_TD.dtype))

    def forward(self, x_TD, weights_TK, ids_TK) -> torch.Tensor:
        return self.start(x_TD, weights_TK, ids_TK).result()


@contextlib.contextmanager
def streaming(model: nn.Module, device: torch.device, ring_len: int, budget_bytes: float) -> Iterator[Pipeline]:
    """Within the block, the model's routed experts stream through the device (the model must have been placed
    with experts on the CPU kernels)."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.experts, CpuExperts)]
    if not moes:
        raise ValueError("stream-loading prefill needs the routed experts placed on the CPU kernels")
    saved = [m.experts for m in moes]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        with Pipeline(saved, device, ring_len, budget_bytes) as pipe:
            try:
                for i, m in enumerate(moes):
                    m.experts = StreamedExperts(pipe, i)
                yield pipe
            finally:
                for m, experts in zip(moes, saved):
                    m.experts = experts
    finally:
        sys.setswitchinterval(switch)
