"""Pacing of the stream-loading prefill's expert copies, so that a prefill running beside decode leaves decode's
CPU experts their share of the host's memory bandwidth (the copies read the same DRAM the CPU experts read).

    throttle = Throttle()
    throttle.set_limits(20e9, 16 << 20)  # from any thread: at most 20 GB/s from the next copy on, and at most 16 MB
                                         # of copies queued on the device at a time; None = no limit
    throttle.wait(slot_bytes)            # the loader, before each copy: sleeps as long as the rate asks

The queue bound is the loader's to keep (hybrid/prefill/slp.py): decode's own small host->device copies go through
the same copy engine as the stream's, behind whatever the stream has queued.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class Throttle:
    """At most `rate` bytes per second over the copies announced to `wait` (None: no pacing), and at most
    `queued_bytes` of copies queued on the device at a time (None: no bound). Each copy may start once the ones
    before it would have taken their bytes at that rate; a copy's own time is not waited for here."""

    def __init__(self, rate: Optional[float] = None, queued_bytes: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self._rate: Optional[float] = None
        self._queued: Optional[int] = None
        self._next = 0.0  # when the next copy may start
        self.set_limits(rate, queued_bytes)

    @property
    def rate(self) -> Optional[float]:
        return self._rate

    @property
    def queued_bytes(self) -> Optional[int]:
        return self._queued

    @property
    def limited(self) -> bool:
        """Whether either limit is set (the loader then copies in pieces)."""
        return self._rate is not None or self._queued is not None

    def set_limits(self, bytes_per_s: Optional[float], queued_bytes: Optional[int] = None) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"a copy rate must be > 0 bytes/s (or None for no pacing), got {bytes_per_s}")
        if queued_bytes is not None and not queued_bytes > 0:
            raise ValueError(f"a queue bound must be > 0 bytes (or None for none), got {queued_bytes}")
        with self._lock:
            self._rate, self._queued = bytes_per_s, queued_bytes

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
