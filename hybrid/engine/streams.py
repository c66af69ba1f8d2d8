"""Where the engine's own GPU work runs: decode (and the step's short prefill chunks) on a stream of the highest
priority the device offers, so that when a stream-loading prefill runs beside it (policy.prefill.beside_decode),
the GPU's block scheduler hands free SMs to decode's kernels before the prefill's queued blocks. Without it, a
decode step waits behind the prefill's large kernels (attention over 32K positions): single steps of 0.16-0.43 s
were measured on the H200 test machine with both on streams of the default priority (docs/perf-notes.md).

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
