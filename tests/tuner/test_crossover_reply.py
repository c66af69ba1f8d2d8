"""The crossover request end to end on the CPU: tuner/trial.py's Worker drives a real trial worker process
(tuner/worker.py's serve and TrialWorker, the tiny model built on cpu_only) and `Worker.call` hands back what the
tuner's set_cutoff reads (slp, cpu, cutoff). Only the timing of the two prefill paths is stubbed (stream-loading
needs a GPU): this module is also the trial module, `python -m tests.tuner.test_crossover_reply`, which replaces
hybrid.bench.prefill.both_paths before serving. With HYBRID_TEST_CROSSOVER_REPLY=bare its crossover answers without
"metrics" (as it once did), and the tuner's side must turn that into a crash outcome, not a KeyError."""
from __future__ import annotations

import os

MODULE = "tests.tuner.test_crossover_reply"
REPLY_ENV = "HYBRID_TEST_CROSSOVER_REPLY"
LENGTHS = [8, 16, 32, 64]
CUTOFF_TOKENS = 24  # where the stubbed curves cross


def fake_both_paths(engine, lengths):
    """Stream-loading's TTFT flat, the CPU path's growing with the prompt: they cross at CUTOFF_TOKENS."""
    assert engine is not None, "the worker built its engine first"
    slp = [(n, 0.003) for n in lengths]
    cpu = [(n, 0.003 * n / CUTOFF_TOKENS) for n in lengths]
    return slp, cpu


def serve_stubbed() -> None:
    import hybrid.bench.prefill as prefill
    from tuner import worker

    prefill.both_paths = fake_both_paths  # TrialWorker.crossover imports it at each request
    if os.environ.get(REPLY_ENV) == "bare":  # the old reply: the figures at the top level
        worker.TrialWorker.crossover = lambda self, req: {"slp": [], "cpu": [], "cutoff": 0}
    worker.main()


if __name__ == "__main__":
    serve_stubbed()
else:
    import pytest

    from tests.tuner.conftest import FAST, env_for
    from tuner.trial import Worker

    OVERRIDES = [*FAST, "mode=bench", "bench=slo", "tracking.enabled=false"]
    REQUEST = {"op": "crossover", "policy": {"cpu.threads": 1}, "lengths": LENGTHS}

    def test_crossover_reply_reaches_set_cutoff(conf, tuner_runs, tmp_path):
        w = Worker(MODULE, OVERRIDES, env_for(conf, tuner_runs), tmp_path)
        try:
            cross = w.call((), REQUEST, 120, tmp_path / "crossover.log")
            assert set(cross) == {"slp", "cpu", "cutoff"}, cross
            assert [n for n, _ in cross["slp"]] == LENGTHS and [n for n, _ in cross["cpu"]] == LENGTHS
            assert CUTOFF_TOKENS - 1 <= cross["cutoff"] <= CUTOFF_TOKENS, cross  # the real cutoff_at, int()
            # as set_cutoff prints them
            shown = ", ".join(f"{n}: CPU {c:.3f} s / SLP {g:.3f} s"
                              for (n, c), (_, g) in zip(cross["cpu"], cross["slp"]))
            assert shown.startswith("8: CPU 0.001 s / SLP 0.003 s")
            assert w.proc is not None and w.proc.poll() is None, "the worker lives on for the trials"
            trial = w.run((), {"op": "trial", "trial": 0, "policy": {"cpu.threads": 1}, "measure": "slo"}, 120,
                          tmp_path / "trial-0.log")
            assert trial.status == "ok" and not trial.started and trial.builds == 1, trial.detail
        finally:
            w.stop()

    def test_reply_without_metrics_is_a_crash_not_a_key_error(conf, tuner_runs, tmp_path):
        w = Worker(MODULE, OVERRIDES, env_for(conf, tuner_runs, **{REPLY_ENV: "bare"}), tmp_path)
        try:
            out = w.run((), REQUEST, 60, tmp_path / "crossover.log")
            assert out.status == "crash" and "has no 'metrics'" in out.detail, out.detail
            assert "cutoff" in out.detail, "the keys it did have"
            with pytest.raises(RuntimeError, match=r"crash: error: .*'crossover' has no 'metrics'"):
                w.call((), REQUEST, 60, tmp_path / "crossover-again.log")
        finally:
            w.stop()
