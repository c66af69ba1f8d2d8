"""A CUDA event paired with a host event: the host side says "recorded", the CUDA side says "done on the GPU".
On the CPU stand-in device there is no CUDA side and work is done when it is recorded.

A host that waits for the CUDA side sleeps in the driver (a blocking-sync event) instead of spinning: with one CUDA
context the driver spins by default, and the unloader waits for nearly the whole prefill, which beside decode would
take a core from decode's CPU experts (their workers are pinned one per core)."""
from __future__ import annotations

import threading
from typing import Optional

import torch


class PairedEvent:
    def __init__(self, device: torch.device):
        self.host = threading.Event()
        self.cuda: Optional[torch.cuda.Event] = torch.cuda.Event(blocking=True) if device.type == "cuda" else None

    def record(self) -> None:
        """After enqueuing the work on the current stream."""
        if self.cuda is not None:
            self.cuda.record()
        self.host.set()

    def wait_on_stream(self) -> None:
        """The current stream waits for the recorded work (the host only waits for it to be enqueued)."""
        self.host.wait()
        if self.cuda is not None:
            torch.cuda.current_stream().wait_event(self.cuda)

    def done(self) -> bool:
        """Recorded, and the recorded work has run (never waits)."""
        return self.host.is_set() and (self.cuda is None or self.cuda.query())

    def synchronize(self) -> None:
        """The host waits until the recorded work has run."""
        self.host.wait()
        if self.cuda is not None:
            self.cuda.synchronize()
