"""The prefill peer (hybrid/parallel/peer.py) as the engine's loop sees it: while it serves, which scheduled chunks
go to both devices and which run beside decode; once it is gone, the scheduler's rules for one device."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

from hybrid.engine.scheduler import Chunk, Scheduler

if TYPE_CHECKING:
    from hybrid.parallel.peer import Peer


class PeerLink:
    def __init__(self, peer: Optional["Peer"], scheduler: Scheduler, beside_decode: bool, streams: bool):
        """beside_decode: plan.prefill.beside_decode; streams: whether this process stream-loads prompts itself
        (the scheduler's rules once the peer is gone)."""
        self.peer, self.scheduler = peer, scheduler
        self.beside_decode, self.streams = beside_decode, streams

    def live(self) -> Optional["Peer"]:
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

    def together(self, chunk: Chunk) -> Optional["Peer"]:
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
