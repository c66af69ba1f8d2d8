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
and does not count. A trial interrupted by Ctrl-C / SIGTERM is re-queued by the next start.
"""
from __future__ import annotations

import dataclasses
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
from hybrid.plan.plan import rebuildable
from hybrid.config.compose import CONF_DIR, RUNS_DIR, settings_of
from hybrid.errors import ConfigError
from tuner import plots, policy as policy_file, space as sp, trial as trial_run
from tuner.config import Cutoff, Sampler, TuneConfig, flat_params
from tuner.track import StudyTracker, fresh_user_attrs

COUNTED_FAILURES = ("crash", "deadline")
# Overrides the tuner sets itself for the trial worker (the user's own are dropped from what it gets).
OWN_KEYS = ("mode", "bench", "output")
WORKER_OWN = ["mode=bench", "bench=slo", "tracking.enabled=false"]
CUTOFF = "prefill.slp_cutoff_tokens"
# The figures of a trial shown on its progress line, and the TTFT / TPOT pair its Pareto plot draws, by what it
# measures
SHOWN = ("goodput_req_s", "ttft_p90_s", "tpot_p90_s", "ttft_s", "tpot_s", "decode_tok_s", "errors")
PAIRS = {"workload": ("ttft_p90_s", "tpot_p90_s"), "slo": ("ttft_s", "tpot_s")}


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
        if t.sampler == Sampler.grid:
            sampler = optuna.samplers.GridSampler(sp.grid(self.space), seed=t.seed)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # multivariate is "experimental"
                sampler = optuna.samplers.TPESampler(n_startup_trials=t.startup_trials, seed=t.seed,
                                                     multivariate=t.multivariate, group=t.multivariate)
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
        if t.sampler == Sampler.grid:  # every point once: nothing to enqueue
            return study
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
            figures = ", ".join(f"{k} {_fmt(m[k])}" for k in SHOWN if k in m)
            what = f"{'feasible' if feas else 'INFEASIBLE (' + ft.user_attrs.get('outcome', '') + ')'}: {figures}"
        else:
            what = f"{ft.user_attrs.get('failure') or 'failed'}: {trial_run.reason(ft.user_attrs.get('detail') or '')}"
        best = self.best(study)
        best_text = ""
        if best is not None:
            label = "best" if len(self.metrics) == 1 else f"Pareto front of {len(study.best_trials)}, best goodput"
            best_text = f" | {label}: trial {best.number} " + ", ".join(
                f"{k} {_fmt(v)}" for k, v in zip(self.metrics, best.values))
        timing = "?"
        if out is not None:
            timing = (f"{out.seconds:.1f} s: model {'loaded' if out.started else 'reused'}"
                      + (f", engine {out.build_s:.2f} s, measured {out.measure_s:.1f} s" if out.status == "ok" else ""))
        print(f"trial {ft.number} {state} ({timing}) {what}{best_text}", flush=True)
        if out is not None:
            objective = {k: v for k, v in zip(self.metrics, ft.values)} if ok and ft.values else {}
            best_value = best.values[0] if best is not None and len(self.metrics) == 1 else None
            try:
                logged, config = self.trial_params(params, out), self.trial_config(params)
            except ValueError as e:  # a policy the schema refused (the trial failed on it): its knobs as sampled
                logged = {f"policy.{k}": str(v) for k, v in params.items()}
                config = f"# refused: {e}\n" + "".join(f"{k}: {v!r}\n" for k, v in params.items())
            self.tracker.finish_child(run_id, {"number": ft.number, "state": state, "feasible": feas}, out, logged,
                                      objective, best_value, log, config, f"trial {ft.number}: {self.cfg.model.name} "
                                      f"on {self.cfg.hw.name}")
        if counted(study.get_trials(deepcopy=False)) >= self.cfg.tuner.n_trials:
            study.stop()

    def trial_settings(self, params: dict[str, Any]):
        return dataclasses.replace(self.cfg, policy=policy_file.checked(self.cfg.policy, {**self.fixed, **params}))

    def trial_params(self, params: dict[str, Any], out) -> dict[str, str]:
        """A trial's MLflow params: its whole policy, the hw profile, the model, what it measured, threads and kernel
        it ran with."""
        s = self.trial_settings(params)
        report = out.report
        flat = {**tracking.flatten(s.hw, "hw."), **tracking.flatten(s.model, "model."),
                **tracking.flatten(s.policy, "policy."), **{k: str(v) for k, v in sp.flat_measured(self.cfg).items()}}
        flat.update({"run.threads": str(report.get("threads", "")), "run.kernel": str(report.get("kernel", ""))})
        return flat

    def trial_config(self, params: dict[str, Any]) -> str:
        from omegaconf import OmegaConf

        s = self.trial_settings(params)
        node = {"hw": asdict(s.hw), "model": asdict(s.model), "policy": asdict(s.policy),
                **sp.measured(self.cfg)}
        return OmegaConf.to_yaml(OmegaConf.create(json.loads(json.dumps(node, default=str))))

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
        """tuner.cutoff=measure on a GPU profile: the crossover of the two prefill paths on the workload's prompt
        lengths (measured once per study, by the first tuner to get there) becomes every trial's cutoff."""
        t = self.cfg.tuner
        if not self.gpu:
            if t.goal.measure == "workload":
                print("cutoff: no GPU in this profile: every prompt takes the CPU path, so "
                      f"policy.{CUTOFF} is moot (not measured)", flush=True)
            return
        if not self.measure_cutoff:
            return
        cross = study.user_attrs.get("crossover")
        if cross is None:
            w = self.cfg.workload
            lengths = spread(w.prompt_tokens[0], w.prompt_tokens[1], t.crossover_lengths)
            warm = {**sp.warm_start(self.cfg, self.space, self.machine.physical_cores)}
            print(f"cutoff: timing the first token on both prefill paths at {lengths} tokens ...", flush=True)
            t0 = time.monotonic()
            try:
                cross = self.worker.call(self.key(warm), {"op": "crossover", "policy": warm, "lengths": lengths},
                                         t.trial_timeout_s, self.log_dir / "crossover.log")
            except RuntimeError as e:
                print(f"warning: cutoff not measured ({e}): policy.{CUTOFF} stays as configured "
                      f"({self.cfg.policy.prefill.slp_cutoff_tokens})", file=sys.stderr, flush=True)
                return
            cross = {**cross, "lengths": lengths, "policy": warm, "seconds": round(time.monotonic() - t0, 2)}
            if "crossover" not in fresh_user_attrs(study):
                study.set_user_attr("crossover", cross)
            cross = fresh_user_attrs(study)["crossover"]
        self.crossover = cross
        self.fixed[CUTOFF] = cross["cutoff"]
        shown = ", ".join(f"{n}: CPU {c:.3f} s / SLP {g:.3f} s" for (n, c), (_, g) in zip(cross["cpu"], cross["slp"]))
        print(f"cutoff: policy.{CUTOFF}={cross['cutoff']} for every trial (TTFT {shown})", flush=True)

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
        print("reload (trial worker restarts): " + (", ".join(sorted(self.reload & set(self.space))) or "none"),
              flush=True)
        if self.overrides:
            print("trial worker gets: " + " ".join(self.overrides), flush=True)
        self.tracker.start(study, self._parent_params())
        status = "FINISHED"
        try:
            if done < t.n_trials:
                self.set_cutoff(study)
                study.optimize(self.objective, n_trials=t.n_trials - done, catch=(TrialFailed,),
                               callbacks=[self.after_trial])
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
                f"{k} {_fmt(v)}" for k, v in best.user_attrs.get("metrics", {}).items()), flush=True)
            if t.write_policy and status == "FINISHED":
                path = self.write_policy(best)
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

    def write_policy(self, best) -> Path:
        hw = self.cfg.hw.name
        tuned = policy_file.checked(self.cfg.policy, {**self.fixed, **best.params})
        m = best.user_attrs.get("metrics", {})
        metric = ", ".join(f"{k} = {_fmt(m[k])}" for k in dict.fromkeys([*self.metrics, *SHOWN]) if k in m)
        if len(self.metrics) > 1:
            metric += " (the feasible Pareto front's best goodput)"
        header = policy_file.header(self.name, best.number, metric, redact(self.url))
        if self.crossover is not None:
            header.insert(4, f"cutoff: the measured crossover of the two prefill paths at "
                             f"{self.crossover['lengths']} tokens")
        path = policy_file.write(CONF_DIR, hw, tuned, header)
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
                  "space": json.dumps(self.space), "reload": ",".join(sorted(self.reload)) or "-",
                  "trial_overrides": " ".join(self.overrides) or "-"}
        params.update({f"tuner.{k}": str(v) for k, v in tracking.flatten(c.tuner).items()
                       if not k.startswith(("spaces", "storage", "enqueue"))})
        params.update({k: str(v) for k, v in sp.flat_measured(c).items()})
        return params


def spread(lo: int, hi: int, n: int) -> list[int]:
    """n prompt lengths from lo to hi, evenly on a log scale (fewer where they round to the same)."""
    if lo == hi:
        return [lo]
    return sorted({round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)})


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
