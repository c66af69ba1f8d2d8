"""Where the engine's own GPU work runs: decode (and the step's short prefill chunks) on a stream of the highest
priority the device offers, so that when a stream-loading prefill runs beside it (policy.prefill.beside_decode),
the GPU's block scheduler hands free SMs to decode's kernels before the prefill's queued blocks (a 32K prompt's
attention kernels are large). On the H200 test machine (docs/perf-notes.md, F1 against G1), the median decode step
while a 32K prompt streamed beside it went from 23.6x to 2.2x its step before without a cap, and from 1.18x to
1.09x at a 20 GB/s cap; single steps of ~0.23 s remained either way (not the block scheduler's doing).

The step's stream is entered from the caller's and left to it in order (`on`): work the caller queued before a
step comes before the step's, and the step's before whatever the caller queues after it."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

HIGHEST = -(2 ** 16)  # torch maps a priority past the device's range to its highest


def decode_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """A new stream of the device's highest priority; None off CUDA devices."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=HIGHEST)


@contextlib.contextmanager
def on(stream: Optional[torch.cuda.Stream]) -> Iterator[None]:
    """Runs the block on `stream` (None: where it is), ordered after the caller's stream and before it."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)
