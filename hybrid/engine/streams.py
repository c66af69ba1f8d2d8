"""Where the engine's own GPU work runs: decode (and the step's short prefill chunks) on a stream of the highest
priority the device offers, so that when a stream-loading prefill runs beside it (policy.prefill.beside_decode),
the GPU's block scheduler hands free SMs to decode's kernels before the prefill's queued blocks (a 32K prompt's
attention kernels are large). On the H200 test machine (docs/perf/journal.md, F1 against G1), the median decode step
while a 32K prompt streamed beside it went from 23.6x to 2.2x its step before without a cap, and from 1.18x to
1.09x at a 20 GB/s cap; single steps of ~0.23 s remained either way (not the block scheduler's doing).

The step's stream is entered from the caller's and left to it in order (`on`): work the caller queued before a
step comes before the step's, and the step's before whatever the caller queues after it.

Priority orders the blocks waiting for SMs; it does not take SMs from a kernel that holds them. A prompt's prefill
fills every SM with large GEMMs and attention calls, so each of decode's small kernels still waits for blocks of
them to finish (H200 test machine: a 12-GEMM step of 0.43 ms alone took 8.2 ms beside back-to-back 8192^3 GEMMs on
the highest-priority stream). `PrefillSide` puts the prefill's kernels in a CUDA green context of fewer SMs
(policy.prefill.beside_sms left to decode): the same step took 1.9 ms with 16 SMs left, the GEMMs 10 % slower."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from hybrid.errors import ConfigError

HIGHEST = -(2 ** 16)  # torch maps a priority past the device's range to its highest


def decode_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """A new stream of the device's highest priority; None off CUDA devices."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=HIGHEST)


def green_contexts() -> bool:
    try:
        from torch.cuda import green_contexts as gc
    except ImportError:
        return False
    return bool(getattr(gc, "SUPPORTED", False)) and hasattr(gc.GreenContext, "Stream")


# Green contexts by (device, SMs), kept for the process's life: the caching allocator records events on the streams
# that used a block when it is freed, so a context destroyed before the last such tensor (an engine rebuilt) fails
# that tensor's destructor.
_GREEN: dict = {}


class PrefillSide:
    """Where a prompt prefilled beside decode computes: a new stream per prompt, in a green context of `sms` SMs
    when set; None off CUDA devices."""

    def __init__(self, device: torch.device, sms: Optional[int]):
        self.device, self._ctx = device, None
        if sms and device.type == "cuda":
            from torch.cuda.green_contexts import GreenContext

            key = (device.index or 0, sms)
            if key not in _GREEN:
                try:
                    _GREEN[key] = GreenContext.create(num_sms=sms, device_id=key[0])
                except RuntimeError as e:  # a driver without them (or an SM count it will not split off)
                    raise ConfigError(f"the prefill beside decode on {sms} SMs (policy.prefill.beside_sms): the CUDA "
                                      f"driver refused the green context ({e}); set policy.prefill.beside_sms=0") from e
            self._ctx = _GREEN[key]

    def stream(self) -> Optional[torch.cuda.Stream]:
        if self.device.type != "cuda":
            return None
        return self._ctx.Stream() if self._ctx is not None else torch.cuda.Stream(self.device)


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
