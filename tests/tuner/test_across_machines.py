"""Tuners on several machines share one study in PostgreSQL and log to one MLflow server. The tests start a
PostgreSQL of their own (pgserver: the server's binaries from a wheel; skipped where it cannot start) and run the
tuners as processes of this machine, each with its own trial worker: the planned trials split between them, each
run once; a tuner killed mid-trial has that trial failed by its heartbeat and run again by the other; the tuners'
runs land in one experiment of one `mlflow server`. A bad storage URL, or a database or tracking server that does
not answer, is one line naming its knob. The fixtures `postgres` and `database`: tests/tuner/conftest.py."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hybrid.process import stop_group
from tests.tuner.conftest import FAST, FAULTY, NO_RELOAD, alive, database, env_for, load, start_tuner, tune

# Four distinct points (the current policy and three others), so four trials differ whatever TPE would sample.
ENQUEUE = "tuner.enqueue=[{cpu: {gemm_tile_tokens: 8}}, {cpu: {gemm_tile_tokens: 16}}, {cpu: {gemm_tile_tokens: 32}}]"


def storage_arg(url: str) -> str:
    return f"tuner.storage='{url}'"  # quoted: the URL holds '='


# ----------------------------------------------------------------------------------------------- clear errors

def test_a_bad_storage_url_is_one_line_naming_the_knob(conf, tuner_runs):
    p = tune(*FAST, "tuner.storage=postgres://u:secret@127.0.0.1/db", env=env_for(conf, tuner_runs), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = [x for x in p.stderr.splitlines() if x.strip()]
    assert line.startswith("error: tuner.storage: postgres://u:***@127.0.0.1/db is no database URL"), line


def test_an_unreachable_database_or_tracking_server_is_one_line_naming_the_knob(conf):
    from hybrid.errors import ConfigError
    from hybrid.tracking import check_server
    from tests.tuner.test_study_race import _tune_cfg
    from tuner.storage import open_study

    with pytest.raises(ConfigError, match=r"^tracking.uri: no MLflow server answers at http://127.0.0.1:\d+ "):
        check_server(f"http://127.0.0.1:{_free_port()}")
    pytest.importorskip("psycopg")
    url = f"postgresql+psycopg://u:secret@127.0.0.1:{_free_port()}/db"
    with pytest.raises(ConfigError) as e:
        open_study(_tune_cfg(conf), "s", url, {}, ["maximize"], 2)
    assert str(e.value).startswith("tuner.storage: cannot open postgresql+psycopg://u:***@127.0.0.1:")
    assert "\n" not in str(e.value) and "secret" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------ tuners on one study

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(request, tmp_path):
    """`mlflow server` on a free port of 127.0.0.1: its store a database of the tests' PostgreSQL (sqlite where
    that does not start), artifacts in tmp_path; skipped where it does not answer within two minutes."""
    try:
        store = database(request.getfixturevalue("postgres"))
    except pytest.skip.Exception:
        store = f"sqlite:///{tmp_path / 'mlflow-server.db'}"
    port = _free_port()
    log = tmp_path / "mlflow-server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store,
           "--artifacts-destination", str(tmp_path / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"mlflow server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield uri
    finally:
        stop_group(proc, grace_s=5.0)


def _lines(log: Path, pattern: str) -> set[int]:
    return set(map(int, re.findall(pattern, log.read_text(), re.M)))


@pytest.mark.slow
def test_two_tuners_split_a_postgresql_study_and_log_to_one_mlflow_server(postgres, mlflow_server, conf,
                                                                         tuner_runs, tmp_path):
    url = database(postgres)
    args = [*FAST, *NO_RELOAD, ENQUEUE, "tuner.n_trials=4", storage_arg(url), "tuner.study_name=shared",
            "tuner.write_policy=false", f"tracking.uri={mlflow_server}", "tracking.experiment=shared"]
    env = env_for(conf, tuner_runs, HYBRID_TRACKING="1")
    logs = [tmp_path / "tuner-1.log", tmp_path / "tuner-2.log"]
    t0 = time.monotonic()
    procs = [start_tuner(*args, env=env, out=log) for log in logs]
    for p in procs:
        p.wait(timeout=600)
    text = [log.read_text() for log in logs]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(text)
    print(f"two tuners, 4 trials on PostgreSQL, MLflow server: {time.monotonic() - t0:.1f} s")

    trials = load(url, "shared").get_trials()
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 4 and len(trials) == 4, [(t.number, t.state.name) for t in trials]
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 4, "no point measured twice"
    mine = [_lines(log, r"^trial (\d+) COMPLETE") for log in logs]
    assert mine[0] and mine[1] and not mine[0] & mine[1], mine  # split between them, none run by both
    assert mine[0] | mine[1] == {t.number for t in complete}

    from mlflow.tracking import MlflowClient

    c = MlflowClient(mlflow_server)
    runs = c.search_runs([c.get_experiment_by_name("shared").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("kind") == "study"]
    children = {r.info.run_id: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children.values())
    by_worker = {t.user_attrs["worker"] for t in complete if t.user_attrs["mlflow_run_id"] in children}
    assert len(by_worker) == 2, "both tuners logged their trials to the one server"
    assert "config.yaml" in {a.path for a in c.list_artifacts(next(iter(children)))}


@pytest.mark.slow
def test_a_killed_tuners_trial_is_failed_by_its_heartbeat_and_run_by_the_other(postgres, conf, tuner_runs, tmp_path):
    url = database(postgres)
    args = [*FAST, *NO_RELOAD, FAULTY, ENQUEUE, "tuner.n_trials=4", storage_arg(url), "tuner.study_name=killed",
            "tuner.heartbeat_s=1", "tuner.grace_s=3", "tuner.write_policy=false"]
    hang = ",".join(f"{i}:hang" for i in range(8))  # whichever trial the first tuner takes hangs
    first, second = tmp_path / "killed.log", tmp_path / "survivor.log"
    t0 = time.monotonic()
    a = start_tuner(*args, env=env_for(conf, tuner_runs, HYBRID_TEST_INJECT_FAULT=hang), out=first)
    b = start_tuner(*args, env=env_for(conf, tuner_runs), out=second)
    try:
        deadline = time.monotonic() + 180
        while not _lines(first, r"^trial (\d+) \[") and time.monotonic() < deadline and a.poll() is None:
            time.sleep(0.2)
        (hung,) = _lines(first, r"^trial (\d+) \[") or {None}
        assert hung is not None, first.read_text()
        time.sleep(1.0)  # its worker is in the trial (hanging)
        a.send_signal(signal.SIGKILL)
        a.wait()
        b.wait(timeout=600)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert b.returncode == 0, second.read_text()
    print(f"a tuner killed, its trial run by the other: {time.monotonic() - t0:.1f} s")

    trials = load(url, "killed").get_trials()
    failed = trials[hung]
    assert failed.state.name == "FAIL" and not alive(failed.user_attrs["pid"]), "failed once stale; its worker gone"
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 4 and len({tuple(sorted(t.params.items())) for t in complete}) == 4
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == hung]
    assert retry.state.name == "COMPLETE" and retry.params == failed.params
    assert retry.user_attrs["worker"] != failed.user_attrs["worker"], "run again by the other tuner"
    assert f"retry of trial {hung}" in second.read_text()
