"""One trial: `python -m hybrid mode=bench bench=slo output=json <overrides> policy.<group>.<knob>=...` (the module from
`tuner.trial_module`) as a subprocess in its own process group, with a deadline; its environment carries the
trial's number (HYBRID_TUNER_TRIAL). Its stdout is read as it arrives (JSON lines: the bench's records); stderr goes
to the trial's log. On the deadline the whole group is killed. The outcome: ok (metrics), crash, oom or deadline."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hybrid.process import stop_group

TRIAL_ENV = "HYBRID_TUNER_TRIAL"  # the trial's number, in the trial command's environment

# Signs of running out of memory in a trial's stderr (host or GPU), besides a SIGKILL we did not send.
OOM_MARKERS = ("MemoryError", "out of memory", "OutOfMemoryError", "can't allocate memory",
               "Cannot allocate memory", "std::bad_alloc", "the KV cache for policy.")

# Linux: the trial dies with the tuner (prctl PR_SET_PDEATHSIG, kept across exec), so a tuner killed with SIGKILL
# leaves no benchmark running beside the next one. Exec'd from a 1-line launcher rather than preexec_fn, which is
# unsafe with threads (Optuna's heartbeat thread runs meanwhile).
_LAUNCHER = ("import ctypes, os, signal, sys\n"
             "try:\n"
             "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))\n"
             "except Exception:\n"
             "    pass\n"
             "if os.getppid() != int(sys.argv[1]):\n"
             "    os._exit(75)\n"
             "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n")


@dataclass
class Outcome:
    status: str  # ok | crash | oom | deadline
    metrics: dict[str, float] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    returncode: Optional[int] = None
    seconds: float = 0.0
    pid: int = 0
    detail: str = ""  # the last lines of stderr, or why it was killed


def command(overrides: list[str], policy: dict[str, str], module: str = "hybrid") -> list[str]:
    """policy: knob path ("cpu.threads") -> the value as an override reads it."""
    return [sys.executable, "-m", module, "mode=bench", "bench=slo", "output=json", *overrides,
            *(f"policy.{k}={v}" for k, v in policy.items())]


def run(cmd: list[str], env: dict[str, str], timeout_s: float, log_path: Path,
        on_start: Callable[[int], None] = lambda pid: None) -> Outcome:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    launch = cmd
    if sys.platform.startswith("linux"):
        launch = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *cmd[1:]]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        proc = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                                env=env, start_new_session=True)
        on_start(proc.pid)
        reports: list[dict] = []
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, reports), daemon=True)
        reader.start()
        killed = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            killed = True
            stop_group(proc, grace_s=3.0)
        except BaseException:  # Ctrl-C / SIGTERM of the tuner: take the trial down with us
            stop_group(proc, grace_s=3.0)
            raise
        reader.join(timeout=5)
    seconds = time.monotonic() - t0
    detail = _tail(log_path)
    records = next((r["records"] for r in reversed(reports) if isinstance(r.get("records"), list)), [])
    metrics = _metrics(records)
    base = dict(returncode=proc.returncode, seconds=seconds, pid=proc.pid, records=records, metrics=metrics)
    if killed:
        return Outcome("deadline", detail=f"no result within {timeout_s:g} s: process group killed", **base)
    if proc.returncode == 0 and metrics:
        return Outcome("ok", detail="", **base)
    if proc.returncode == -signal.SIGKILL or any(m in detail for m in OOM_MARKERS):
        return Outcome("oom", detail=detail, **base)
    if proc.returncode == 0:
        detail = "exited 0 without records on stdout\n" + detail
    return Outcome("crash", detail=detail, **base)


def _read_lines(stream, reports: list) -> None:
    for line in stream:
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                reports.append(obj)


def _metrics(records: list[dict]) -> dict[str, float]:
    out = {}
    for r in records:
        if isinstance(r, dict) and isinstance(r.get("value"), (int, float)) and r.get("name") not in out:
            out[r["name"]] = float(r["value"])
            if r.get("fraction_of_bound") is not None:
                out[f"{r['name']}.of_bound"] = float(r["fraction_of_bound"])
    return out


def reason(detail: str) -> str:
    """The line of a trial's stderr that says what went wrong: the last exception or `error:` line, else the last."""
    lines = [line.strip() for line in detail.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if line.startswith("error:") or (head.endswith(("Error", "Exception", "Interrupt")) and " " not in head):
            return line
    return lines[-1] if lines else ""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])
