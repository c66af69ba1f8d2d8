"""`python -m hybrid mode=replicas`: `replicas.count` servers of one config behind a gateway.

    python -m hybrid mode=replicas replicas.count=2 replicas.gateway=sglang replicas.policy=cache_aware

Replica i is `python -m hybrid mode=serve server.port=<replicas.base_port + i>` with every other override of the
command line; once each answers /health, the gateway starts on server.host:server.port (`sglang`: the SGLang Model
Gateway, `python -m sglang_router.launch_router`; `vllm`: `python -m vllm_router.launch_router`; `none`: no
gateway) with the replicas as its workers, `replicas.policy`, and its Prometheus metrics on
replicas.prometheus_port; then the launcher waits for it to list the model. Each process writes its log under
runs/replicas/<date>/<time>/. Ctrl-C or SIGTERM stops the gateway, then the replicas (each drains as mode=serve does);
a process that exits on its own stops the rest, and the launcher exits with status 2."""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

from hybrid.config.compose import RUNS_DIR
from hybrid.config.schema import HybridConfig
from hybrid.errors import ConfigError, HybridError

GATEWAY_MODULES = {"sglang": ("sglang_router.launch_router", "sglang-router"),
                   "vllm": ("vllm_router.launch_router", "vllm-router")}
OWN_KEYS = ("mode=", "replicas.", "server.port=", "hydra.", "+hydra.")  # overrides a replica does not inherit
STOP_S = 60.0  # after SIGTERM: how long a process may take before it is killed
POLL_S = 0.2


class ReplicaError(HybridError):
    """A replica or the gateway failed to start or stopped on its own."""


class _Stopped(Exception):
    """Ctrl-C or SIGTERM before everything was ready."""


@dataclass
class Proc:
    name: str
    url: str
    cmd: list[str]
    log: Path
    popen: Optional[subprocess.Popen] = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)  # Ctrl-C reaches the launcher alone

    def exited(self) -> Optional[int]:
        return None if self.popen is None else self.popen.poll()

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(text[-lines:])


def replica_urls(s: HybridConfig) -> list[str]:
    r = s.replicas
    return [f"http://{s.server.host}:{r.base_port + i}" for i in range(r.count)]


def replica_command(port: int, overrides: list[str]) -> list[str]:
    keep = [o for o in overrides if not o.lstrip("~").startswith(OWN_KEYS)]
    return [sys.executable, "-m", "hybrid", "mode=serve", f"server.port={port}", *keep]


def gateway_command(s: HybridConfig, key: Optional[str]) -> Optional[list[str]]:
    """The gateway's command line, or None for replicas.gateway=none."""
    r = s.replicas
    if r.gateway == "none":
        return None
    module, package = GATEWAY_MODULES[r.gateway]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ConfigError(f"replicas.gateway={r.gateway} needs {package}: pip install {package}")
    return [sys.executable, "-m", module, "--worker-urls", *replica_urls(s), "--policy", r.policy,
            "--host", s.server.host, "--port", str(s.server.port), "--prometheus-host", s.server.host,
            "--prometheus-port", str(r.prometheus_port), *(["--api-key", key] if key else []), *r.gateway_args]


def check_ports(s: HybridConfig) -> None:
    r = s.replicas
    mine = set(range(r.base_port, r.base_port + r.count))
    for name, port in (("server.port", s.server.port), ("replicas.prometheus_port", r.prometheus_port)):
        if port in mine:
            raise ConfigError(f"{name} {port} is among the replicas' ports {r.base_port}..{r.base_port + r.count - 1}"
                              f" (replicas.base_port)")


def command_line_overrides() -> list[str]:
    """The overrides of this run's command line (Hydra's), else none."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run(s: HybridConfig, overrides: Optional[list[str]] = None) -> dict:
    """Starts the replicas and the gateway, serves until SIGTERM/Ctrl-C, stops them; the endpoints started."""
    from hybrid.serve.service import api_key

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    check_ports(s)
    key = api_key(s.server)
    gateway_cmd = gateway_command(s, key)
    overrides = command_line_overrides() if overrides is None else overrides
    _first_use(s)
    logs = RUNS_DIR / "replicas" / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    logs.mkdir(parents=True, exist_ok=True)
    procs = [Proc(f"replica {i}", url, replica_command(s.replicas.base_port + i, overrides), logs / f"replica-{i}.log")
             for i, url in enumerate(replica_urls(s))]
    gateway = Proc("gateway", f"http://{s.server.host}:{s.server.port}", gateway_cmd, logs / "gateway.log") \
        if gateway_cmd else None
    stop = _Stop()
    try:
        for p in procs:
            p.start()
            print(f"{p.name}: {p.url} (log {p.log})", file=sys.stderr)
        for p in procs:
            _wait_ready(p, "/health", key, s.replicas.ready_timeout_s, stop, procs)
        if gateway is not None:
            gateway.start()
            _wait_ready(gateway, "/v1/models", key, s.replicas.ready_timeout_s, stop, procs + [gateway])
        endpoint = (gateway or procs[0]).url
        print(f"ready: {endpoint}/v1" + (f" ({s.replicas.gateway} gateway, policy {s.replicas.policy}, metrics on "
                                         f"port {s.replicas.prometheus_port}; log {gateway.log})" if gateway else ""),
              file=sys.stderr, flush=True)
        _serve(procs + ([gateway] if gateway else []), stop)
    except _Stopped:
        print("stopped before everything was ready", file=sys.stderr)
    finally:
        stop.restore()
        _stop_all(([gateway] if gateway else []) + procs)
    return {"mode": "replicas", "endpoint": f"{(gateway or procs[0]).url}/v1", "replicas": [p.url for p in procs],
            "logs": str(logs)}


def _first_use(s: HybridConfig) -> None:
    """A generated checkpoint written once, here, rather than by every replica at the same time."""
    if s.model.path is None and not s.model.in_memory:
        from hybrid.models import open_source

        open_source(s.model)


class _Stop:
    """SIGINT/SIGTERM set a flag; the handlers before are put back by restore()."""

    def __init__(self):
        self.asked = False
        self.before = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, _sig, _frame) -> None:
        self.asked = True

    def restore(self) -> None:
        for sig, handler in self.before.items():
            signal.signal(sig, handler)


def _wait_ready(p: Proc, path: str, key: Optional[str], timeout_s: float, stop: _Stop, watched: list[Proc]) -> None:
    """Until p answers `path` with 200 (and, for /v1/models, a model); ReplicaError if a process exits first."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    end = time.monotonic() + timeout_s
    while True:
        if stop.asked:
            raise _Stopped
        _check_alive(watched)
        try:
            r = httpx.get(p.url + path, headers=headers, timeout=5)
            if r.status_code == 200 and (path != "/v1/models" or r.json().get("data")):
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > end:
            raise ReplicaError(f"{p.name} ({p.url}) not ready within {timeout_s:g} s (replicas.ready_timeout_s); "
                               f"its log {p.log} ends:\n{p.tail()}")
        time.sleep(POLL_S)


def _check_alive(procs: list[Proc]) -> None:
    for p in procs:
        code = p.exited()
        if code is not None:
            raise ReplicaError(f"{p.name} ({p.url}) exited with status {code}; its log {p.log} ends:\n{p.tail()}")


def _serve(procs: list[Proc], stop: _Stop) -> None:
    while not stop.asked:
        _check_alive(procs)
        time.sleep(POLL_S)
    print("stopping: the gateway, then the replicas", file=sys.stderr)


def _stop_all(procs: list[Proc]) -> None:
    """SIGTERM to each in order (the gateway first), each waited for up to STOP_S, then killed."""
    for p in procs:
        if p.popen is None or p.popen.poll() is not None:
            continue
        with _suppress_lookup():
            os.killpg(p.popen.pid, signal.SIGTERM)
        try:
            p.popen.wait(STOP_S)
        except subprocess.TimeoutExpired:
            with _suppress_lookup():
                os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait()


def _suppress_lookup():
    import contextlib

    return contextlib.suppress(ProcessLookupError)
