"""Run tracking (hybrid/tracking.py): a run's params, metrics, resolved config and plots in MLflow; mlflow stays off
the engine's import path; the MLflow UI (`make ui`) answers on 127.0.0.1 and stops with its process group."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hybrid.tracking import flatten, metrics_of


def test_mlflow_is_not_imported_by_the_engine():
    code = "import sys, hybrid.run, hybrid.cli, hybrid.tracking; sys.exit('mlflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_flatten_and_metrics():
    from hybrid.config.schema import HwConfig, GpuSpec

    flat = flatten(HwConfig(name="x", gpus=[GpuSpec(name="g", memory_gb=1.0)]), "hw.")
    assert flat["hw.name"] == "x" and flat["hw.cpu.cores"] == "0" and "memory_gb" in flat["hw.gpus"]
    m = metrics_of({"records": [{"name": "a", "value": 1.0, "m": 1, "bound": 4.0, "fraction_of_bound": 0.25},
                                {"name": "a", "value": 2.0, "m": 2}, {"name": "b", "value": 3.0},
                                {"name": "b", "value": 4.0}]})
    assert m == {"a.m1": 1.0, "a.m1.of_bound": 0.25, "a.m1.bound": 4.0, "a.m2": 2.0, "b": 3.0, "b.2": 4.0}
    assert metrics_of({"ttft_s": 0.1, "text": "x", "new_tokens": 3, "ok": True}) == {"ttft_s": 0.1, "new_tokens": 3}


def _hybrid(*args: str, runs: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRID_RUNS_DIR": str(runs), "HYBRID_TRACKING": "1"}
    return subprocess.run([sys.executable, "-m", "hybrid", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_generate_run_is_tracked(mlflow_runs, tmp_path):
    """(Bench runs are tracked the same way: the tuner's trials, tests/tuner/test_failures.py.)"""
    from mlflow.tracking import MlflowClient

    p = _hybrid("max_new_tokens=3", "output=json", "tracking.experiment=test-runs", runs=mlflow_runs)
    assert p.returncode == 0, p.stderr
    assert "tracked: MLflow run" in p.stderr
    c = MlflowClient(f"sqlite:///{mlflow_runs / 'mlflow.db'}")
    exp = c.get_experiment_by_name("test-runs")
    assert exp.artifact_location == (mlflow_runs / "mlartifacts" / "test-runs").resolve().as_uri()
    (r,) = c.search_runs([exp.experiment_id])
    assert r.info.status == "FINISHED" and r.data.tags["mode"] == "generate"
    assert r.data.params["model.name"] == "tiny" and r.data.params["hw.name"] == "auto"
    assert r.data.params["policy.cpu.gemm_tile_tokens"] == "None" and int(r.data.params["hw.cpu.cores"]) >= 1
    assert int(r.data.params["plan.cpu.gemm_tile_tokens"]) in (16, 64)
    # the resolved plan beside the policy: what the nulls became
    assert r.data.params["plan.device"] == "cpu" and int(r.data.params["plan.cpu.threads"]) >= 1
    assert r.data.params["plan.cpu.kernel"] in ("amx", "avx512_bf16", "avx512", "avx2", "generic")
    assert {"ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s"} <= set(r.data.metrics)
    files = {a.path for a in c.list_artifacts(r.info.run_id)}
    plots = {a.path for a in c.list_artifacts(r.info.run_id, "plots")}
    assert {"config.yaml", "report.json"} <= files and "plots/report_card.png" in plots
    config = Path(c.download_artifacts(r.info.run_id, "config.yaml", str(tmp_path))).read_text()
    assert "max_new_tokens: 3" in config and "${" not in config, "the resolved config"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@pytest.mark.slow
def test_mlflow_ui_answers_and_stops(mlflow_runs):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hybrid.tracking", "ui", "--port", str(port), "--uri",
                             f"sqlite:///{mlflow_runs / 'mlflow.db'}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline, status, page = time.monotonic() + 120, None, ""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                    status, page = r.status, r.read().decode(errors="replace")
                break
            except OSError:
                time.sleep(0.5)
        assert status == 200 and "mlflow" in page.lower(), proc.stdout.read() if proc.poll() is not None else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        # the server (and its workers) runs in its own process group: find it through the listening child
        server_pgids = {int(stat.read_text().rsplit(")", 1)[1].split()[2]) for stat in Path("/proc").glob("[0-9]*/stat")
                        if _ppid(stat) == proc.pid}
        assert server_pgids and proc.pid not in server_pgids, "mlflow runs in a process group of its own"
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does to `make ui`
        proc.wait(timeout=60)
    assert proc.returncode == 0
    t0 = time.monotonic()
    while any(_group_alive(g) for g in server_pgids) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    assert not any(_group_alive(g) for g in server_pgids), "no mlflow worker outlives the UI"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def _ppid(stat: Path) -> int:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
