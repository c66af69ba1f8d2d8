"""Helpers for the tuner's tests: `python -m tuner` as a user runs it, on a copy of conf/ (the tuner writes
conf/policy/<hw>.yaml and edits conf/hw/<hw>.yaml) and a runs/ directory of the test's own."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from hybrid.config.compose import CONF_DIR
from tests.conftest import model_spec
from tests.tuner.faulty_bench import FAULT_ENV, MODULE

# Small trials: the tiny model, a small workload (and for decode_tok_s a short prompt, few tokens, one pass, no
# read-roof probe). A trial worker starts in ~3-5 s (interpreter, imports, the model); a trial on it then takes ~1 s.
FAST = ["+hw=cpu_only", "model=tiny", "workload.requests=4", "workload.prompt_tokens=[8,24]",
        "workload.output_tokens=[2,6]", "workload.concurrency=2", "bench.prompt_tokens=16", "bench.new_tokens=4",
        "bench.repeats=1", "bench.roof_gb=0"]
# Only knobs the worker changes without loading the model again: one worker for the whole study.
NO_RELOAD = ["~tuner.spaces.cpu_only.cpu.moe_backend", "~tuner.spaces.cpu_only.cpu.kernel",
             "~tuner.spaces.cpu_only.cpu.numa"]
# Trials through tests/tuner/faulty_bench.py: a fault injected where HYBRID_TEST_INJECT_FAULT says, else the worker.
FAULTY = f"tuner.trial_module={MODULE}"
ROOT = Path(__file__).resolve().parents[2]


def ensure_tiny(runs: Path) -> None:
    """The tiny checkpoint under runs/models before any trial: concurrent trials must not all generate it."""
    from hybrid.weights.synthetic import ensure_checkpoint

    ensure_checkpoint(runs / "models", "tiny", model_spec("tiny"), 0)


@pytest.fixture(scope="session")
def tuner_runs(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("tuner_runs")
    ensure_tiny(runs)
    return runs


@pytest.fixture
def conf(tmp_path) -> Path:
    dst = tmp_path / "conf"
    shutil.copytree(CONF_DIR, dst)
    return dst


def env_for(conf: Path, runs: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # tests/ importable
    env = {**os.environ, "HYBRID_CONF_DIR": str(conf), "HYBRID_RUNS_DIR": str(runs), "PYTHONPATH": path}
    env.pop(FAULT_ENV, None)
    env.update(extra)
    return env


def tune(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def start_tuner(*args: str, env: dict[str, str], out: Path) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "tuner", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                text=True)


def load(storage: str, name: str):
    import optuna

    return optuna.load_study(study_name=name, storage=storage)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session; `database(server)` makes a fresh database and returns its URL."""
    pgserver = pytest.importorskip("pgserver", reason="pgserver (the test extra) starts PostgreSQL")
    pytest.importorskip("psycopg", reason="psycopg (the test extra) is the driver")
    home = tempfile.mkdtemp(prefix="pg", dir="/tmp")  # short: a unix socket path has a small length limit
    try:
        server = pgserver.get_server(home, cleanup_mode="delete")
    except Exception as e:  # noqa: BLE001 - no PostgreSQL here: skip, naming why
        shutil.rmtree(home, ignore_errors=True)
        pytest.skip(f"PostgreSQL (pgserver) does not start here: {type(e).__name__}: {e}")
    yield server
    server.cleanup()


def database(server) -> str:
    name = f"t{uuid.uuid4().hex[:12]}"
    server.psql(f"CREATE DATABASE {name};")
    return server.get_uri(name).replace("postgresql://", "postgresql+psycopg://", 1)
