"""A tuner killed (SIGKILL) in the middle of a trial, started again: the completed trials stay, the trial it was
running is failed once its heartbeat is stale and run again with the same parameters, and the study finishes."""
from __future__ import annotations

import time

from tests.tuner.conftest import FAST, FAULTY, NO_RELOAD, alive, env_for, load, start_tuner, tune


def test_killed_tuner_resumes_without_losing_trials(conf, tuner_runs, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = [*FAST, *NO_RELOAD, FAULTY, "tuner.n_trials=2", f"tuner.storage={storage}", "tuner.study_name=resume",
            "tuner.heartbeat_s=1", "tuner.grace_s=2", "tuner.trial_timeout_s=120", "tuner.write_policy=false"]
    out = tmp_path / "first.log"
    proc = start_tuner(*args, env=env_for(conf, tuner_runs, HYBRID_TEST_INJECT_FAULT="1:hang"), out=out)
    try:
        deadline = time.monotonic() + 120
        while "trial 1 [" not in out.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert "trial 1 [" in out.read_text(), out.read_text()
        time.sleep(1.0)  # trial 1 is running (hung)
    finally:
        proc.kill()
        proc.wait()
    before = load(storage, "resume").get_trials()
    assert [t.state.name for t in before] == ["COMPLETE", "RUNNING"], out.read_text()
    done0, hung = before[0], before[1]
    t0 = time.monotonic()
    while alive(hung.user_attrs["pid"]) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not alive(hung.user_attrs["pid"]), "the trial worker dies with its tuner"
    time.sleep(3)  # past the grace period: the heartbeat of trial 1 is stale

    p = tune(*args, env=env_for(conf, tuner_runs))
    assert p.returncode == 0, p.stdout + p.stderr
    after = load(storage, "resume").get_trials()
    assert after[0].state.name == "COMPLETE" and after[0].values == done0.values and after[0].params == done0.params
    assert after[1].state.name == "FAIL", "the killed trial is failed"
    retry = [t for t in after if t.system_attrs.get("failed_trial") == 1]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE" and retry[0].params == hung.params
    assert sum(t.state.name == "COMPLETE" for t in after) == 2 and len(after) == 3
    assert "1/2 trials done" in p.stdout and "retry of trial 1" in p.stdout
