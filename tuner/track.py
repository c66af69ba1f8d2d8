"""The study in MLflow: one parent run per study (resumed by every tuner and every restart, its id kept in the
study's user attributes), one child run per trial (params, metrics, the resolved config, the report, plots and the
trial's log, as the trial worker measured them; the trial's state and objective), and at the end the study's plots
on the parent run: optimisation history, parameter importances, the objective against each knob, the Pareto front
(TTFT against TPOT), the crossover of the two prefill paths."""
from __future__ import annotations

import sys
import time
from typing import Any, Optional

from hybrid import tracking
from hybrid.config.schema import TrackingConfig

PARENT_ATTR = "mlflow_parent_run_id"


class StudyTracker:
    """Does nothing when tracking is disabled; a failing store is reported once and then ignored."""

    def __init__(self, t: TrackingConfig, experiment: str, enabled: bool):
        self.t, self.experiment, self.enabled = t, experiment, enabled
        self.client = self.exp_id = self.parent = None

    def _guard(self, what: str, fn, *args, **kwargs) -> Any:
        if not self.enabled:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking never stops the study
            print(f"warning: tracking ({what}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return None

    # ----------------------------------------------------------------------------------------------- parent
    def start(self, study, params: dict[str, str]) -> Optional[str]:
        return self._guard("parent run", self._start, study, params)

    def _start(self, study, params: dict[str, str]) -> str:
        from mlflow.entities import Param

        self.client = tracking.client(self.t)
        self.exp_id = tracking.ensure_experiment(self.client, self.t, self.experiment)
        run_id = study.user_attrs.get(PARENT_ATTR)
        if run_id is None:
            mine = self.client.create_run(self.exp_id, run_name=study.study_name, tags={
                "optuna.study": study.study_name, "kind": "study"}).info.run_id
            # Several workers may start together: the first id stored wins, the others drop theirs.
            if PARENT_ATTR not in fresh_user_attrs(study):
                study.set_user_attr(PARENT_ATTR, mine)
            run_id = fresh_user_attrs(study)[PARENT_ATTR]
            if run_id != mine:
                self.client.delete_run(mine)
            else:
                self.client.log_batch(mine, params=[Param(k, v[:6000]) for k, v in params.items()])
        self.client.update_run(run_id, status="RUNNING")
        self.parent = run_id
        return run_id

    # ------------------------------------------------------------------------------------------------ trials
    def child(self, trial_number: int, study_name: str) -> Optional[str]:
        if not self.parent:
            return None
        return self._guard("child run", lambda: self.client.create_run(
            self.exp_id, run_name=f"trial-{trial_number}",
            tags={"mlflow.parentRunId": self.parent, "optuna.study": study_name,
                  "optuna.trial": str(trial_number), "kind": "trial"}).info.run_id)

    def finish_child(self, run_id: Optional[str], trial: dict, outcome, params: dict[str, str],
                     objective: dict[str, float], best: Optional[float], log_path, config_yaml: str,
                     title: str) -> None:
        """The trial's run, as the worker measured it: params (the trial's policy, hw, model, what it measured, the
        plan), metrics, the trial's state and objective, the resolved config, the report, plots and the log."""
        if run_id:
            self._guard("child run", self._finish_child, run_id, trial, outcome, params, objective, best,
                        log_path, config_yaml, title)

    def _finish_child(self, run_id, trial, outcome, params, objective, best, log_path, config_yaml, title) -> None:
        import json

        import matplotlib.pyplot as plt
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        c = self.client
        plan = {f"plan.{k}": str(v)[:6000] for k, v in outcome.report.get("plan", {}).items()}
        run_params = [Param(tracking._safe_key(k), v) for k, v in {**params, **plan}.items()]
        tags = [RunTag("optuna.state", trial["state"]), RunTag("outcome", outcome.status),
                RunTag("feasible", str(trial["feasible"]).lower())]
        figures = {**tracking.metrics_of(outcome.report), **outcome.metrics} if outcome.records else outcome.metrics
        metrics = [Metric(tracking._safe_key(k), v, now, 0) for k, v in figures.items()]
        metrics += [Metric(f"objective.{k}", v, now, 0) for k, v in objective.items()]
        metrics += [Metric(f"trial.{k}", v, now, 0) for k, v in (
            ("seconds", outcome.seconds), ("build_s", outcome.build_s), ("measure_s", outcome.measure_s),
            ("worker_builds", float(outcome.builds)), ("worker_started", float(outcome.started)))]
        for i in range(0, max(len(run_params), len(metrics)), 100):
            c.log_batch(run_id, metrics=metrics[i:i + 100], params=run_params[i:i + 100],
                        tags=tags if i == 0 else [])
        c.log_text(run_id, config_yaml, "config.yaml")
        if outcome.report:
            c.log_text(run_id, json.dumps(outcome.report, indent=1, default=str), "report.json")
            for name, fig in tracking.plots(outcome.report, title).items():
                c.log_figure(run_id, fig, f"plots/{name}.png")
                plt.close(fig)
        if log_path is not None and log_path.exists():
            c.log_artifact(run_id, str(log_path))
        c.set_terminated(run_id, "FINISHED" if outcome.status == "ok" else "FAILED")
        # the parent's progress: one point per trial
        parent_metrics = [Metric(f"trial.{k}", v, now, trial["number"]) for k, v in objective.items()]
        if best is not None:
            parent_metrics.append(Metric("best", best, now, trial["number"]))
        parent_metrics.append(Metric("trial.ok", 1.0 if outcome.status == "ok" else 0.0, now, trial["number"]))
        parent_metrics.append(Metric("trial.seconds", outcome.seconds, now, trial["number"]))
        c.log_batch(self.parent, metrics=parent_metrics)

    # ---------------------------------------------------------------------------------------------- the end
    def finish(self, study, summary: dict[str, float], figures: dict[str, Any], texts: dict[str, str],
               status: str = "FINISHED") -> None:
        if self.parent:
            self._guard("study artifacts", self._finish, study, summary, figures, texts, status)

    def _finish(self, study, summary, figures, texts, status) -> None:
        from mlflow.entities import Metric

        import matplotlib.pyplot as plt

        now = int(time.time() * 1000)
        c = self.client
        c.log_batch(self.parent, metrics=[Metric(k, v, now, 0) for k, v in summary.items()])
        for name, fig in figures.items():
            c.log_figure(self.parent, fig, f"plots/{name}.png")
            plt.close(fig)
        for name, text in texts.items():
            c.log_text(self.parent, text, name)
        c.set_terminated(self.parent, status)


def fresh_user_attrs(study) -> dict:
    return study._storage.get_study_user_attrs(study._study_id)
