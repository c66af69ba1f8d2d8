"""The tuning loop: an Optuna study in an RDB storage (sqlite under runs/ by default; several workers share one through
any RDB URL), TPE warm-started with the current policy, one subprocess per trial with a deadline, constraints through
`Trial.set_constraint`, an MLflow child run per trial, and at the end the best policy written as config.

Trials that count toward `tuner.n_trials`: complete ones (feasible or not) and those that failed on their own
(crash, deadline). A trial whose worker died (killed tuner, lost machine) stops sending heartbeats; after
`tuner.grace_s` it is failed and re-queued with the same parameters (Optuna's RetryHeartbeatStaleTrialCallback),
and does not count. A trial interrupted by Ctrl-C / SIGTERM is re-queued by the next start.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig

from hybrid import tracking
from hybrid.config.compose import CONF_DIR, RUNS_DIR, settings_of
from hybrid.errors import ConfigError
from tuner import plots, policy as policy_file, space as sp, trial as trial_run
from tuner.config import TuneConfig, flat_params
from tuner.select import knee
from tuner.track import StudyTracker
from tuner.trial import TRIAL_ENV

COUNTED_FAILURES = ("crash", "deadline")
# Overrides the tuner sets itself for every trial (the user's own are dropped from what trials get).
OWN_KEYS = ("mode", "bench", "output")


class TrialFailed(Exception):
    """A trial that crashed or missed its deadline: recorded as failed, the sweep goes on."""


def storage_url(cfg: TuneConfig) -> str:
    return cfg.tuner.storage or f"sqlite:///{(RUNS_DIR / 'tuner.db').resolve()}"


def redact(url: str) -> str:
    """postgresql://user:secret@host/db -> postgresql://user:***@host/db"""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        if ":" in cred:
            cred = cred.split(":", 1)[0] + ":***"
        return f"{scheme}://{cred}@{host}"
    return url


def trial_overrides(task_overrides: list[str], space: dict) -> list[str]:
    """The command line's overrides that every trial gets: all but tuner.*, the keys the tuner sets itself, and the
    knobs it samples (`policy.<knob path>`)."""
    out = []
    for o in task_overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "tuner" or key.startswith("tuner.") or key in OWN_KEYS:
            continue
        if key.startswith("policy.") and key[len("policy."):] in space:
            continue
        out.append(o)
    return out


def counted(trials) -> int:
    from optuna.trial import TrialState

    return sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and t.user_attrs.get("failure") in COUNTED_FAILURES))


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
        resolve(cfg.hw, cfg.policy, self.machine)  # stops here when this machine is not the profile's
        if not t.space:
            raise ConfigError("tuner.space is empty: nothing to tune")
        self.space = sp.resolve(cfg, self.machine.physical_cores, available())
        self.name = sp.study_name(cfg, self.space)
        self.url = storage_url(cfg)
        self.overrides = trial_overrides(task_overrides, self.space)
        self.metrics = sp.objective_metrics(cfg)
        self.directions = sp.directions(cfg)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.log_dir = RUNS_DIR / "tuner" / self.name
        self.tracker = StudyTracker(cfg.tracking, tracking.experiment_name(cfg.tracking, cfg.model.name),
                                    cfg.tracking.enabled)
        self._pending: dict[int, tuple] = {}
        self.started = time.monotonic()

    # ------------------------------------------------------------------------------------------------ study
    def open_study(self):
        """Workers starting together on a fresh database race to create its tables: the loser retries."""
        from sqlalchemy.exc import IntegrityError, OperationalError

        for attempt in range(5):
            try:
                return self._open_study()
            except (IntegrityError, OperationalError):
                if attempt == 4:
                    raise
                time.sleep(1.0 + attempt)

    def _open_study(self):
        import optuna
        from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

        t = self.cfg.tuner
        tracking.ensure_sqlite_dir(self.url)
        engine_kwargs = {"connect_args": {"timeout": 60}} if self.url.startswith("sqlite") else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # heartbeat_interval is "experimental"
            storage = RDBStorage(self.url, engine_kwargs=engine_kwargs, heartbeat_interval=t.heartbeat_s,
                                 grace_period=t.grace_s,
                                 heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(t.max_retry))
        sampler = optuna.samplers.TPESampler(n_startup_trials=t.startup_trials, seed=t.seed)
        study = optuna.create_study(study_name=self.name, storage=storage, sampler=sampler,
                                    directions=self.directions, load_if_exists=True)
        if study.directions != [optuna.study.StudyDirection[d.upper()] for d in self.directions]:
            raise ConfigError(f"study {self.name} exists with directions {study.directions}: give another "
                              "tuner.study_name")
        if "space" not in study.user_attrs:
            study.set_user_attr("space", self.space)
            study.set_user_attr("objective", sp.objective_spec(self.cfg))
            study.set_user_attr("hw", self.cfg.hw.name)
            study.set_user_attr("model", self.cfg.model.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optuna.storages.fail_stale_trials(study)  # a killed worker's trial: failed, re-queued
        self._requeue_interrupted(study)
        warm = sp.warm_start(self.cfg, self.space, self.machine.physical_cores)
        if warm:
            study.enqueue_trial(warm, user_attrs={"source": "current policy"}, skip_if_exists=True)
        for extra in t.enqueue:
            params = sp.in_space(flat_params(extra), self.space)
            if params:
                study.enqueue_trial(params, user_attrs={"source": "tuner.enqueue"}, skip_if_exists=True)
        return study

    def _requeue_interrupted(self, study) -> None:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        retried = {t.user_attrs.get("retry_of") for t in trials}
        for t in trials:
            if (t.state == TrialState.FAIL and t.user_attrs.get("failure") == "interrupted"
                    and t.number not in retried and t.params):
                study.enqueue_trial(t.params, user_attrs={"retry_of": t.number, "source": "interrupted trial"})

    # ------------------------------------------------------------------------------------------------ trials
    def objective(self, trial):
        t = self.cfg.tuner
        params = sp.suggest(trial, self.space)
        shown = {k: sp.as_override_value(v) for k, v in params.items()}
        trial.set_user_attr("worker", self.worker)
        for k in ("failure", "detail", "pid"):  # a retried trial carries its predecessor's user attrs
            if k in trial.user_attrs:
                trial.set_user_attr(k, None)
        run_id = self.tracker.child(trial.number, self.name)
        if run_id:
            trial.set_user_attr("mlflow_run_id", run_id)
        env = {**os.environ, TRIAL_ENV: str(trial.number)}
        if run_id:
            env[tracking.RUN_ID_ENV] = run_id
        else:
            env.pop(tracking.RUN_ID_ENV, None)
        log = self.log_dir / f"trial-{trial.number:04d}.log"
        cmd = trial_run.command(self.overrides, shown, t.trial_module)
        done = counted(trial.study.get_trials(deepcopy=False))
        retry = _retry_of(trial)
        print(f"trial {trial.number} [{done + 1}/{t.n_trials}] "
              + " ".join(f"{k}={v}" for k, v in shown.items())
              + (f" (retry of trial {retry})" if retry is not None else "") + " ...", flush=True)
        self._pending[trial.number] = (None, shown, run_id, log)
        try:
            out = trial_run.run(cmd, env, t.trial_timeout_s, log,
                                on_start=lambda pid: trial.set_user_attr("pid", pid))
        except BaseException:
            trial.set_user_attr("failure", "interrupted")
            raise
        self._pending[trial.number] = (out, shown, run_id, log)
        trial.set_user_attr("outcome", out.status)
        trial.set_user_attr("seconds", round(out.seconds, 3))
        trial.set_user_attr("metrics", out.metrics)
        trial.set_user_attr("log", str(log))
        if out.status == "ok":
            missing = [m for m in [*self.metrics, *t.limits] if m not in out.metrics]
            if missing:
                trial.set_user_attr("failure", "crash")
                trial.set_user_attr("detail", f"the bench reported no {', '.join(missing)}")
                raise TrialFailed(f"no {', '.join(missing)} in the bench's records")
            for k, limit in t.limits.items():
                trial.set_constraint(k, out.metrics[k] - limit)
            trial.set_constraint("oom", -1.0)
            values = [out.metrics[m] for m in self.metrics]
            return values[0] if len(values) == 1 else values
        if out.status == "oom":  # infeasible: TPE learns to avoid the region
            for k in t.limits:
                trial.set_constraint(k, 0.0)
            trial.set_constraint("oom", 1.0)
            trial.set_user_attr("detail", out.detail[-2000:])
            values = [0.0 if d == "maximize" else t.trial_timeout_s for d in self.directions]
            return values[0] if len(values) == 1 else values
        trial.set_user_attr("failure", out.status)
        trial.set_user_attr("detail", out.detail[-2000:])
        raise TrialFailed(f"{out.status}: {trial_run.reason(out.detail)}")

    def after_trial(self, study, ft) -> None:
        """Progress on screen and in MLflow; stop once the study (all workers together) has n_trials."""
        out, shown, run_id, log = self._pending.pop(ft.number, (None, {}, None, None))
        state = ft.state.name
        ok = ft.state.name == "COMPLETE"
        feas = ok and feasible(ft) and ft.user_attrs.get("outcome") == "ok"
        m = ft.user_attrs.get("metrics", {})
        if ok:
            figures = ", ".join(f"{k} {_fmt(m[k])}" for k in ("ttft_s", "tpot_s", "decode_tok_s") if k in m)
            what = f"{'feasible' if feas else 'INFEASIBLE (' + ft.user_attrs.get('outcome', '') + ')'}: {figures}"
        else:
            what = f"{ft.user_attrs.get('failure') or 'failed'}: {trial_run.reason(ft.user_attrs.get('detail') or '')}"
        best = self.best(study)
        best_text = ""
        if best is not None:
            label = "best" if len(self.metrics) == 1 else f"Pareto front of {len(study.best_trials)}, knee"
            best_text = f" | {label}: trial {best.number} " + ", ".join(
                f"{k} {_fmt(v)}" for k, v in zip(self.metrics, best.values))
        secs = ft.user_attrs.get("seconds")
        print(f"trial {ft.number} {state} ({secs if secs is not None else '?'} s) {what}{best_text}", flush=True)
        if out is not None:
            objective = {k: v for k, v in zip(self.metrics, ft.values)} if ok and ft.values else {}
            best_value = best.values[0] if best is not None and len(self.metrics) == 1 else None
            self.tracker.finish_child(run_id, {"number": ft.number, "state": state, "feasible": feas}, out, shown,
                                      objective, best_value, log)
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
        pick = knee([(t.number, t.values) for t in cands if t.number in front], self.directions)
        return next((t for t in cands if t.number == pick), None)

    # ---------------------------------------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own progress lines instead
        t = self.cfg.tuner
        study = self.open_study()
        done = counted(study.get_trials(deepcopy=False))
        print(f"study {self.name} ({redact(self.url)}): {done}/{t.n_trials} trials done; "
              f"objective {sp.objective_spec(self.cfg)}", flush=True)
        print("space: " + json.dumps(self.space), flush=True)
        if self.overrides:
            print("trials get: " + " ".join(self.overrides), flush=True)
        self.tracker.start(study, self._parent_params())
        status = "FINISHED"
        try:
            if done < t.n_trials:
                study.optimize(self.objective, n_trials=t.n_trials - done, catch=(TrialFailed,),
                               callbacks=[self.after_trial])
        except KeyboardInterrupt:
            status = "KILLED"
            print(f"interrupted: {counted(study.get_trials(deepcopy=False))}/{t.n_trials} trials done; run the same "
                  "command again to resume", flush=True)
        return self.finish(study, status)

    def finish(self, study, status: str) -> dict[str, Any]:
        from optuna.trial import TrialState

        t = self.cfg.tuner
        trials = study.get_trials(deepcopy=False)
        best = self.best(study)
        measured = [(x.number, x.user_attrs["metrics"]["ttft_s"], x.user_attrs["metrics"]["tpot_s"],
                     feasible(x) and x.user_attrs.get("outcome") == "ok")
                    for x in trials if x.state == TrialState.COMPLETE
                    and {"ttft_s", "tpot_s"} <= set(x.user_attrs.get("metrics", {}))]
        summary = {"trials.complete": sum(x.state == TrialState.COMPLETE for x in trials),
                   "trials.failed": sum(x.state == TrialState.FAIL for x in trials),
                   "trials.feasible": len(self.candidates(study)),
                   "tuner.seconds": time.monotonic() - self.started}
        result: dict[str, Any] = {"study": self.name, "storage": redact(self.url), "best_trial": None,
                                  "policy_path": None, **summary}
        texts: dict[str, str] = {}
        if best is not None:
            for k, v in zip(self.metrics, best.values):
                summary[f"best.{k}"] = v
            result.update(best_trial=best.number, best_params=dict(best.params),
                          best_metrics=best.user_attrs.get("metrics", {}))
            print(f"best: trial {best.number} {best.params} -> " + ", ".join(
                f"{k} {_fmt(v)}" for k, v in best.user_attrs.get("metrics", {}).items()), flush=True)
            if t.write_policy and status == "FINISHED":
                path = self.write_policy(best)
                result["policy_path"] = str(path)
                texts["best_policy.yaml"] = path.read_text()
        else:
            print("no feasible trial: no policy written", flush=True)
        if self.tracker.parent:
            figs = plots.figures(study, measured, best.number if best else None, dict(t.limits), self.metrics)
            try:
                texts["trials.csv"] = study.trials_dataframe().to_csv(index=False)
            except Exception:  # noqa: BLE001 - pandas missing or an odd attribute
                pass
            texts["study.json"] = json.dumps({**result, "space": self.space,
                                              "objective": sp.objective_spec(self.cfg)}, indent=1, default=str)
            self.tracker.finish(study, summary, figs, texts, status)
            result["mlflow_run_id"] = self.tracker.parent
        print(f"{summary['trials.complete']} complete, {summary['trials.failed']} failed, "
              f"{summary['trials.feasible']} feasible in {self.name}"
              + (f"; MLflow run {self.tracker.parent} (make ui)" if self.tracker.parent else ""), flush=True)
        if status != "FINISHED":
            raise KeyboardInterrupt
        return result

    def write_policy(self, best) -> Path:
        hw = self.cfg.hw.name
        tuned = policy_file.checked(self.cfg.policy, dict(best.params))
        m = best.user_attrs.get("metrics", {})
        metric = ", ".join(f"{k} = {_fmt(m[k])}" for k in ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s")
                           if k in m)
        path = policy_file.write(CONF_DIR, hw, tuned, policy_file.header(self.name, best.number, metric,
                                                                         redact(self.url)))
        hw_path, changed = policy_file.select_in_hw_profile(CONF_DIR, hw)
        print(f"policy written: {path}" + (f"; {hw_path} now selects it" if changed else ""), flush=True)
        self.verify(hw, tuned)
        return path

    def verify(self, hw: str, tuned) -> None:
        """`python -m hybrid +hw=<hw>` composes the written policy (the same check a user makes by hand)."""
        p = subprocess.run([sys.executable, "-m", "hybrid", f"+hw={hw}", "--cfg", "job", "--package", "policy"],
                           capture_output=True, text=True, timeout=120)
        shown = yaml.safe_load(p.stdout.split("\n", 1)[1] if p.stdout.startswith("# @package") else p.stdout)
        got = (shown or {}).get("policy", shown)
        if p.returncode != 0 or got != asdict(tuned):
            raise RuntimeError(f"+hw={hw} does not compose the written policy:\n{p.stdout}{p.stderr}")
        print(f"checked: `python -m hybrid +hw={hw}` uses it", flush=True)

    def _parent_params(self) -> dict[str, str]:
        c = self.cfg
        params = {"study": self.name, "storage": redact(self.url), "hw": c.hw.name, "model": c.model.name,
                  "space": json.dumps(self.space), "trial_overrides": " ".join(self.overrides) or "-"}
        params.update({f"tuner.{k}": str(v) for k, v in tracking.flatten(c.tuner).items()
                       if not k.startswith(("space", "storage", "enqueue"))})
        params.update({f"bench.{k}": str(getattr(c.bench, k)) for k in ("prompt_tokens", "new_tokens", "batch",
                                                                          "repeats")})
        return params


def _retry_of(trial) -> Optional[int]:
    """The trial this one repeats: a heartbeat-stale one (Optuna's retry callback) or an interrupted one."""
    try:
        frozen = trial.study._storage.get_trial(trial._trial_id)
        number = frozen.system_attrs.get("failed_trial")
    except Exception:  # noqa: BLE001 - informational
        number = None
    return number if number is not None else trial.user_attrs.get("retry_of")


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def install_sigterm() -> None:
    """SIGTERM ends the tuner like Ctrl-C: the running trial's process group is killed, the trial re-queued."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
