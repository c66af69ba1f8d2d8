"""The prefill peer as the engine sees it: `PrefillPeer`, what the engine asks of the second device's process
(hybrid/parallel/peer.py `Peer`, started by build.py), and `PeerLink`, the loop's view of it: while it serves, which
scheduled chunks go to both devices and which run beside decode; once it is gone, the scheduler's rules for one
device."""
from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import torch

from hybrid.engine.scheduler import Chunk, Scheduler

if TYPE_CHECKING:
    from hybrid.model.kv_cache import KVCache
    from hybrid.model.transformer import Transformer
    from hybrid.plan.plan import PrefillPlan


class BesideJob(Protocol):
    """A prompt's prefill beside decode, on a thread: this process's (beside.py `Beside`) or the peer's
    (`PrefillPeer.beside`). Once `done`, the engine's thread joins it, orders `side` (the CUDA stream it wrote the
    KV cache on, if any) before its own work and takes `logits` or `error`; `cancel` stops it at its next expert."""
    chunk: Chunk
    thread: threading.Thread
    done: threading.Event
    cancelled: threading.Event
    side: Optional[torch.cuda.Stream]
    logits: Optional[torch.Tensor]
    error: Optional[BaseException]

    def cancel(self) -> None: ...


class PrefillPeer(Protocol):
    """The second prefill device's process, as the engine uses it. Each prefill takes the plan's prefill sub-plan
    (plan.prefill) and GPU budget (plan.gpu.memory_budget_gb, 0 = none), so a replan's changes reach the peer."""
    device: torch.device  # the peer's

    @property
    def alive(self) -> bool:
        """Whether commands may go to the peer."""

    @property
    def pid(self) -> int: ...

    def why_not(self) -> str:
        """Why the peer is not alive (for messages)."""

    def close(self, timeout_s: float = ...) -> None:
        """Stops the peer; idempotent."""

    def together(self, model: "Transformer", cache: "KVCache", tokens: Sequence[int], slot: int, start: int,
                 prefill: "PrefillPlan", budget_gb: float) -> torch.Tensor:
        """tokens (at positions start..) prefilled by both devices into the engine cache's `slot`: the last token's
        logits. Raises (and the peer is no longer alive) when it fails."""

    def beside(self, chunk: Chunk, cache: "KVCache", prefill: "PrefillPlan", budget_gb: float) -> BesideJob:
        """A prompt (chunk.start 0) prefilled on the peer's device while the engine steps decode, its latents then
        copied into the request's slot of `cache`: started on a thread."""


class PeerLink:
    def __init__(self, peer: Optional[PrefillPeer], scheduler: Scheduler, beside_decode: bool, streams: bool):
        """beside_decode: plan.prefill.beside_decode; streams: whether this process stream-loads prompts itself
        (the scheduler's rules once the peer is gone)."""
        self.peer, self.scheduler = peer, scheduler
        self.beside_decode, self.streams = beside_decode, streams

    def live(self) -> Optional[PrefillPeer]:
        """The peer while it can take commands; one that died or broke is let go here (with a warning), once."""
        p = self.peer
        if p is not None and not p.alive:
            warnings.warn(f"the prefill peer is gone ({p.why_not()}): the engine goes on on one device")
            p.close()
            self.drop()
        return self.peer

    def drop(self) -> None:
        """One device from now on: the scheduler's rules as without a peer."""
        self.peer = None
        self.scheduler.one_device(self.beside_decode, self.streams)

    def close(self, timeout_s: float) -> None:
        if self.peer is not None:
            self.peer.close(timeout_s)
            self.drop()

    def together(self, chunk: Chunk) -> Optional[PrefillPeer]:
        """The peer, for a chunk for both devices (the scheduler's rule: a long prompt when nothing decodes); a
        prompt's first positions must be on both (it starts at 0)."""
        return self.live() if chunk.gpus > 1 and chunk.streamed and chunk.start == 0 else None

    def beside(self, chunk: Chunk) -> bool:
        """Whether a chunk planned beside decode runs so: not when it goes to both devices (this process takes part),
        nor where nothing can stream it (a CPU stand-in whose peer is gone: prefilled in the step instead, as the
        model's own experts must not run on two threads)."""
        if self.together(chunk) is not None:
            return False
        return self.live() is not None or self.streams
