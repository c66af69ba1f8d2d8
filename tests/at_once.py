"""Processes started at the same moment: `at_once(fn, n, *args, warm=modules)` runs fn(*args) in n fresh
interpreters (spawn) that import `warm` and then wait at one barrier, and returns each one's result, or the
traceback text of what it raised. fn must be a module-level function of an importable module (spawn imports that
module by name: keep its own imports light, and name the heavy ones in `warm`)."""
from __future__ import annotations

import importlib
import multiprocessing as mp
import traceback
from typing import Any, Callable, Sequence


def _run(fn: Callable, args: tuple, warm: Sequence[str], barrier, results, i: int) -> None:
    try:
        for name in warm:
            importlib.import_module(name)
        barrier.wait(timeout=120)  # every interpreter started and its imports done: go together
        results.put((i, "ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - handed to the test, which shows it
        results.put((i, "error", traceback.format_exc()))


def at_once(fn: Callable, n: int, *args: Any, warm: Sequence[str] = (),
            timeout_s: float = 300) -> list[tuple[str, Any]]:
    """[(status, result or traceback)] of n processes in start order; status "ok" or "error"."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(fn, args, tuple(warm), barrier, results, i)) for i in range(n)]
    for p in procs:
        p.start()
    try:
        got = dict((i, (status, value)) for i, status, value in (results.get(timeout=timeout_s) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[i] for i in range(n)]
