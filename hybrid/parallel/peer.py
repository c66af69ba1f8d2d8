"""The serving engine's second prefill device: a long-lived process per extra GPU (the "peer", rank 1), beside the
engine's own process (rank 0), serving prefill commands over a pipe.

The engine process loads and places the model and moves the routed experts into ONE shared-memory copy
(shared.py `share_experts`); the peer places its own copy of the rest of the model on its device, points its routed
experts at those arenas (`attach_experts`; page-locked in place on a GPU: `pin_shared`) and holds its own KV cache
(one slot of policy.kv.max_context). Both processes join one process group (NCCL between GPUs; gloo with both ranks
on the CPU, the stand-in the tests run). Commands, one at a time:

- `together`: a long prompt when nothing decodes (the scheduler's rule, engine/scheduler.py `prefill_gpus`): both
  ranks call `parallel_prefill` on it — context-parallel attention, the routed experts shared out by SmallEP or EP
  (policy.prefill.ep), each rank streaming its share through its device — so the engine's cache gets the whole
  prompt's latents and the engine gets the last token's logits.
- `alone`: a long prompt while requests decode (§5.1: one GPU prefills, the other GPU and the CPU decode): the peer
  prefills it on its own device (its own stream-loading) while the engine keeps stepping decode, then sends every
  layer's latents of the prompt (kv and pe rows 0..n-1) and the last logits to rank 0, which copies them into the
  request's KV slot. `PeerPrefill` (started by `Peer.beside`) runs rank 0's side on a thread, as the engine's
  prefill beside decode does.
- `stop`: the peer leaves the group and exits (`Peer.close`).

Failure: a command that fails in the peer fails its request with the peer's message. A peer that dies is seen within
a poll interval while rank 0 waits on the pipe, and by the collectives (gloo: at once, when the peer's sockets close;
NCCL: at the group's timeout, group.COLLECTIVE_TIMEOUT_S); a failed `together` leaves the ranks out of step, so the
peer is then ended and the engine goes on on its one device (`Peer.alive` is False from then on).

Here `Peer`, rank 0's handle; the commands as each rank runs them: peer_commands.py; the peer process and the pipe:
peer_process.py; `alone` on a thread beside decode: peer_prefill.py.
"""
from __future__ import annotations

import contextlib
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hybrid.parallel.group import Dist, process_group, rank_device
from hybrid.parallel.peer_commands import Knobs, together
from hybrid.parallel.peer_prefill import PeerPrefill
from hybrid.parallel.peer_process import PeerError, end_process, serve, wait_message
from hybrid.parallel.smallep import MODES
from hybrid.plan.plan import PrefillPlan
from hybrid.prefill.slp import StreamLoader

STOP_S = 30.0  # close(): how long the peer may take to leave before it is killed


class Peer:
    """The engine process's handle on its prefill peer (rank 1), and rank 0 of their process group. Made by
    `Peer.start` (build() calls it); one per process (torch.distributed has one default group)."""

    def __init__(self, process, conn, cancel, dist_: Dist, tmp: str, loader: StreamLoader):
        self.process, self.conn, self.cancel_event, self.dist = process, conn, cancel, dist_
        self.loader = loader  # rank 0's stream loader for `together` (the engine's own on a GPU)
        self.stream: Optional[bool] = None  # Knobs.stream of every command (None: the experts stream on a GPU)
        self.device = rank_device(1, dist_.device.type)  # the peer's
        self._tmp = tmp
        self._lock = threading.Lock()  # one command at a time
        self._broken: Optional[str] = None  # why the peer is no longer used
        self._closed = False
        self.served = {"together": 0, "alone": 0}  # commands completed, by kind (the tests and logs read them)

    @classmethod
    def start(cls, make: Callable[..., tuple[nn.Module, StreamLoader]], make_args: tuple, arenas: list,
              device: torch.device, max_context: int, loader: Optional[StreamLoader] = None,
              threads: int = 1) -> "Peer":
        """Spawns the peer and joins the group with it as rank 0 on `device` (the engine's). make(device,
        *make_args) -> (model, stream loader), a module-level function: the peer's model placed on its device
        with the routed experts on the CPU kernels (attached to `arenas`, share_experts' of the engine's model,
        after). Raises PeerError when the peer cannot start."""
        if dist.is_initialized():
            raise PeerError("this process already holds a process group: one engine per process may hold a "
                            "prefill peer (policy.prefill.gpus=1 for the others)")
        if device.type == "cuda" and torch.cuda.device_count() < 2:
            raise PeerError(f"policy.prefill.gpus=2 runs a peer process on a second GPU; torch sees "
                            f"{torch.cuda.device_count()}")
        tmp = tempfile.mkdtemp(prefix="hybrid-peer-")
        init_file = str(Path(tmp) / "rendezvous")
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        cancel = ctx.Event()
        proc = ctx.Process(target=serve, name="hybrid-prefill-peer", daemon=True,
                           args=(child, cancel, make, make_args, arenas, init_file, device.type, max_context,
                                 threads))
        proc.start()
        child.close()
        try:
            msg = wait_message(proc, conn, "start")
            if msg[0] == "error":
                raise PeerError(f"the prefill peer could not start: {msg[1]}")
            group = contextlib.ExitStack()
            d = group.enter_context(process_group(0, 2, init_file, device))
        except BaseException:
            end_process(proc)
            raise
        peer = cls(proc, conn, cancel, d, tmp, loader or StreamLoader())
        peer._group = group
        return peer

    @property
    def alive(self) -> bool:
        """Whether commands may go to the peer: started, not closed, not failed in a way that left the group out
        of step, and its process running."""
        return not self._closed and self._broken is None and self.process.is_alive()

    @property
    def pid(self) -> int:
        return self.process.pid

    def why_not(self) -> str:
        """Why the peer is not alive (for messages)."""
        if self._closed:
            return "it was closed"
        if self._broken is not None:
            return self._broken
        return f"its process {self.process.pid} on {self.device} exited (exit code {self.process.exitcode})"

    # -- commands ---------------------------------------------------------------------------------------------
    def together(self, model: nn.Module, cache, tokens: Sequence[int], slot: int, start: int, prefill: PrefillPlan,
                 budget_gb: float) -> torch.Tensor:
        """tokens (positions start..; those before already on both ranks) prefilled by both ranks into the engine's
        `slot` (the peer uses its own slot 0), with the engine plan's prefill and GPU budget (Knobs.of): the last
        token's logits. A failure ends the peer (the ranks are out of step) and raises PeerError."""
        knobs = Knobs.of(prefill, budget_gb, self.stream)
        if knobs.ep not in MODES:
            raise ValueError(f"policy.prefill.ep must be one of {', '.join(MODES)}, got {knobs.ep!r}")
        with self._lock:
            self._send("together", list(tokens), start, knobs)
            try:
                logits = together(model, self.dist, list(tokens), cache, slot, start, self.loader, knobs)
            except BaseException as e:
                why = self._peer_says() or f"{type(e).__name__}: {e}"
                self._fail(why)
                raise PeerError(f"two-device prefill (policy.prefill.gpus=2) failed: {why}; the engine goes on on "
                                "one device") from e
            msg = self._reply("together")
            if msg[0] != "done":
                self._fail(f"unexpected reply {msg[0]!r} to a two-rank prefill")
                raise PeerError(f"two-GPU prefill: {self._broken}")
            self.served["together"] += 1
            return logits

    def alone(self, tokens: Sequence[int], cache, slot: int, cancelled: threading.Event,
              knobs: Knobs, start: int = 0) -> Optional[torch.Tensor]:
        """tokens (positions 0..) prefilled by the peer alone, its latents of positions start.. then copied into the
        engine cache's `slot` (those before are there: a cached prefix the peer recomputes): the last token's logits on the engine's device (None when `cancelled` stopped it). Blocks: the
        engine runs it on a thread of its own (PeerPrefill). A failed prefill raises PeerError and the peer stays
        in use; a dead peer raises PeerError and is not used again."""
        n = len(tokens)
        with self._lock:
            self.cancel_event.clear()
            self._send("alone", list(tokens), knobs)
            msg = self._reply("alone", cancelled)
            if msg[0] == "cancelled":
                return None
            if msg[0] != "ok" or msg[1] != n:
                self._fail(f"unexpected reply {msg!r} to a prefill alone")
                raise PeerError(f"prefill on the peer: {self._broken}")
            dev, layers = self.dist.device, cache.layers
            kv0, pe0 = layers[0].kv, layers[0].pe
            kv = torch.empty((len(layers), n, kv0.shape[-1]), dtype=kv0.dtype, device=dev)
            pe = torch.empty((len(layers), n, pe0.shape[-1]), dtype=pe0.dtype, device=dev)
            logits = torch.empty(msg[2], dtype=torch.float32, device=dev)
            try:
                for t in (kv, pe, logits):
                    dist.recv(t, 1)
            except BaseException as e:
                self._fail(f"the latents of a prefill alone did not arrive ({type(e).__name__}: {e})")
                raise PeerError(f"prefill on the peer: {self._broken}") from e
            for i, layer in enumerate(layers):  # the positions before `start` are the engine's (a cached prefix)
                layer.store(slot, start, kv[i, start:], pe[i, start:])
            self.served["alone"] += 1
            return logits

    def beside(self, chunk, cache, prefill: PrefillPlan, budget_gb: float) -> "PeerPrefill":
        """A prompt prefilled by the peer alone (from position 0; rows from chunk.start copied back) while the engine steps decode (`alone`, on a thread:
        PeerPrefill), with the engine plan's prefill and GPU budget (Knobs.of)."""
        return PeerPrefill.start(self, chunk, cache, Knobs.of(prefill, budget_gb, self.stream))

    def close(self, timeout_s: float = STOP_S) -> None:
        """Stops the peer (killed if it does not leave within timeout_s) and leaves the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None and self.process.is_alive():
            self.cancel_event.set()  # a prefill alone in progress stops at its next expert
            got = self._lock.acquire(timeout=timeout_s)
            try:
                self.conn.send(("stop",))
                self.process.join(timeout_s)
            except (OSError, EOFError):
                pass
            finally:
                if got:
                    self._lock.release()
        end_process(self.process)
        self._leave()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _send(self, cmd: str, *args: Any) -> None:
        if not self.alive:
            raise PeerError(f"the prefill peer is not available: {self.why_not()}")
        try:
            self.conn.send((cmd, *args))
        except (OSError, EOFError) as e:
            self._fail(f"its process {self.process.pid} on {self.device} is gone ({type(e).__name__})")
            raise PeerError(f"the prefill peer is not available: {self._broken}") from e

    def _reply(self, what: str, cancelled: Optional[threading.Event] = None) -> tuple:
        try:
            msg = wait_message(self.process, self.conn, what, cancelled, self.cancel_event)
        except PeerError as e:
            self._fail(str(e))
            raise
        if msg[0] == "error":
            if what == "together" or not self.process.is_alive():
                self._fail(f"it failed: {msg[1]}")
            raise PeerError(f"the prefill peer on {self.device} failed: {msg[1]}")
        return msg

    def _peer_says(self) -> Optional[str]:
        """The peer's error message, if it sent one (a collective failed on rank 0 because the peer left it)."""
        try:
            if self.conn.poll(1.0):
                msg = self.conn.recv()
                if msg and msg[0] == "error":
                    return f"the prefill peer on {self.device} failed: {msg[1]}"
        except (OSError, EOFError):
            pass
        self.process.join(1.0)  # a peer that left the collective by dying is reaped within moments
        if not self.process.is_alive():
            return (f"the prefill peer process {self.process.pid} on {self.device} died (exit code "
                    f"{self.process.exitcode})")
        return None

    def _fail(self, why: str) -> None:
        """The peer is no longer used: ended, and this process leaves the group (the engine goes on alone)."""
        if self._broken is None:
            self._broken = why
        end_process(self.process, kill=True)
        self._leave()

    def _leave(self) -> None:
        group = getattr(self, "_group", None)
        self._group = None
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()
        with contextlib.suppress(OSError):
            self.conn.close()
