"""A study's storage: an Optuna study in an RDB storage (sqlite under runs/ by default; several tuners share one
through any RDB URL) with heartbeats, its sampler (TPE warm-started with the current policy, or a grid), and the trials
an interrupted start left re-queued.
"""
from __future__ import annotations

import time
import warnings

from hybrid import tracking
from hybrid.config.compose import RUNS_DIR
from hybrid.errors import ConfigError
from tuner import space as sp
from tuner.config import Sampler, TuneConfig, flat_params


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


def open_study(cfg: TuneConfig, name: str, url: str, space: dict, directions: list[str], physical_cores: int):
    """Workers starting together on a fresh database race to create its tables: the loser retries."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(5):
        try:
            return _open_study(cfg, name, url, space, directions, physical_cores)
        except (IntegrityError, OperationalError):
            if attempt == 4:
                raise
            time.sleep(1.0 + attempt)


def _open_study(cfg: TuneConfig, name: str, url: str, space: dict, directions: list[str], physical_cores: int):
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    t = cfg.tuner
    tracking.ensure_sqlite_dir(url)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeat_interval is "experimental"
        storage = RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=t.heartbeat_s,
                             grace_period=t.grace_s,
                             heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(t.max_retry))
    if t.sampler == Sampler.grid:
        sampler = optuna.samplers.GridSampler(sp.grid(space), seed=t.seed)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # multivariate is "experimental"
            sampler = optuna.samplers.TPESampler(n_startup_trials=t.startup_trials, seed=t.seed,
                                                 multivariate=t.multivariate, group=t.multivariate)
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                directions=directions, load_if_exists=True)
    if study.directions != [optuna.study.StudyDirection[d.upper()] for d in directions]:
        raise ConfigError(f"study {name} exists with directions {study.directions}: give another "
                          "tuner.study_name")
    if "space" not in study.user_attrs:
        study.set_user_attr("space", space)
        study.set_user_attr("objective", sp.objective_spec(cfg))
        study.set_user_attr("hw", cfg.hw.name)
        study.set_user_attr("model", cfg.model.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)  # a killed worker's trial: failed, re-queued
    _requeue_interrupted(study)
    if t.sampler == Sampler.grid:  # every point once: nothing to enqueue
        return study
    warm = sp.warm_start(cfg, space, physical_cores)
    if warm:
        study.enqueue_trial(warm, user_attrs={"source": "current policy"}, skip_if_exists=True)
    for extra in t.enqueue:
        params = sp.in_space(flat_params(extra), space)
        if params:
            study.enqueue_trial(params, user_attrs={"source": "tuner.enqueue"}, skip_if_exists=True)
    return study


def _requeue_interrupted(study) -> None:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    for t in trials:
        if (t.state == TrialState.FAIL and t.user_attrs.get("failure") == "interrupted"
                and t.number not in retried and t.params):
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number, "source": "interrupted trial"})
