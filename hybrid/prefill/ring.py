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

SCALES = ("weight_scale_inv", "weight_scale")  # FP8's block scales, INT4's group scales


@dataclass(frozen=True)
class Field:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, Field], int]:
    """Byte offsets of one expert's tensors in a slot, and the slot size (256-aligned). Weights (FP8, BF16, packed
    INT4 words) start 256-aligned; scales (FP8's FP32 block scales, INT4's BF16 group scales) only at their element
    size, so that gate's and up's scales lie back to back like their weights."""
    fields, offset = {}, 0
    for name, t in tensors:
        align = t.element_size() if name.endswith(SCALES) else 256
        offset = -(-offset // align) * align
        fields[name] = Field(offset, tuple(t.shape), t.dtype)
        offset += t.nbytes
    return fields, -(-offset // 256) * 256


class Ring:
    def __init__(self, ring_len: int, fields: dict[str, Field], slot_bytes: int, device: torch.device,
                 budget_bytes: float):
        if ring_len < 1:
            raise ConfigError(f"ring_len (policy.prefill.ring_len) must be >= 1, got {ring_len}")
        if ring_len * slot_bytes > budget_bytes:
            raise ConfigError(
                f"the stream-loading ring needs policy.prefill.ring_len={ring_len} x {slot_bytes / 1e6:.1f} MB = "
                f"{ring_len * slot_bytes / 1e9:.2f} GB, over the {budget_bytes / 1e9:.2f} GB the GPU budget leaves: "
                "lower policy.prefill.ring_len or raise policy.gpu.memory_budget_gb")
        self.fields, self.slot_bytes, self.ring_len, self.device = fields, slot_bytes, ring_len, device
        self.memory = torch.empty(ring_len * slot_bytes, dtype=torch.uint8, device=device)
        self._views: dict = {}  # (slot, name, shape) -> tensor: made once, looked up per expert after that
        self.reset()

    def reset(self) -> None:
        """Every slot free, the log empty (a ring reused by the next prefill)."""
        self.free: "queue.Queue[int]" = queue.Queue()
        for s in range(self.ring_len):
            self.free.put(s)
        self.log: list[tuple[str, int, object]] = []  # (event, slot, tag): write / off
        self._lock = threading.Lock()

    def fits(self, ring_len: int, fields: dict[str, Field], slot_bytes: int, device: torch.device) -> bool:
        return (ring_len, fields, slot_bytes, torch.device(device)) == (
            self.ring_len, self.fields, self.slot_bytes, torch.device(self.device))

    def view(self, slot: int, name: str, shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """The tensor `name` in `slot`; with `shape`, that many elements from its start (spanning the next field
        when the two are contiguous)."""
        key = (slot, name, shape)
        v = self._views.get(key)
        if v is None:
            f = self.fields[name]
            shape = shape or f.shape
            start = slot * self.slot_bytes + f.offset
            nbytes = math.prod(shape) * f.dtype.itemsize
            v = self._views[key] = self.memory[start:start + nbytes].view(f.dtype).view(shape)
        return v

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


def expert_tensors(expert: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """One expert's tensors in slot order: gate and up weights side by side (one GEMM can read them as one [2I, D]
    matrix), then their scales, then down's weight and scale. FP8 or BF16: `weight` (and `weight_scale_inv`); INT4:
    `weight_packed` and `weight_scale` (`weight_shape` stays out: the layer knows its shape)."""
    out = []
    for weight, scale in (("weight", SCALES[0]), ("weight_packed", SCALES[1])):
        names = [f"gate_proj.{weight}", f"up_proj.{weight}", f"gate_proj.{scale}", f"up_proj.{scale}",
                 f"down_proj.{weight}", f"down_proj.{scale}"]
        for name in names:
            proj, attr = name.split(".")
            t = getattr(getattr(expert, proj), attr, None)
            if t is not None:
                out.append((name, t))
    return out
