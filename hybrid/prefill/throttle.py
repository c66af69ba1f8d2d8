"""Limits on a stream-loading prefill running beside decode, so that decode keeps its TPOT while a long prompt is
prefilled: the stream's copies read the same DRAM as decode's CPU experts, and the prefill's kernels and its threads'
share of the interpreter lock and the host's cores compete with decode's steps.

    throttle = Throttle()
    throttle.set_limits(20e9, 16 << 20, 0.5)  # from any thread: at most 20 GB/s from the next copy on, at most
                                              # 16 MB of copies queued on the device at a time, and the prefill
                                              # at work at most half the time; None = no limit
    throttle.wait(slot_bytes)                 # the loader, before each copy: sleeps as long as the rate asks
                                              # (and through the prefill's rests)
    throttle.breathe()                        # the prefill's model thread between pieces of work: rests once
                                              # it has had its share of the time

The queue bound is the loader's to keep (hybrid/prefill/pipeline.py): decode's own small host->device copies go through
the same copy engine as the stream's, behind whatever the stream has queued.

The duty cycle limits the whole prefill, not only its copies: after `duty * DUTY_PERIOD_S` at work the model thread
rests `(1 - duty) / duty` times as long as it worked (so work that overran the period is paid for in full), and the
loader starts no copy while it rests. Decode may take the prefill's cores for a step begun during a rest
(`hold()`): the rest then lasts until `release()`, so the prefill never wakes on cores a step has taken. A rate
cap alone paces the copies in pieces and wakes the loader more often; on the H200 test machine it did not lower
decode's TPOT during the prefill (docs/perf/journal.md).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

DUTY_PERIOD_S = 0.05  # a duty cycle's period: the prefill works duty x this, then rests (a decode step is 15-30 ms)
_REST_SLICE_S = 0.01  # a rest is slept in slices this long at most, to see a stop or new limits


class Throttle:
    """At most `rate` bytes per second over the copies announced to `wait` (None: no pacing), at most
    `queued_bytes` of copies queued on the device at a time (None: no bound), and the prefill at work at most
    `duty` of the time (None: always). Each copy may start once the ones before it would have taken their bytes at
    that rate, and not during a rest; a copy's own time is not waited for here."""

    def __init__(self, rate: Optional[float] = None, queued_bytes: Optional[int] = None,
                 duty: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 period_s: float = DUTY_PERIOD_S):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._clock, self._period = clock, period_s
        self._rate: Optional[float] = None
        self._queued: Optional[int] = None
        self._duty: Optional[float] = None
        self._next = 0.0  # when the next copy may start
        self._working_since: Optional[float] = None  # when the prefill's current spell of work began
        self._rest_until = 0.0  # the prefill rests until then
        self._held = False  # and on until release() while held
        self.set_limits(rate, queued_bytes, duty)

    @property
    def rate(self) -> Optional[float]:
        return self._rate

    @property
    def queued_bytes(self) -> Optional[int]:
        return self._queued

    @property
    def duty(self) -> Optional[float]:
        return self._duty

    @property
    def limited(self) -> bool:
        """Whether a copy limit is set (the loader then copies in pieces)."""
        return self._rate is not None or self._queued is not None

    def set_limits(self, bytes_per_s: Optional[float], queued_bytes: Optional[int] = None,
                   duty: Optional[float] = None) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"a copy rate must be > 0 bytes/s (or None for no pacing), got {bytes_per_s}")
        if queued_bytes is not None and not queued_bytes > 0:
            raise ValueError(f"a queue bound must be > 0 bytes (or None for none), got {queued_bytes}")
        if duty is not None and not 0 < duty <= 1:
            raise ValueError(f"a duty cycle is a share of the time in (0, 1] (or None for none), got {duty}")
        duty = None if duty == 1 else duty
        with self._changed:
            self._rate, self._queued = bytes_per_s, queued_bytes
            if duty != self._duty:  # a new share starts a new spell; no duty ends a rest now
                self._duty, self._working_since = duty, None
                if duty is None:
                    self._rest_until, self._held = 0.0, False
                self._changed.notify_all()

    def delay(self, nbytes: int) -> float:
        """Seconds the copy of `nbytes` announced now has to wait (its slot in the pace taken): the pace's, and
        what is left of the prefill's rest."""
        with self._lock:
            now = self._clock()
            start = max(now, self._rest_until)
            if self._rate is None:
                self._next = now
            else:
                start = max(start, self._next)
                self._next = start + nbytes / self._rate
            return start - now

    def wait(self, nbytes: int, stop: Optional[threading.Event] = None) -> float:
        """Sleeps until the copy of `nbytes` may start (at once without a rate or a rest), returning early once
        `stop` is set; returns the seconds it was to wait."""
        d = self.delay(nbytes)
        if d > 0 and self._rate is not None:
            if stop is not None:
                stop.wait(d)
            else:
                time.sleep(d)
        self._rest(stop)  # what is left of a rest (held or not): ends early when the duty cycle is lifted
        return d

    def begin(self) -> None:
        """A prefill starts work now (its first spell is counted from here)."""
        with self._lock:
            self._working_since = self._clock() if self._duty is not None else None

    def rest_for(self) -> float:
        """The seconds the prefill is to rest now (0: work on), the rest begun: after `duty` of a period at work,
        (1 - duty) / duty times the spell it worked."""
        with self._lock:
            now = self._clock()
            if self._duty is None:
                self._working_since = None
                return 0.0
            if self._working_since is None:
                self._working_since = now
            worked = now - self._working_since
            if worked < self._duty * self._period:
                return 0.0
            rest = worked * (1 - self._duty) / self._duty
            self._rest_until, self._working_since = now + rest, None
            return rest

    def breathe(self, stop: Optional[threading.Event] = None) -> float:
        """The prefill's model thread between pieces of work: rests if its share of the time is used up (until
        the rest ends, the duty cycle is lifted or `stop` is set); returns the seconds it was to rest."""
        rest = self.rest_for()
        if rest > 0:
            self._rest(stop)
            with self._lock:
                if self._duty is not None:
                    self._working_since = self._clock()
        return rest

    def hold(self) -> bool:
        """Whether the prefill rests now; if so its rest lasts until `release()` (decode takes its cores for a
        step). Idempotent; False without a duty cycle or outside a rest."""
        with self._lock:
            self._held = self._held or (self._duty is not None and self._clock() < self._rest_until)
            return self._held

    def release(self) -> None:
        """The rest held by `hold()` ends as it was to (at once if its time is up)."""
        with self._changed:
            if self._held:
                self._held = False
                self._changed.notify_all()

    def _rest(self, stop: Optional[threading.Event]) -> None:
        with self._changed:
            while not (stop is not None and stop.is_set()):
                left = self._rest_until - self._clock()
                if left <= 0 and not self._held:
                    return
                self._changed.wait(min(left, _REST_SLICE_S) if left > 0 else _REST_SLICE_S)
