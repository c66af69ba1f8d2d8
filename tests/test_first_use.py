"""Several processes starting at once on a fresh runs/ (two replicas, two tuners, a run beside a tuner): the
generated checkpoint is written once and reused by the others, the MLflow sqlite store is created once, benchmark
records and Hydra run directories get a name per process."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.at_once import at_once

# Spawned processes import this module to find their function: only light imports here, the rest inside them.
ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())["synthetic"]


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _ensure_tiny(root: str) -> tuple[str, bool]:
    """ensure_checkpoint as hybrid.models calls it; whether this process generated it."""
    from hybrid.weights import synthetic

    generated = []
    write = synthetic._write
    synthetic._write = lambda *a, **k: generated.append(1) or write(*a, **k)
    try:
        path = synthetic.ensure_checkpoint(Path(root), "tiny", TINY, 0)
    finally:
        synthetic._write = write
    return str(path), bool(generated)


def test_checkpoint_generated_once_by_processes_starting_together(tmp_path):
    from hybrid.weights import synthetic

    results = at_once(_ensure_tiny, 3, str(tmp_path / "models"), warm=["hybrid.weights.synthetic"])
    assert all(status == "ok" for status, _ in results), "\n".join(str(v) for _, v in results)
    paths = {value[0] for _, value in results}
    assert len(paths) == 1 and sum(value[1] for _, value in results) == 1, results  # one generation, one checkpoint
    (path,) = map(Path, paths)
    assert not list(path.parent.glob("*.partial")), "no partial directory left"
    ref = synthetic.write_checkpoint(tmp_path / "ref" / "tiny", TINY, 0, progress=False)
    assert _digests(path) == _digests(ref), "the same files as one process alone writes"


def _track(db: str, artifacts: str) -> tuple[str, str]:
    from hybrid import tracking
    from hybrid.config.schema import TrackingConfig

    t = TrackingConfig(uri=f"sqlite:///{db}", artifact_root=artifacts)
    c = tracking.client(t)
    exp = tracking.ensure_experiment(c, t, "first-use")
    run = c.create_run(exp).info.run_id
    c.set_terminated(run)
    return exp, run


def test_mlflow_store_created_once_by_processes_starting_together(tmp_path):
    db = tmp_path / "runs" / "mlflow.db"
    results = at_once(_track, 3, str(db), str(tmp_path / "runs" / "mlartifacts"),
                      warm=["hybrid.tracking", "mlflow.tracking"])
    assert all(status == "ok" for status, _ in results), "\n".join(str(v) for _, v in results)
    assert len({value[0] for _, value in results}) == 1, "one experiment"
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{db}")
    runs = c.search_runs([c.get_experiment_by_name("first-use").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(value[1] for _, value in results)


def _save(directory: str) -> str:
    from hybrid.bench.records import Record, save

    return str(save([Record("x", 1.0, "s")], Path(directory), "kernels", {}))


def test_bench_records_saved_in_the_same_second_keep_their_own_files(tmp_path):
    results = at_once(_save, 4, str(tmp_path / "bench"), warm=["hybrid.bench.records"])
    assert all(status == "ok" for status, _ in results), results
    assert len({value for _, value in results}) == 4 and len(list((tmp_path / "bench").glob("*.json"))) == 4


@pytest.mark.slow
def test_two_runs_started_together_on_a_fresh_runs_dir(tmp_path):
    """What two replicas do on a fresh clone (`python -m hybrid mode=serve server.port=8101` and `8102`), with
    generate runs: both finish, one generated the checkpoint, each has its Hydra run directory and MLflow run."""
    runs = tmp_path / "runs"
    env = {**os.environ, "HYBRID_RUNS_DIR": str(runs), "HYBRID_TRACKING": "1"}
    cmd = [sys.executable, "-m", "hybrid", "max_new_tokens=2", "output=json", "tracking.experiment=together"]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    generated = [err for _, err in outs if "\ngenerating checkpoint" in "\n" + err]
    assert len(generated) == 1, [err for _, err in outs]
    run_dirs = list((runs / "hydra").glob("*/*"))
    assert len(run_dirs) == 2 and all((d / "cli.log").exists() for d in run_dirs), run_dirs
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    runs_found = c.search_runs([c.get_experiment_by_name("together").experiment_id])
    assert len(runs_found) == 2 and all(r.info.status == "FINISHED" for r in runs_found)
    print(f"two runs together: {time.monotonic() - t0:.1f} s")
