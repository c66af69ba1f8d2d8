"""Stopping a child that leads its own process group (started with start_new_session=True), with everything it
started: the tuner's trials and the MLflow UI's workers."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def stop_group(proc, grace_s: float = 10.0) -> None:
    """Stop the process group `proc` leads (started with start_new_session=True): SIGTERM to the whole group, wait
    up to grace_s for every member to go, then SIGKILL whatever is left."""
    def alive() -> bool:
        try:
            os.killpg(proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    if proc.poll() is None or alive():
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
        if not alive():
            return
        time.sleep(0.1)  # the leader is gone, others of its group are not: wait for them without spinning
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
