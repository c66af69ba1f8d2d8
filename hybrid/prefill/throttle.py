"""Pacing of the stream-loading prefill's expert copies, so that a prefill running beside decode leaves decode's
CPU experts their share of the host's memory bandwidth (the copies read the same DRAM the CPU experts read).

    throttle = Throttle()
    throttle.set_rate(20e9)        # from any thread: at most 20 GB/s from the next copy on; None = unpaced
    throttle.wait(slot_bytes)      # the loader, before each copy: sleeps as long as the rate asks
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class Throttle:
    """At most `rate` bytes per second over the copies announced to `wait` (None: no pacing). Each copy may start
    once the ones before it would have taken their bytes at that rate; a copy's own time is not waited for here."""

    def __init__(self, rate: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self._rate: Optional[float] = None
        self._next = 0.0  # when the next copy may start
        self.set_rate(rate)

    @property
    def rate(self) -> Optional[float]:
        return self._rate

    def set_rate(self, bytes_per_s: Optional[float]) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"a copy rate must be > 0 bytes/s (or None for no pacing), got {bytes_per_s}")
        with self._lock:
            self._rate = bytes_per_s

    def delay(self, nbytes: int) -> float:
        """Seconds the copy of `nbytes` announced now has to wait (its slot in the pace taken)."""
        with self._lock:
            now = self._clock()
            if self._rate is None:
                self._next = now
                return 0.0
            start = max(now, self._next)
            self._next = start + nbytes / self._rate
            return start - now

    def wait(self, nbytes: int, stop: Optional[threading.Event] = None) -> float:
        """Sleeps until the copy of `nbytes` may start (at once without a rate), returning early once `stop` is set;
        returns the seconds it was to wait."""
        d = self.delay(nbytes)
        if d > 0:
            if stop is not None:
                stop.wait(d)
            else:
                time.sleep(d)
        return d
