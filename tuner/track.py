"""The study in MLflow: one parent run per study (resumed by every worker and every restart, its id kept in the
study's user attributes), one child run per trial (the trial's subprocess logs params, metrics, the resolved config
and plots into it; the tuner adds the trial's state and objective), and at the end the study's plots: optimisation
history, parameter importances, the Pareto front (TTFT against TPOT)."""
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
            if PARENT_ATTR not in _fresh_user_attrs(study):
                study.set_user_attr(PARENT_ATTR, mine)
            run_id = _fresh_user_attrs(study)[PARENT_ATTR]
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

    def finish_child(self, run_id: Optional[str], trial, outcome, params: dict[str, str],
                     objective: dict[str, float], best: Optional[float], log_path) -> None:
        if run_id:
            self._guard("child run", self._finish_child, run_id, trial, outcome, params, objective, best,
                        log_path)

    def _finish_child(self, run_id, trial, outcome, params, objective, best, log_path) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        c = self.client
        logged = c.get_run(run_id).data.params
        missing = [Param(f"policy.{k}", v) for k, v in params.items() if f"policy.{k}" not in logged]
        tags = [RunTag("optuna.state", trial["state"]), RunTag("outcome", outcome.status),
                RunTag("feasible", str(trial["feasible"]).lower())]
        metrics = [Metric(f"objective.{k}", v, now, 0) for k, v in objective.items()]
        metrics.append(Metric("trial.seconds", outcome.seconds, now, 0))
        if outcome.status != "ok":  # the subprocess logged nothing: its metrics, as far as they got
            metrics += [Metric(k, v, now, 0) for k, v in outcome.metrics.items()]
        c.log_batch(run_id, metrics=metrics, params=missing, tags=tags)
        if log_path is not None and log_path.exists():
            c.log_artifact(run_id, str(log_path))
        c.set_terminated(run_id, "FINISHED" if outcome.status == "ok" else "FAILED")
        # the parent's progress: one point per trial
        parent_metrics = [Metric(f"trial.{k}", v, now, trial["number"]) for k, v in objective.items()]
        if best is not None:
            parent_metrics.append(Metric("best", best, now, trial["number"]))
        parent_metrics.append(Metric("trial.ok", 1.0 if outcome.status == "ok" else 0.0, now, trial["number"]))
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


def _fresh_user_attrs(study) -> dict:
    return study._storage.get_study_user_attrs(study._study_id)
