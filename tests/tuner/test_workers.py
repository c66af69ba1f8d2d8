"""Two workers on one study (sqlite here; several machines use an RDB URL the same way, tests/tuner/
test_across_machines.py): each completes trials of its own, none twice, and together they run exactly the study's
trials."""
from __future__ import annotations

import re

from tests.tuner.conftest import FAST, env_for, load, start_tuner


def test_two_workers_share_one_study(conf, tuner_runs, tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    args = [*FAST, "tuner.n_trials=4", f"tuner.storage={storage}", "tuner.study_name=shared",
            "tuner.write_policy=false"]
    env = env_for(conf, tuner_runs)
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    procs = [start_tuner(*args, env=env, out=log) for log in logs]
    for p in procs:
        p.wait(timeout=300)
    text = [log.read_text() for log in logs]
    assert all(p.returncode == 0 for p in procs), "\n".join(text)
    trials = load(storage, "shared").get_trials()
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 4 and len(trials) == 4, [t.state for t in trials]
    workers = {t.user_attrs["worker"] for t in complete}
    assert len(workers) == 2, "both workers completed trials"
    mine = [set(map(int, re.findall(r"^trial (\d+) COMPLETE", s, re.M))) for s in text]
    assert mine[0] and mine[1] and not mine[0] & mine[1], mine  # distinct trials
    assert mine[0] | mine[1] == {t.number for t in complete}
