"""The tuning loop: an Optuna study in an RDB storage (sqlite under runs/ by default; several tuners share one through
any RDB URL), TPE warm-started with the current policy (or a grid), trials measured by one long-lived trial worker
that keeps the model loaded (tuner/trial.py, tuner/worker.py) with a deadline per trial, constraints through
`Trial.set_constraint`, an MLflow child run per trial, and at the end the best policy written as config.

On a GPU profile with a workload objective, policy.prefill.slp_cutoff_tokens is measured before the first trial
(`tuner.cutoff=measure`): the crossover of the two prefill paths' TTFT on the workload's prompt lengths, kept in
the study's user attributes and used by every trial.

Trials that count toward `tuner.n_trials`: complete ones (feasible or not) and those that failed on their own
(crash, deadline). A trial whose worker died (killed tuner, lost machine) stops sending heartbeats; after
`tuner.grace_s` it is failed and re-queued with the same parameters (Optuna's RetryHeartbeatStaleTrialCallback),
and does not count. A trial interrupted by Ctrl-C / SIGTERM is re-queued by the next start. Tuners sharing a study
take trials one at a time under the storage's lock and only while it lacks some: together they run exactly
`tuner.n_trials` (tuner/storage.py, SharedStudy).

Here the loop (`Tuner`); the storage and sampler: tuner/storage.py; the cutoff's measurement: tuner/cutoff.py; a
trial's MLflow params and config and the written policy: tuner/report.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any, Optional

from omegaconf import DictConfig

from hybrid import tracking
from hybrid.plan.plan import rebuildable
from hybrid.config.compose import RUNS_DIR, settings_of
from hybrid.errors import ConfigError
from tuner import plots, space as sp, trial as trial_run
from tuner.config import Cutoff, TuneConfig
from tuner.cutoff import CUTOFF, measured_crossover
from tuner.report import SHOWN, fmt, parent_params, trial_config, trial_params, write_policy
from tuner.storage import StudyFull, counted, open_study, redact, storage_url
from tuner.track import StudyTracker

# Overrides the tuner sets itself for the trial worker (the user's own are dropped from what it gets).
OWN_KEYS = ("mode", "bench", "output")
WORKER_OWN = ["mode=bench", "bench=slo", "tracking.enabled=false"]
# The TTFT / TPOT pair a study's Pareto plot draws, by what it measures
PAIRS = {"workload": ("ttft_p90_s", "tpot_p90_s"), "slo": ("ttft_s", "tpot_s")}


class TrialFailed(Exception):
    """A trial that crashed or missed its deadline: recorded as failed, the sweep goes on."""


def trial_overrides(task_overrides: list[str], space: dict) -> list[str]:
    """The command line's overrides that the trial worker gets: all but tuner.*, the keys the tuner sets itself, and
    the knobs it samples (`policy.<knob path>`)."""
    out = []
    for o in task_overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "tuner" or key.startswith("tuner.") or key in OWN_KEYS:
            continue
        if key.startswith("policy.") and key[len("policy."):] in space:
            continue
        out.append(o)
    return out


def feasible(t) -> bool:
    return all(v <= 0.0 for v in t.constraints.values())


class Tuner:
    def __init__(self, cfg_dc: DictConfig, task_overrides: list[str]):
        self.cfg: TuneConfig = settings_of(cfg_dc)
        cfg, t = self.cfg, self.cfg.tuner
        if cfg.hw.name == "auto":
            raise ConfigError("the tuner tunes the policy of a hardware profile: give +hw=NAME (conf/hw/), the "
                              "profile of this machine, e.g. +hw=cpu_only")
        from hybrid.hw.check import resolve
        from hybrid.hw.detect import detect
        from hybrid.kernels.dispatch import available

        self.machine = detect()
        hw, _ = resolve(cfg.hw, cfg.policy, self.machine)  # stops here when this machine is not the profile's
        self.gpu = bool(hw.gpus)  # which space: the profile's kind (as adapted to this machine)
        full = sp.resolve(cfg, self.gpu, self.machine.physical_cores, available())
        self.reload = sp.reload_knobs(cfg, self.gpu, rebuildable())
        self.measure_cutoff = (self.gpu and t.cutoff == Cutoff.measure and t.goal.measure == "workload"
                               and CUTOFF in full)
        self.space = {k: v for k, v in full.items() if not (self.measure_cutoff and k == CUTOFF)}
        if not self.space:
            raise ConfigError(f"tuner.spaces.{'gpu' if self.gpu else 'cpu_only'} is empty: nothing to tune")
        self.fixed: dict[str, Any] = {}  # knob -> value of every trial (the measured cutoff)
        self.crossover: Optional[dict] = None
        self.name = sp.study_name(cfg, self.space)
        self.url = storage_url(cfg)
        self.overrides = trial_overrides(task_overrides, full)
        self.metrics = sp.objective_metrics(cfg)
        self.directions = sp.directions(cfg)
        self.limits = sp.limits(cfg)
        self.tuner_id = f"{socket.gethostname()}:{os.getpid()}"
        self.log_dir = RUNS_DIR / "tuner" / self.name
        env = {k: v for k, v in os.environ.items() if k != tracking.RUN_ID_ENV}
        self.worker = trial_run.Worker(t.trial_module, [*self.overrides, *WORKER_OWN], env, self.log_dir)
        self.tracker = StudyTracker(cfg.tracking, tracking.experiment_name(cfg.tracking, cfg.model.name),
                                    cfg.tracking.enabled)
        self._pending: dict[int, tuple] = {}
        self.started = time.monotonic()

    # ------------------------------------------------------------------------------------------------ trials
    def key(self, params: dict[str, Any]) -> tuple[str, ...]:
        """What the trial worker's model was placed with: the values of the knobs that need a reload."""
        return tuple(f"{k}={sp.as_override_value(v)}" for k, v in sorted(params.items()) if k in self.reload)

    def objective(self, trial):
        t = self.cfg.tuner
        params = sp.suggest(trial, self.space)
        shown = {k: sp.as_override_value(v) for k, v in params.items()}
        trial.set_user_attr("worker", self.tuner_id)
        for k in ("failure", "detail", "pid"):  # a retried trial carries its predecessor's user attrs
            if k in trial.user_attrs:
                trial.set_user_attr(k, None)
        run_id = self.tracker.child(trial.number, self.name)
        if run_id:
            trial.set_user_attr("mlflow_run_id", run_id)
        log = self.log_dir / f"trial-{trial.number:04d}.log"
        done = counted(trial.study.get_trials(deepcopy=False))
        retry = _retry_of(trial)
        print(f"trial {trial.number} [{done + 1}/{t.n_trials}] "
              + " ".join(f"{k}={v}" for k, v in shown.items())
              + (f" (retry of trial {retry})" if retry is not None else "") + " ...", flush=True)
        self._pending[trial.number] = (None, params, run_id, log)
        request = {"op": "trial", "trial": trial.number, "policy": {**self.fixed, **params},
                   "measure": t.goal.measure}
        try:
            out = self.worker.run(self.key(params), request, t.trial_timeout_s, log,
                                  on_start=lambda pid: trial.set_user_attr("pid", pid))
        except BaseException:
            trial.set_user_attr("failure", "interrupted")
            raise
        self._pending[trial.number] = (out, params, run_id, log)
        trial.set_user_attr("outcome", out.status)
        trial.set_user_attr("seconds", round(out.seconds, 3))
        trial.set_user_attr("metrics", out.metrics)
        trial.set_user_attr("log", str(log))
        trial.set_user_attr("model", "loaded" if out.started else "reused")
        trial.set_user_attr("worker_builds", out.builds)
        if out.status == "ok":
            missing = [m for m in [*self.metrics, *self.limits] if m not in out.metrics]
            if missing:
                trial.set_user_attr("failure", "crash")
                trial.set_user_attr("detail", f"the trial reported no {', '.join(missing)}")
                raise TrialFailed(f"no {', '.join(missing)} in the trial's figures")
            for k, limit in self.limits.items():
                trial.set_constraint(k, out.metrics[k] - limit)
            trial.set_constraint("oom", -1.0)
            values = [out.metrics[m] for m in self.metrics]
            return values[0] if len(values) == 1 else values
        if out.status == "oom":  # infeasible: TPE learns to avoid the region
            for k in self.limits:
                trial.set_constraint(k, 0.0)
            trial.set_constraint("oom", 1.0)
            trial.set_user_attr("detail", out.detail[-2000:])
            values = [0.0 if d == "maximize" else t.trial_timeout_s for d in self.directions]
            return values[0] if len(values) == 1 else values
        trial.set_user_attr("failure", out.status)
        trial.set_user_attr("detail", out.detail[-2000:])
        raise TrialFailed(f"{out.status}: {trial_run.reason(out.detail)}")

    def after_trial(self, study, ft) -> None:
        """Progress on screen and in MLflow; stop once the study (all tuners together) has n_trials."""
        out, params, run_id, log = self._pending.pop(ft.number, (None, {}, None, None))
        state = ft.state.name
        ok = ft.state.name == "COMPLETE"
        feas = ok and feasible(ft) and ft.user_attrs.get("outcome") == "ok"
        m = ft.user_attrs.get("metrics", {})
        if ok:
            figures = ", ".join(f"{k} {fmt(m[k])}" for k in SHOWN if k in m)
            what = f"{'feasible' if feas else 'INFEASIBLE (' + ft.user_attrs.get('outcome', '') + ')'}: {figures}"
        else:
            what = f"{ft.user_attrs.get('failure') or 'failed'}: {trial_run.reason(ft.user_attrs.get('detail') or '')}"
        best = self.best(study)
        best_text = ""
        if best is not None:
            label = "best" if len(self.metrics) == 1 else f"Pareto front of {len(study.best_trials)}, best goodput"
            best_text = f" | {label}: trial {best.number} " + ", ".join(
                f"{k} {fmt(v)}" for k, v in zip(self.metrics, best.values))
        timing = "?"
        if out is not None:
            timing = (f"{out.seconds:.1f} s: model {'loaded' if out.started else 'reused'}"
                      + (f", engine {out.build_s:.2f} s, measured {out.measure_s:.1f} s" if out.status == "ok" else ""))
        print(f"trial {ft.number} {state} ({timing}) {what}{best_text}", flush=True)
        if out is not None:
            objective = {k: v for k, v in zip(self.metrics, ft.values)} if ok and ft.values else {}
            best_value = best.values[0] if best is not None and len(self.metrics) == 1 else None
            try:
                logged = trial_params(self.cfg, self.fixed, params, out)
                config = trial_config(self.cfg, self.fixed, params)
            except ValueError as e:  # a policy the schema refused (the trial failed on it): its knobs as sampled
                logged = {f"policy.{k}": str(v) for k, v in params.items()}
                config = f"# refused: {e}\n" + "".join(f"{k}: {v!r}\n" for k, v in params.items())
            self.tracker.finish_child(run_id, {"number": ft.number, "state": state, "feasible": feas}, out, logged,
                                      objective, best_value, log, config, f"trial {ft.number}: {self.cfg.model.name} "
                                      f"on {self.cfg.hw.name}")
        if counted(study.get_trials(deepcopy=False)) >= self.cfg.tuner.n_trials:
            study.stop()

    # --------------------------------------------------------------------------------------------- the best
    def candidates(self, study) -> list:
        from optuna.trial import TrialState

        return [t for t in study.get_trials(deepcopy=False)
                if t.state == TrialState.COMPLETE and feasible(t) and t.user_attrs.get("outcome") == "ok"]

    def best(self, study):
        cands = self.candidates(study)
        if not cands:
            return None
        if len(self.metrics) == 1:
            key = (lambda t: t.values[0]) if self.directions[0] == "minimize" else (lambda t: -t.values[0])
            return min(cands, key=lambda t: (key(t), t.number))
        front = {t.number for t in study.best_trials}
        on_front = [t for t in cands if t.number in front] or cands
        return max(on_front, key=lambda t: (t.user_attrs["metrics"].get("goodput_req_s", 0.0), -t.number))

    # ------------------------------------------------------------------------------------------------- cutoff
    def set_cutoff(self, study) -> None:
        """tuner.cutoff=measure: the measured crossover (tuner/cutoff.py) becomes every trial's cutoff."""
        cross = measured_crossover(self, study)
        if cross is not None:
            self.crossover = cross
            self.fixed[CUTOFF] = cross["cutoff"]

    # ---------------------------------------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own progress lines instead
        t = self.cfg.tuner
        if self.cfg.tracking.enabled:  # a server that does not answer: an error now, not a study without records
            tracking.check_server(tracking.tracking_uri(self.cfg.tracking))
        study = open_study(self.cfg, self.name, self.url, self.space, self.directions,
                           self.machine.physical_cores)
        done = counted(study.get_trials(deepcopy=False))
        print(f"study {self.name} ({redact(self.url)}): {done}/{t.n_trials} trials done; "
              f"objective {sp.objective_spec(self.cfg)}", flush=True)
        print("space: " + json.dumps(self.space), flush=True)
        print("reload (trial worker restarts): " + (", ".join(sorted(self.reload & set(self.space))) or "none"),
              flush=True)
        if self.overrides:
            print("trial worker gets: " + " ".join(self.overrides), flush=True)
        self.tracker.start(study, parent_params(self))
        status = "FINISHED"
        try:
            if done < t.n_trials:
                self.set_cutoff(study)
                study.optimize(self.objective, n_trials=t.n_trials - done, catch=(TrialFailed,),
                               callbacks=[self.after_trial])
        except StudyFull:  # the other tuners ran the trials still missing
            pass
        except KeyboardInterrupt:
            status = "KILLED"
            print(f"interrupted: {counted(study.get_trials(deepcopy=False))}/{t.n_trials} trials done; run the same "
                  "command again to resume", flush=True)
        finally:
            self.worker.stop()
        return self.finish(study, status)

    def finish(self, study, status: str) -> dict[str, Any]:
        from optuna.trial import TrialState

        t = self.cfg.tuner
        trials = study.get_trials(deepcopy=False)
        best = self.best(study)
        pair = PAIRS[t.goal.measure]
        measured = [(x.number, x.user_attrs["metrics"][pair[0]], x.user_attrs["metrics"][pair[1]],
                     feasible(x) and x.user_attrs.get("outcome") == "ok")
                    for x in trials if x.state == TrialState.COMPLETE
                    and set(pair) <= set(x.user_attrs.get("metrics", {}))]
        mine = [x for x in trials if x.user_attrs.get("worker") == self.tuner_id and "seconds" in x.user_attrs]
        summary = {"trials.complete": sum(x.state == TrialState.COMPLETE for x in trials),
                   "trials.failed": sum(x.state == TrialState.FAIL for x in trials),
                   "trials.feasible": len(self.candidates(study)),
                   "tuner.seconds": time.monotonic() - self.started,
                   "worker.starts": self.worker.starts}
        if mine:
            summary["trial.seconds.mean"] = sum(x.user_attrs["seconds"] for x in mine) / len(mine)
            print(f"time per trial: {summary['trial.seconds.mean']:.1f} s on average over {len(mine)} trials here; "
                  f"the model was loaded {sum(x.user_attrs.get('model') == 'loaded' for x in mine)} times "
                  f"({self.worker.starts} worker starts)", flush=True)
        result: dict[str, Any] = {"study": self.name, "storage": redact(self.url), "best_trial": None,
                                  "policy_path": None, **summary}
        texts: dict[str, str] = {}
        if best is not None:
            for k, v in zip(self.metrics, best.values):
                summary[f"best.{k}"] = v
            result.update(best_trial=best.number, best_params={**self.fixed, **best.params},
                          best_metrics=best.user_attrs.get("metrics", {}))
            print(f"best: trial {best.number} {result['best_params']} -> " + ", ".join(
                f"{k} {fmt(v)}" for k, v in best.user_attrs.get("metrics", {}).items()), flush=True)
            if t.write_policy and status == "FINISHED":
                path = write_policy(self, best)
                result["policy_path"] = str(path)
                texts["best_policy.yaml"] = path.read_text()
        else:
            print("no feasible trial: no policy written", flush=True)
        if self.tracker.parent:
            chosen = best.number if best else None
            figs = plots.figures(study, measured, chosen, self.limits, self.metrics, pair)
            if self.crossover is not None:
                from hybrid.bench.prefill import crossover_figure

                figs["crossover"] = crossover_figure(self.crossover["slp"], self.crossover["cpu"],
                                                     self.crossover["cutoff"], f"prefill TTFT, workload "
                                                     f"{self.cfg.workload.name}: cutoff {self.crossover['cutoff']}")
                texts["crossover.json"] = json.dumps(self.crossover, indent=1, default=str)
            try:
                texts["trials.csv"] = study.trials_dataframe().to_csv(index=False)
            except Exception:  # noqa: BLE001 - pandas missing or an odd attribute
                pass
            texts["study.json"] = json.dumps({**result, "space": self.space, "fixed": self.fixed,
                                              "objective": sp.objective_spec(self.cfg)}, indent=1, default=str)
            self.tracker.finish(study, summary, figs, texts, status)
            result["mlflow_run_id"] = self.tracker.parent
        print(f"{summary['trials.complete']} complete, {summary['trials.failed']} failed, "
              f"{summary['trials.feasible']} feasible in {self.name}"
              + (f"; MLflow run {self.tracker.parent} (make ui)" if self.tracker.parent else ""), flush=True)
        if status != "FINISHED":
            raise KeyboardInterrupt
        return result


def _retry_of(trial) -> Optional[int]:
    """The trial this one repeats: a heartbeat-stale one (Optuna's retry callback) or an interrupted one."""
    try:
        frozen = trial.study._storage.get_trial(trial._trial_id)
        number = frozen.system_attrs.get("failed_trial")
    except Exception:  # noqa: BLE001 - informational
        number = None
    return number if number is not None else trial.user_attrs.get("retry_of")


def install_sigterm() -> None:
    """SIGTERM ends the tuner like Ctrl-C: the running trial's process group is killed, the trial re-queued."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
