"""3-trial studies on +hw=cpu_only with the serving objectives, end to end as a user runs them: the workload driven
at the trial worker's engine, the Optuna study, the MLflow parent run with its plots and a child run per trial, the
policy written and composed by `+hw=cpu_only`. Only knobs that need no reload are searched: one worker, one model
load, for the whole study."""
from __future__ import annotations

import os
import subprocess
import sys

import yaml
from mlflow.tracking import MlflowClient

from tests.tuner.conftest import FAST, NO_RELOAD, env_for, load, tune


def _composed_policy(conf) -> dict:
    shown = subprocess.run([sys.executable, "-m", "hybrid", "+hw=cpu_only", "--cfg", "job"], capture_output=True,
                           text=True, env={**os.environ, "HYBRID_CONF_DIR": str(conf)}, timeout=120)
    return yaml.safe_load(shown.stdout)["policy"]


def test_goodput_study(conf, mlflow_runs, tuner_runs, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    env = env_for(conf, mlflow_runs, HYBRID_TRACKING="1")
    p = tune(*FAST, *NO_RELOAD, "tuner.n_trials=3", f"tuner.storage={storage}", "tuner.study_name=goodput",
             "tracking.experiment=test-goodput", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    trials = load(storage, "goodput").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3, p.stdout
    assert [t.user_attrs["model"] for t in trials] == ["loaded", "reused", "reused"], p.stdout
    assert {t.user_attrs["worker_builds"] for t in trials} == {1}, "the worker built one engine from the model"
    assert "the model was loaded 1 times (1 worker starts)" in p.stdout
    assert "cutoff: no GPU" in p.stdout
    best = max(trials, key=lambda t: t.values[0])
    policy = _composed_policy(conf)
    assert policy["cpu"]["threads"] == best.params["cpu.threads"]
    assert policy["cpu"]["gemm_tile_tokens"] == best.params["cpu.gemm_tile_tokens"]
    text = (conf / "policy" / "cpu_only.yaml").read_text()
    assert f"trial: {best.number}" in text and "goodput_req_s = " in text

    c = MlflowClient(f"sqlite:///{mlflow_runs / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("test-goodput").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("kind") == "study"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3 and all(r.info.status == "FINISHED" for r in children)
    assert {"goodput_req_s", "ttft_p90_s", "tpot_p90_s", "slo_attainment", "trial.seconds"} <= set(
        children[0].data.metrics)
    assert {"policy.decode.batch_cap", "workload.requests", "plan.decode.batch_cap"} <= set(children[0].data.params)
    plots = {a.path for a in c.list_artifacts(parent.info.run_id, "plots")}
    assert {"plots/objective_vs_knobs.png", "plots/pareto_front.png", "plots/optimization_history.png"} <= plots
    assert parent.data.metrics["trial.seconds.mean"] > 0 and parent.data.metrics["worker.starts"] == 1


def test_pareto_study(conf, tuner_runs, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    p = tune(*FAST, *NO_RELOAD, "tuner.objective=pareto", "tuner.n_trials=3", f"tuner.storage={storage}",
             "tuner.study_name=pareto", env=env_for(conf, tuner_runs))
    assert p.returncode == 0, p.stdout + p.stderr
    study = load(storage, "pareto")
    assert len(study.directions) == 2 and len(study.trials) == 3
    front = study.best_trials
    pick = max(front, key=lambda t: (t.user_attrs["metrics"]["goodput_req_s"], -t.number))
    assert f"best: trial {pick.number} " in p.stdout, "the policy: the front's point with the best goodput"
    assert _composed_policy(conf)["cpu"]["threads"] == pick.params["cpu.threads"]
    assert "(the feasible Pareto front's best goodput)" in (conf / "policy" / "cpu_only.yaml").read_text()
