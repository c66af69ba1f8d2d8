"""The trial worker as the tuner drives it: one long-lived process (`python -m <tuner.trial_module> <overrides>`,
tuner/worker.py) in its own process group, started on demand and kept across trials, that loads the model once and
measures trial after trial. It is started again when a knob that needs a reload changes (its `key`: those knobs'
values), after it crashed, and after a trial missed its deadline (the whole group is killed). Its stderr goes to
one log per worker; each trial's part of it is copied to the trial's own log. The outcome of a trial: ok (metrics),
crash, oom or deadline."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hybrid.process import stop_group

# Signs of running out of memory in a trial's error or log (host or GPU), besides a SIGKILL we did not send.
OOM_MARKERS = ("MemoryError", "out of memory", "OutOfMemoryError", "can't allocate memory",
               "Cannot allocate memory", "std::bad_alloc", "the KV cache for policy.")

# Linux: the worker dies with the tuner (prctl PR_SET_PDEATHSIG, kept across exec), so a tuner killed with SIGKILL
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
    report: dict[str, Any] = field(default_factory=dict)  # records, plan, threads, kernel
    seconds: float = 0.0  # the trial's wall time, a worker's start and model load included
    pid: int = 0
    started: bool = False  # a worker was started for this trial (the model loaded)
    builds: int = 0  # models the worker has built (1 while it reuses its model)
    build_s: float = 0.0  # building (or rebuilding) the engine for this trial
    measure_s: float = 0.0
    detail: str = ""  # the error, the last lines of the log, or why it was killed

    @property
    def records(self) -> list[dict]:
        return self.report.get("records", [])


def command(module: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *overrides]


class Worker:
    """`run` a request on the worker for `key` (a worker for another key is stopped first)."""

    def __init__(self, module: str, overrides: list[str], env: dict[str, str], log_dir: Path):
        self.module, self.overrides, self.env, self.log_dir = module, overrides, env, log_dir
        self.proc: Optional[subprocess.Popen] = None
        self.key: Optional[tuple[str, ...]] = None
        self.log_path: Optional[Path] = None
        self.replies: queue.Queue = queue.Queue()
        self.starts = 0

    def _start(self, key: tuple[str, ...]) -> None:
        cmd = command(self.module, self.overrides)
        launch = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *cmd[1:]] if sys.platform.startswith(
            "linux") else cmd
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.log_path = self.log_dir / f"worker-{os.getpid()}-{self.starts}.log"
        with open(self.log_path, "w") as log:
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            self.proc = subprocess.Popen(launch, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, env=self.env, start_new_session=True)
        self.key, self.replies = key, queue.Queue()
        threading.Thread(target=_read_replies, args=(self.proc.stdout, self.replies), daemon=True).start()

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()  # the worker's loop ends
            self.proc.wait(timeout=3)
        except (OSError, subprocess.TimeoutExpired):
            pass
        stop_group(self.proc, grace_s=2.0)
        _close_pipes(self.proc)
        self.proc = None

    def run(self, key: tuple[str, ...], request: dict, timeout_s: float, log_path: Path,
            on_start: Callable[[int], None] = lambda pid: None) -> Outcome:
        t0 = time.monotonic()
        started = self.proc is None or self.proc.poll() is not None or key != self.key
        if started:
            self.stop()
            self._start(key)
        on_start(self.proc.pid)
        offset = self.log_path.stat().st_size if not started else 0
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            reply = "deadline"
        except BrokenPipeError:
            reply = None
        except BaseException:  # Ctrl-C / SIGTERM of the tuner: take the worker down with us
            self.stop()
            raise
        pid = self.proc.pid
        if reply == "deadline":
            stop_group(self.proc, grace_s=3.0)
            _close_pipes(self.proc)
            self.proc = None
        elif reply is None or not reply.get("alive", True):
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stop_group(self.proc, grace_s=3.0)
        detail = _copy_log(self.log_path, offset, log_path)
        out = Outcome("ok", seconds=time.monotonic() - t0, pid=pid, started=started)
        if reply == "deadline":
            out.status, out.detail = "deadline", f"no result within {timeout_s:g} s: worker's process group killed"
            return out
        if reply is None:  # the worker died without answering
            code = self.proc.returncode
            out.status = "oom" if code == -signal.SIGKILL or _oom(detail) else "crash"
            out.detail = f"trial worker exited with status {code}\n{detail}"
            return out
        out.builds = reply.get("builds", 0)
        if reply.get("status") != "ok":
            error = reply.get("error") or f"error: the trial worker's reply has status {reply.get('status')!r}"
            out.status = "oom" if _oom(error) or _oom(detail) else "crash"
            out.detail = f"{detail}\n{error}"
            return out
        if not isinstance(reply.get("metrics"), dict):  # a worker out of step with the protocol (tuner/worker.py)
            out.status = "crash"
            out.detail = (f"{detail}\nerror: the trial worker's reply to {request.get('op')!r} has no 'metrics' "
                          f"(keys: {', '.join(sorted(reply))})")
            return out
        out.metrics, out.report = reply["metrics"], reply.get("report", {})
        out.build_s, out.measure_s = reply.get("build_s", 0.0), reply.get("measure_s", 0.0)
        return out

    def call(self, key: tuple[str, ...], request: dict, timeout_s: float, log_path: Path) -> dict:
        """A request that is no trial (the crossover): its reply, or a RuntimeError saying why there is none."""
        out = self.run(key, request, timeout_s, log_path)
        if out.status != "ok":
            raise RuntimeError(f"{out.status}: {reason(out.detail)} (log: {log_path})")
        return out.metrics


def _read_replies(stream, replies: queue.Queue) -> None:
    try:
        for line in stream:
            line = line.strip()
            if line.startswith("{"):
                try:
                    replies.put(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except (ValueError, OSError):  # the pipe closed under us: the worker was stopped
        pass
    replies.put(None)  # end of stream: the worker is gone


def _close_pipes(proc: subprocess.Popen) -> None:
    """A stopped worker's pipes, closed now rather than whenever the garbage collector gets to them."""
    for pipe in (proc.stdin, proc.stdout):
        try:
            if pipe is not None:
                pipe.close()
        except OSError:
            pass


def _copy_log(worker_log: Path, offset: int, trial_log: Path) -> str:
    """The worker's log from `offset` (this trial's part) into the trial's log; returns its last lines."""
    try:
        with open(worker_log, errors="replace") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        text = ""
    trial_log.parent.mkdir(parents=True, exist_ok=True)
    trial_log.write_text(f"(from {worker_log})\n{text}")
    return "\n".join(text.splitlines()[-15:])


def _oom(text: str) -> bool:
    return any(m in text for m in OOM_MARKERS)


def reason(detail: str) -> str:
    """The line of a trial's log that says what went wrong: the last exception or `error:` line, else the last."""
    lines = [line.strip() for line in detail.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if line.startswith("error:") or (head.endswith(("Error", "Exception", "Interrupt", "Refused"))
                                         and " " not in head):
            return line
    return lines[-1] if lines else ""
