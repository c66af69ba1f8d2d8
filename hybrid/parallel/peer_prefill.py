"""The prefill peer's `alone` command run beside decode (hybrid/parallel/peer.py `Peer.beside`): rank 0's side on a
thread of its own, as the engine's prefill beside decode runs.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from hybrid.parallel.peer_commands import Knobs

if TYPE_CHECKING:
    from hybrid.parallel.peer import Peer


@dataclass
class PeerPrefill:
    """A prompt prefilled by the peer alone while the engine's thread goes on stepping decode: the same interface
    as the engine's prefill beside decode (hybrid/engine/beside.py `Beside`), so the engine collects, aborts and fails
    it the same way. `side`: the CUDA stream the latents are copied on (the engine's stream waits for it when
    collecting)."""
    chunk: Any
    thread: threading.Thread
    done: threading.Event
    cancelled: threading.Event
    side: Optional[torch.cuda.Stream]
    logits: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None

    @classmethod
    def start(cls, peer: Peer, chunk, cache, knobs: Knobs) -> "PeerPrefill":
        req = chunk.request
        dev = peer.dist.device
        side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        if side is not None:  # what the engine's stream wrote (e.g. a cleared slot) before the copies
            side.wait_stream(torch.cuda.current_stream(dev))
        p = cls(chunk, threading.Thread(target=lambda: p._run(peer, cache, knobs), name=f"peer-prefill-{req.id}",
                                        daemon=True), threading.Event(), threading.Event(), side)
        p.thread.start()
        return p

    def cancel(self) -> None:
        self.cancelled.set()

    def _run(self, peer: Peer, cache, knobs: Knobs) -> None:
        c = self.chunk
        try:
            with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
                self.logits = peer.alone(c.request.prompt[:c.end], cache, c.request.slot, self.cancelled, knobs,
                                         c.start)
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, which fails the request
            self.error = e
        finally:
            self.done.set()
