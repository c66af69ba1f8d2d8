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
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hybrid.placement.memory import auto_ring_len, free_bytes, ring_budget
from hybrid.parallel.group import Dist, process_group, rank_device
from hybrid.parallel.prefill import Streaming, parallel_prefill
from hybrid.parallel.shared import attach_experts, pin_shared
from hybrid.parallel.smallep import MODES, shard
from hybrid.plan.plan import PrefillPlan
from hybrid.prefill.ring import expert_tensors, layout
from hybrid.prefill.pipeline import PrefillCancelled
from hybrid.prefill.slp import StreamLoader

POLL_S = 0.05  # how often rank 0, waiting on the pipe, checks that the peer process is alive
STOP_S = 30.0  # close(): how long the peer may take to leave before it is killed


class PeerError(RuntimeError):
    """The prefill peer failed a command or is gone; the request it held fails with this message."""


@dataclass(frozen=True)
class Knobs:
    """A command's prefill settings, from the engine's plan (so a replan's changes reach the peer): ring slots
    (None: as deep as the device's memory allows), experts computed together, stream-loading chunk (0: the whole
    prompt), how two ranks share the experts (policy.prefill.ep), the device memory budget
    (policy.gpu.memory_budget_gb; None: free memory less a reserve)."""
    ring_len: Optional[int] = None
    group: int = 1
    chunk_tokens: int = 0
    ep: str = "smallep"
    budget_gb: Optional[float] = None
    stream: Optional[bool] = None  # the routed experts streamed through the device; None: on a GPU (on the CPU, the
    # CPU kernels compute them in place, as the CPU engine does)

    @classmethod
    def of(cls, prefill: PrefillPlan, budget_gb: float, stream: Optional[bool] = None) -> "Knobs":
        """The knobs of the engine's plan: plan.prefill (ring_len 0: as deep as memory allows) and
        plan.gpu.memory_budget_gb (0: none)."""
        return cls(ring_len=prefill.ring_len or None, group=prefill.slp_group_experts,
                   chunk_tokens=prefill.slp_chunk_tokens, ep=prefill.ep, budget_gb=budget_gb or None, stream=stream)

    def streams(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.stream is None else self.stream


def streaming(model: nn.Module, device: torch.device, loader: StreamLoader, tokens: int, knobs: Knobs,
              share: Optional[int] = None) -> Streaming:
    """The ring for a prefill of `tokens` tokens on `device`: policy.prefill.ring_len, else as deep as the memory
    left beside the activations allows, over `share` experts per layer (a rank's share; None: all of them)."""
    from hybrid.placement.passes import cpu_experts

    layer = cpu_experts(model)[0]
    slot = layout(expert_tensors(layer.host_experts[0]))[1]
    budget = ring_budget(model.args, free_bytes(device, knobs.budget_gb), loader.kept_ring_bytes(device),
                         knobs.group, tokens)
    n = share if share is not None else len(layer.host_experts)
    return Streaming(knobs.ring_len or auto_ring_len(n, slot, budget), budget, knobs.group, loader)


def chunks(start: int, end: int, size: int, least: int = 1) -> list[tuple[int, int]]:
    """start..end in pieces of `size` tokens (0: one piece), none shorter than `least` (a short tail joins the piece
    before it: a context-parallel piece needs a token per rank)."""
    if not size or end - start <= size:
        return [(start, end)]
    out = [(a, min(end, a + size)) for a in range(start, end, size)]
    if len(out) > 1 and out[-1][1] - out[-1][0] < least:
        out[-2:] = [(out[-2][0], end)]
    return out


def together(model: nn.Module, d: Dist, tokens: Sequence[int], cache, slot: int, start: int, loader: StreamLoader,
             knobs: Knobs) -> torch.Tensor:
    """This rank's side of a two-rank prefill of tokens (at positions start..) into `slot`, in stream-loading chunks:
    the last token's logits (the same on every rank)."""
    n_experts = model.args.n_routed_experts
    owned = len(shard(n_experts, d.rank, d.world))
    logits = None
    for lo, hi in chunks(start, start + len(tokens), knobs.chunk_tokens, least=d.world):
        s = streaming(model, d.device, loader, hi - lo, knobs, owned) if knobs.streams(d.device) else None
        logits = parallel_prefill(model, d, tokens[lo - start:hi - start], cache, slot, start=lo, mode=knobs.ep,
                                  streaming=s)
    return logits


def alone(model: nn.Module, device: torch.device, tokens: Sequence[int], cache, slot: int, loader: StreamLoader,
          knobs: Knobs, cancel=None) -> torch.Tensor:
    """A one-device prefill of tokens (positions 0..) into `slot`, stream-loaded (knobs.streams): the last token's
    logits. `cancel`: once set, the prefill stops at its next expert (PrefillCancelled), or before its next chunk
    where nothing streams."""
    logits = None
    for lo, hi in chunks(0, len(tokens), knobs.chunk_tokens):
        if cancel is not None and cancel.is_set():
            raise PrefillCancelled("prefill cancelled")
        if knobs.streams(device):
            s = streaming(model, device, loader, hi - lo, knobs)
            pipeline = loader.streaming(model, device, s.ring_len, s.budget_bytes, s.group, cancel=cancel)
        else:
            pipeline = contextlib.nullcontext()
        with pipeline as pipe:
            out = model(torch.tensor([list(tokens[lo:hi])], device=device), torch.arange(lo, hi, device=device)[None],
                        cache, torch.tensor([slot], device=device), last_only=True, kv_len=hi,
                        experts=pipe.experts if pipe is not None else None)
        logits = out[0, -1]
    return logits


# -- the peer process ---------------------------------------------------------------------------------------------
def _serve(conn, cancel, make: Callable, make_args: tuple, arenas: list, init_file: str, device_type: str,
           max_context: int, threads: int) -> None:
    """The peer's main: the model made and attached to the shared experts, then commands until `stop`."""
    torch.set_num_threads(threads)
    device = rank_device(1, device_type)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model, loader = make(device, *make_args)
        attach_experts(model, arenas)
        if device.type == "cuda":
            pin_shared(arenas)
        cache = model.new_cache(1, max_context, device)
    except BaseException as e:  # noqa: BLE001 - reported to the engine's build, which raises it
        conn.send(("error", _describe(e)))
        return
    conn.send(("ready", os.getpid()))
    with process_group(1, 2, init_file, device) as d:
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:  # the engine's process is gone
                return
            if cmd == "stop":
                conn.send(("stopped",))
                return
            try:
                if cmd == "together":
                    tokens, start, knobs = args
                    together(model, d, tokens, cache, 0, start, loader, knobs)
                    conn.send(("done",))
                elif cmd == "alone":
                    tokens, knobs = args
                    logits = alone(model, device, tokens, cache, 0, loader, knobs, cancel)
                    conn.send(("ok", len(tokens), logits.numel()))
                    _send_rows(cache, len(tokens), logits)
                else:
                    raise ValueError(f"unknown command {cmd!r}")
            except PrefillCancelled:
                conn.send(("cancelled",))
            except BaseException as e:  # noqa: BLE001 - the engine fails the request with it
                conn.send(("error", _describe(e)))
                if cmd == "together":  # rank 0 may be inside a collective this rank left: end the group
                    return


def _send_rows(cache, n: int, logits: torch.Tensor) -> None:
    """Slot 0's latents of positions 0..n-1, every layer's, and the logits (float32) to rank 0."""
    dist.send(torch.stack([layer.kv[0, :n] for layer in cache.layers]).contiguous(), 0)
    dist.send(torch.stack([layer.pe[0, :n] for layer in cache.layers]).contiguous(), 0)
    dist.send(logits.float().contiguous(), 0)


def _describe(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    return f"{type(e).__name__}: {e}" + (f" ({where.filename}:{where.lineno})" if where else "")


# -- rank 0: the engine's side ------------------------------------------------------------------------------------
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
        proc = ctx.Process(target=_serve, name="hybrid-prefill-peer", daemon=True,
                           args=(child, cancel, make, make_args, arenas, init_file, device.type, max_context,
                                 threads))
        proc.start()
        child.close()
        try:
            msg = _wait(proc, conn, "start")
            if msg[0] == "error":
                raise PeerError(f"the prefill peer could not start: {msg[1]}")
            group = contextlib.ExitStack()
            d = group.enter_context(process_group(0, 2, init_file, device))
        except BaseException:
            _end(proc)
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
              knobs: Knobs) -> Optional[torch.Tensor]:
        """tokens (positions 0..) prefilled by the peer alone, its latents then copied into the engine cache's
        `slot`: the last token's logits on the engine's device (None when `cancelled` stopped it). Blocks: the
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
            for i, layer in enumerate(layers):
                layer.kv[slot, :n].copy_(kv[i])
                layer.pe[slot, :n].copy_(pe[i])
            self.served["alone"] += 1
            return logits

    def beside(self, chunk, cache, prefill: PrefillPlan, budget_gb: float) -> "PeerPrefill":
        """A prompt (chunk.start 0) prefilled by the peer alone while the engine steps decode (`alone`, on a thread:
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
        _end(self.process)
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
            msg = _wait(self.process, self.conn, what, cancelled, self.cancel_event)
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
        _end(self.process, kill=True)
        self._leave()

    def _leave(self) -> None:
        group = getattr(self, "_group", None)
        self._group = None
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()
        with contextlib.suppress(OSError):
            self.conn.close()


def _wait(proc, conn, what: str, cancelled: Optional[threading.Event] = None, cancel=None) -> tuple:
    """The peer's next message, polling its process: PeerError as soon as it is found dead. `cancelled` (rank 0's
    event), once set, is passed on to the peer (`cancel`)."""
    while True:
        try:
            if conn.poll(POLL_S):
                return conn.recv()
        except (OSError, EOFError):
            pass
        if cancelled is not None and cancelled.is_set() and cancel is not None and not cancel.is_set():
            cancel.set()
        if not proc.is_alive():
            with contextlib.suppress(OSError, EOFError):
                if conn.poll(0):
                    return conn.recv()
            raise PeerError(f"the prefill peer process {proc.pid} died during {what} (exit code {proc.exitcode}); "
                            "the engine goes on on one device")


def _end(proc, kill: bool = False, wait_s: float = 5.0) -> None:
    """The peer process ended: terminated (killed if it must be) and reaped."""
    if proc.is_alive():
        if kill:
            proc.kill()
        else:
            proc.terminate()
        proc.join(wait_s)
        if proc.is_alive():
            proc.kill()
            proc.join(wait_s)


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
        if chunk.start != 0:
            raise ValueError(f"a prefill on the peer starts at position 0, not {chunk.start}")
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
                self.logits = peer.alone(c.request.prompt[:c.end], cache, c.request.slot, self.cancelled, knobs)
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, which fails the request
            self.error = e
        finally:
            self.done.set()
