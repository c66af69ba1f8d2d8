"""`python -m tuner +hw=cpu_only model=tiny tuner.n_trials=6` (the chat workload, goodput) finishes in a few minutes,
the MLflow store holds the study's run with 6 child runs (params, metrics, config, plots), and
`python -m hybrid +hw=cpu_only --cfg job` shows the written policy."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.tuner.conftest import ensure_tiny, env_for, load, tune


@pytest.mark.slow
def test_six_trials_end_to_end(conf, mlflow_runs, tmp_path):
    ensure_tiny(mlflow_runs)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    env = env_for(conf, mlflow_runs, HYBRID_TRACKING="1")
    t0 = time.monotonic()
    p = tune("+hw=cpu_only", "model=tiny", "tuner.n_trials=6", f"tuner.storage={storage}",
             "tracking.experiment=test-e2e", env=env, timeout=900)
    seconds = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert seconds < 300, f"{seconds:.0f} s"
    name = next(line.split()[1] for line in p.stdout.splitlines() if line.startswith("study "))
    study = load(storage, name)
    assert len(study.trials) == 6 and all(t.state.name == "COMPLETE" for t in study.trials)

    c = MlflowClient(f"sqlite:///{mlflow_runs / 'mlflow.db'}")
    exp = c.get_experiment_by_name("test-e2e")
    runs = c.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("kind") == "study"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 6
    for r in children:
        assert r.info.status == "FINISHED"
        assert {"policy.cpu.threads", "policy.cpu.gemm_tile_tokens", "policy.cpu.moe_backend", "policy.cpu.kernel",
                "hw.name", "model.name"} <= set(r.data.params)
        assert {"ttft_s", "ttft_p90_s", "tpot_p90_s", "goodput_req_s", "objective.goodput_req_s"} <= set(
            r.data.metrics)
        files = {a.path for a in c.list_artifacts(r.info.run_id)} | {
            a.path for a in c.list_artifacts(r.info.run_id, "plots")}
        assert {"config.yaml", "plots/report_card.png"} <= files
    plots = {a.path for a in c.list_artifacts(parent.info.run_id, "plots")}
    assert {"plots/optimization_history.png", "plots/param_importances.png", "plots/pareto_front.png",
            "plots/objective_vs_knobs.png"} <= plots
    assert parent.data.metrics["trials.complete"] == 6

    best = study.best_trial
    shown = subprocess.run([sys.executable, "-m", "hybrid", "+hw=cpu_only", "--cfg", "job"], capture_output=True,
                           text=True, env={**os.environ, "HYBRID_CONF_DIR": str(conf)}, timeout=120)
    policy = yaml.safe_load(shown.stdout)["policy"]
    assert {k: _at(policy, k) for k in best.params} == best.params, shown.stdout
    assert f"trial: {best.number}" in (conf / "policy" / "cpu_only.yaml").read_text()


def _at(tree: dict, path: str):
    """tree["cpu"]["threads"] for "cpu.threads": a knob of the policy by its path (the Optuna parameter's name)."""
    for part in path.split("."):
        tree = tree[part]
    return tree
