"""A study's storage: an Optuna study in an RDB storage (sqlite under runs/ by default; several tuners share one
through any RDB URL) with heartbeats, its sampler (TPE warm-started with the current policy, or a grid), and the trials
an interrupted start left re-queued. Tuners sharing it open it and take trials under one lock (`storage_lock`: a
file lock for sqlite, the database's own on PostgreSQL and MySQL), so that together they run exactly n_trials.
"""
from __future__ import annotations

import time
import warnings
import zlib
from contextlib import contextmanager
from typing import Iterator

import optuna

from hybrid.config.compose import RUNS_DIR
from hybrid.errors import ConfigError
from hybrid.locking import locked, sqlite_file
from tuner import space as sp
from tuner.config import Sampler, TuneConfig, flat_params


COUNTED_FAILURES = ("crash", "deadline")
LOCKED = ("postgresql", "mysql", "mariadb")  # server databases whose own lock storage_lock takes
LOCK_KEY = zlib.crc32(b"hybrid-tuner")  # the PostgreSQL advisory lock's key: one for every study of a database


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
    """The study, opened under the storage's lock (`storage_lock`): tuners starting together create the tables and
    the study once, fail its stale trials and enqueue its first trials once. Where no lock is taken (an RDB other
    than sqlite, PostgreSQL or MySQL), a tuner that loses the race to create the tables retries. A URL that is no
    database, a missing driver or a database that cannot be reached: a ConfigError naming tuner.storage."""
    from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError

    for attempt in range(5):
        try:
            with storage_lock(url):
                return _open_study(cfg, name, url, space, directions, physical_cores)
        except IntegrityError:
            if attempt == 4:
                raise
            time.sleep(1.0 + attempt)
        except ArgumentError as e:
            raise ConfigError(f"tuner.storage: {redact(url)} is no database URL ({_line(e)}); e.g. "
                              "sqlite:////abs/path/tuner.db or postgresql://user:password@host:5432/db") from None
        except ImportError as e:
            raise ConfigError(f"tuner.storage: {redact(url)} needs its database driver ({_line(e.__cause__ or e)}): "
                              "pip install 'psycopg[binary]' for postgresql:// (psycopg2-binary for "
                              "postgresql+psycopg2://), pymysql for mysql+pymysql://") from None
        except OperationalError as e:
            if attempt == 4 or sqlite_file(url) is not None or _dialect(url) in LOCKED:
                raise ConfigError(f"tuner.storage: cannot open {redact(url)}: {_line(e.orig or e)}") from None
            time.sleep(1.0 + attempt)  # perhaps another tuner creating the tables


def _dialect(url: str) -> str:
    return url.split(":", 1)[0].split("+", 1)[0]


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@contextmanager
def storage_lock(url: str) -> Iterator[None]:
    """Held while a tuner opens its study: a file lock beside a sqlite file; on PostgreSQL and MySQL a lock of the
    database server (an advisory lock, `GET_LOCK`), which serialises tuners on other machines too and goes with a
    tuner's connection when it dies; none for other URLs."""
    path = sqlite_file(url)
    if path is not None:
        with locked(path, f"opening a study in {path}"):
            yield
        return
    dialect = _dialect(url)
    if dialect not in LOCKED:
        yield
        return
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if dialect == "postgresql":
                take, give = "SELECT pg_advisory_lock(:key)", "SELECT pg_advisory_unlock(:key)"
                key = LOCK_KEY
            else:
                take, give, key = "SELECT GET_LOCK(:key, -1)", "SELECT RELEASE_LOCK(:key)", "hybrid-tuner"
            conn.execute(sqlalchemy.text(take), {"key": key})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text(give), {"key": key})
    finally:
        engine.dispose()


def _open_study(cfg: TuneConfig, name: str, url: str, space: dict, directions: list[str], physical_cores: int):
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    t = cfg.tuner
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
    optuna.create_study(study_name=name, storage=storage, sampler=sampler, directions=directions,
                        load_if_exists=True)
    study = SharedStudy(name, storage, sampler, url, t.n_trials, poll_s=min(t.heartbeat_s, 5))
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


class StudyFull(Exception):
    """The study has its tuner.n_trials counted trials: none left for this tuner."""


def counted(trials) -> int:
    """Trials that count toward tuner.n_trials: complete and pruned ones, and those that failed on their own."""
    from optuna.trial import TrialState

    return sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and t.user_attrs.get("failure") in COUNTED_FAILURES))


class SharedStudy(optuna.Study):
    """A study that several tuners run together. `ask` takes a trial under the storage's lock, and only while the
    counted trials and those other tuners are running number fewer than n_trials: together they run exactly
    n_trials. While every missing trial is running in another tuner it waits; when one of those completes the study
    is full (StudyFull), when one's tuner died its heartbeat goes stale and it is failed and re-queued here, and this
    tuner takes it."""

    def __init__(self, name: str, storage, sampler, url: str, n_trials: int, poll_s: float):
        super().__init__(study_name=name, storage=storage, sampler=sampler)
        self.url, self.n_trials, self.poll_s = url, n_trials, poll_s

    def ask(self, fixed_distributions=None):
        from optuna.trial import TrialState

        waited = False
        while True:
            with storage_lock(self.url):
                trials = self.get_trials(deepcopy=False)
                done = counted(trials)
                if done >= self.n_trials:
                    raise StudyFull(f"{done}/{self.n_trials} trials done")
                running = [t.number for t in trials if t.state == TrialState.RUNNING]
                if done + len(running) < self.n_trials:
                    return super().ask(fixed_distributions)
            if not waited:
                print(f"waiting: trials {', '.join(map(str, running))} of other tuners complete the study "
                      f"({done}/{self.n_trials} done)", flush=True)
                waited = True
            time.sleep(self.poll_s)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optuna.storages.fail_stale_trials(self)  # a dead tuner's trial: failed, re-queued, taken next


def _requeue_interrupted(study) -> None:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    for t in trials:
        if (t.state == TrialState.FAIL and t.user_attrs.get("failure") == "interrupted"
                and t.number not in retried and t.params):
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number, "source": "interrupted trial"})
