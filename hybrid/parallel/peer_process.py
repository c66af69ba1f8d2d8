"""The prefill peer's process (rank 1) and the pipe between it and the engine's process (hybrid/parallel/peer.py):
`serve`, the peer's main; `wait_message`, rank 0's wait on the pipe that notices a dead peer; `end_process`.
"""
from __future__ import annotations

import contextlib
import os
import threading
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hybrid.parallel.group import process_group, rank_device
from hybrid.parallel.peer_commands import alone, together
from hybrid.parallel.shared import attach_experts, pin_shared
from hybrid.prefill.pipeline import PrefillCancelled

POLL_S = 0.05  # how often rank 0, waiting on the pipe, checks that the peer process is alive


class PeerError(RuntimeError):
    """The prefill peer failed a command or is gone; the request it held fails with this message."""


def serve(conn, cancel, make: Callable, make_args: tuple, arenas: list, init_file: str, device_type: str,
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
    rows = [layer.rows(0, n) for layer in cache.layers]
    dist.send(torch.stack([kv for kv, _ in rows]).contiguous(), 0)
    dist.send(torch.stack([pe for _, pe in rows]).contiguous(), 0)
    dist.send(logits.float().contiguous(), 0)


def _describe(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    return f"{type(e).__name__}: {e}" + (f" ({where.filename}:{where.lineno})" if where else "")


def wait_message(proc, conn, what: str, cancelled: Optional[threading.Event] = None, cancel=None) -> tuple:
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


def end_process(proc, kill: bool = False, wait_s: float = 5.0) -> None:
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
