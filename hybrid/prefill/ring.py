"""The expert ring buffer: one preallocated device allocation carved into `ring_len` slots, each holding one
expert's weights (gate, up, down and their scales), reused across layers — no allocation per tensor.

A slot goes: free -> written by the loader -> ON (weights on the device) -> read by the model -> OFF (the model's
work on it has run) -> free again. Every transition is logged, so tests can check that no slot is overwritten
before its OFF event.
"""
from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid.errors import ConfigError


@dataclass(frozen=True)
class Field:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, Field], int]:
    """Byte offsets of one expert's tensors in a slot, and the slot size (256-aligned). Weights start 256-aligned;
    FP32 block scales only 4-aligned, so that gate's and up's scales lie back to back like their weights."""
    fields, offset = {}, 0
    for name, t in tensors:
        align = 4 if t.dtype == torch.float32 else 256
        offset = -(-offset // align) * align
        fields[name] = Field(offset, tuple(t.shape), t.dtype)
        offset += t.nbytes
    return fields, -(-offset // 256) * 256


class Ring:
    def __init__(self, ring_len: int, fields: dict[str, Field], slot_bytes: int, device: torch.device,
                 budget_bytes: float):
        if ring_len < 1:
            raise ConfigError(f"policy.ring_len must be >= 1, got {ring_len}")
        if ring_len * slot_bytes > budget_bytes:
            raise ConfigError(
                f"the stream-loading ring needs policy.ring_len={ring_len} x {slot_bytes / 1e6:.1f} MB = "
                f"{ring_len * slot_bytes / 1e9:.2f} GB, over the {budget_bytes / 1e9:.2f} GB the GPU budget leaves: "
                "lower policy.ring_len or raise policy.gpu_memory_budget_gb")
        self.fields, self.slot_bytes, self.ring_len = fields, slot_bytes, ring_len
        self.memory = torch.empty(ring_len * slot_bytes, dtype=torch.uint8, device=device)
        self.free: "queue.Queue[int]" = queue.Queue()
        for s in range(ring_len):
            self.free.put(s)
        self.log: list[tuple[str, int, object]] = []  # (event, slot, tag): write / off
        self._lock = threading.Lock()

    def view(self, slot: int, name: str, shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """The tensor `name` in `slot`; with `shape`, that many elements from its start (spanning the next field
        when the two are contiguous)."""
        f = self.fields[name]
        shape = shape or f.shape
        start = slot * self.slot_bytes + f.offset
        nbytes = math.prod(shape) * f.dtype.itemsize
        return self.memory[start:start + nbytes].view(f.dtype).view(shape)

    def slot_memory(self, slot: int) -> torch.Tensor:
        return self.memory[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def acquire(self, tag, stop: Optional[threading.Event] = None) -> Optional[int]:
        """A free slot for the loader to write (None once `stop` is set while waiting)."""
        while True:
            try:
                slot = self.free.get(timeout=0.05)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    return None
                continue
            self._note("write", slot, tag)
            return slot

    def release(self, slot: int, tag) -> None:
        self._note("off", slot, tag)
        self.free.put(slot)

    def _note(self, event: str, slot: int, tag) -> None:
        with self._lock:
            self.log.append((event, slot, tag))


def overwritten_before_off(log: list[tuple[str, int, object]]) -> list[tuple[int, object]]:
    """Slots written again while their previous occupant had not reached OFF (empty when the ring is sound)."""
    busy: dict[int, object] = {}
    bad = []
    for event, slot, tag in log:
        if event == "write":
            if slot in busy:
                bad.append((slot, busy[slot]))
            busy[slot] = tag
        else:
            busy.pop(slot, None)
    return bad


DEEP_RING = 128  # slots: deep enough to stream through a layer's attention at 16K tokens (H200: ~0.8 ms per expert copy)

DEEP_UP_TO, PING_PONG_FROM = 16_384, 65_536  # prompt tokens: a deep ring up to here, ping-pong from there


def auto_ring_len(tokens: int, n_experts: int, slot_bytes: int, budget_bytes: float) -> int:
    """Deep for short, transfer-bound prompts; ping-pong (2) for very long, compute-bound ones, whose activations
    need the memory; always within the budget and never more than a layer's experts."""
    fits = max(1, int(budget_bytes // slot_bytes))
    deep = min(DEEP_RING, n_experts)
    if tokens >= PING_PONG_FROM:
        want = 2
    elif tokens <= DEEP_UP_TO:
        want = deep
    else:  # shrink geometrically from `deep` to 2
        frac = math.log(tokens / DEEP_UP_TO) / math.log(PING_PONG_FROM / DEEP_UP_TO)
        want = round(deep * (2 / deep) ** frac)
    return max(1, min(want, fits, n_experts))
