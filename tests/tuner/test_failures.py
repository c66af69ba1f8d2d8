"""A crashing trial and one over its deadline are recorded as failed (the trial worker started again after each)
and the sweep goes on; every trial is an MLflow child run of the study's run (the shared tracking store of the
session)."""
from __future__ import annotations

from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from tests.tuner.conftest import FAST, FAULTY, alive, ensure_tiny, env_for, load, tune


def test_crash_and_deadline_fail_the_trial_not_the_sweep(conf, mlflow_runs, tmp_path):
    ensure_tiny(mlflow_runs)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    env = env_for(conf, mlflow_runs, HYBRID_TRACKING="1", HYBRID_TEST_INJECT_FAULT="0:crash,1:hang")
    # the deadline leaves a normal trial (a worker's start-up, the tiny model, the workload: ~6 s here) ample margin
    # on a loaded machine; the hung trial is killed when it passes
    p = tune(*FAST, FAULTY, "tuner.n_trials=3", f"tuner.storage={storage}", "tuner.study_name=failures",
             "tuner.trial_timeout_s=20", "tracking.experiment=test-failures", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    trials = load(storage, "failures").get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "COMPLETE"], p.stdout
    assert trials[0].user_attrs["failure"] == "crash" and "injected crash" in trials[0].user_attrs["detail"]
    assert trials[1].user_attrs["failure"] == "deadline"
    assert not alive(trials[1].user_attrs["pid"]), "the hung trial was killed"
    assert trials[2].values[0] > 0 and trials[2].user_attrs["metrics"]["ttft_p90_s"] > 0
    assert trials[2].user_attrs["model"] == "loaded", "a fresh worker after the deadline"
    assert "trial 0 FAIL" in p.stdout and "crash: RuntimeError" in p.stdout and "deadline" in p.stdout
    assert (conf / "policy" / "cpu_only.yaml").exists(), "the one complete trial becomes the policy"

    c = MlflowClient(f"sqlite:///{mlflow_runs / 'mlflow.db'}")
    exp = c.get_experiment_by_name("test-failures")
    assert exp.artifact_location.startswith((mlflow_runs / "mlartifacts").as_uri())
    runs = c.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "study"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    children = {int(r.data.tags["optuna.trial"]): r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent}
    assert sorted(children) == [0, 1, 2]
    assert [children[n].info.status for n in (0, 1, 2)] == ["FAILED", "FAILED", "FINISHED"]
    assert children[1].data.tags["outcome"] == "deadline" and "policy.cpu.threads" in children[1].data.params
    ok = children[2]
    assert {"ttft_s", "ttft_p90_s", "tpot_p90_s", "goodput_req_s", "objective.goodput_req_s",
            "trial.seconds"} <= set(ok.data.metrics)
    assert ok.data.params["hw.name"] == "cpu_only" and ok.data.params["model.name"] == "tiny"
    assert {"policy.cpu.threads", "policy.cpu.moe_backend", "hw.cpu.cores", "run.threads"} <= set(ok.data.params)
    files = {a.path for a in c.list_artifacts(ok.info.run_id)} | {a.path for a in c.list_artifacts(ok.info.run_id,
                                                                                                       "plots")}
    assert {"config.yaml", "report.json", "plots/report_card.png", "trial-0002.log"} <= files, files
    config = Path(c.download_artifacts(ok.info.run_id, "config.yaml", str(tmp_path))).read_text()
    assert "requests: 4" in config and "name: cpu_only" in config
    assert "threads" in yaml.safe_load(config)["policy"]["cpu"]
    plots = {a.path for a in c.list_artifacts(parent, "plots")}
    assert {"plots/optimization_history.png", "plots/pareto_front.png", "plots/objective_vs_knobs.png"} <= plots
    assert "best_policy.yaml" in {a.path for a in c.list_artifacts(parent)}


def test_a_policy_the_schema_refuses_fails_its_trial_and_is_logged(conf, mlflow_runs, tmp_path):
    """kv.max_batch 2 is a valid value, but not beside the policy's batch cap of 6: the trial is refused (by the
    worker, and again when the tuner logs its policy), the study goes on and ends cleanly."""
    ensure_tiny(mlflow_runs)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    p = tune(*FAST, "+tuner.spaces.cpu_only.kv.max_batch={type: categorical, choices: [2]}", "tuner.n_trials=1",
             f"tuner.storage={storage}", "tuner.study_name=refused", "tracking.experiment=test-refused",
             env=env_for(conf, mlflow_runs, HYBRID_TRACKING="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    [t] = load(storage, "refused").get_trials()
    assert t.state.name == "FAIL" and "exceeds policy.kv.max_batch" in t.user_attrs["detail"], t.user_attrs
    c = MlflowClient(f"sqlite:///{mlflow_runs / 'mlflow.db'}")
    [child] = [r for r in c.search_runs([c.get_experiment_by_name("test-refused").experiment_id])
               if r.data.tags.get("mlflow.parentRunId")]
    assert child.data.params["policy.kv.max_batch"] == "2" and child.info.status == "FAILED"
