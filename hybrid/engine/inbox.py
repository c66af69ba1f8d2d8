"""Requests handed to the engine from any thread: new requests and aborts queue here until the engine's thread takes
them at the start of its next step; and what a request must pass to be queued at all."""
from __future__ import annotations

import itertools
import threading
from typing import Optional

from hybrid.engine.requests import Request, RequestError, SamplingParams


class Inbox:
    def __init__(self):
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._new: list[Request] = []
        self._aborts: set[int] = set()

    def add(self, prompt: list[int], params: SamplingParams) -> int:
        with self._lock:
            rid = next(self._ids)
            self._new.append(Request(rid, prompt, params))
        return rid

    def abort(self, rid: int) -> None:
        with self._lock:
            self._aborts.add(rid)

    def take(self) -> tuple[list[Request], set[int]]:
        """The new requests and the aborted ids since the last take."""
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, set()
        return new, aborts

    def busy(self) -> bool:
        """Whether requests come or go at the next take."""
        with self._lock:
            return bool(self._new or self._aborts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._new)

    def find(self, rid: int) -> Optional[Request]:
        with self._lock:
            return next((r for r in self._new if r.id == rid), None)


def check(prompt: list[int], params: SamplingParams, vocab: int, max_context: int, tokenizer: bool) -> None:
    """Why a request cannot be served, as a RequestError (naming the numbers and the knob)."""
    if not prompt:
        raise RequestError("empty prompt")
    bad = [t for t in prompt + list(params.token_ids) if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} out of range 0..{vocab - 1}")
    need = len(prompt) + params.max_tokens
    if need > max_context:
        raise RequestError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {need} exceeds "
                           f"the {max_context} tokens a KV slot holds (policy.kv.max_context)")
    if params.stop and not tokenizer:
        raise RequestError("stop strings need the checkpoint's tokenizer")
