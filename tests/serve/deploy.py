"""`python -m hybrid mode=replicas` as users start it, for the gateway tests: replicas of a checkpoint behind a
gateway on free ports, stopped with SIGTERM (which must end the launcher with status 0)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Deployment:
    url: str  # the gateway's base URL
    replicas: list[str]
    metrics_port: int


def free_ports(n: int) -> int:
    """The first of n consecutive ports free on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n <= 65535 and all(_free(first + i) for i in range(n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextlib.contextmanager
def deployment(checkpoint: Path, runs: Path, gateway: str, policy: str = "cache_aware", count: int = 2,
               overrides: tuple[str, ...] = (), key: str = "", ready_s: float = 120.0) -> Iterator[Deployment]:
    first = free_ports(count + 2)
    port, metrics, base = first, first + 1, first + 2
    cmd = [sys.executable, "-m", "hybrid", "mode=replicas", f"replicas.count={count}", f"replicas.gateway={gateway}",
           f"replicas.policy={policy}", f"replicas.base_port={base}", f"replicas.prometheus_port={metrics}",
           f"server.port={port}", f"model.path={checkpoint}", "model.dtype=float32",
           *([f"server.api_key={key}"] if key else []), *overrides]
    env = {**os.environ, "HYBRID_RUNS_DIR": str(runs), "HYBRID_TRACKING": "0",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + ready_s
        while True:
            assert p.poll() is None, p.communicate()[1][-3000:]
            with contextlib.suppress(httpx.HTTPError, ValueError):
                auth = {"Authorization": f"Bearer {key}"} if key else {}
                if gateway == "none" or httpx.get(f"{url}/v1/models", headers=auth, timeout=2).json().get("data"):
                    if all(httpx.get(f"http://127.0.0.1:{base + i}/health", timeout=2).status_code == 200
                           for i in range(count)):
                        break
            assert time.monotonic() < end, "the deployment was not ready in time"
            time.sleep(0.2)
        yield Deployment(url, [f"http://127.0.0.1:{base + i}" for i in range(count)], metrics)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
