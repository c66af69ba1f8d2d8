"""The trial worker (tuner/trial.py driving tuner/worker.py, through tests/tuner/faulty_bench.py): one process
keeps the model across trials that change no reload knob (its own build count says so), and is started again after
a crash, after a missed deadline and for a reload knob."""
from __future__ import annotations

import time

from hybrid.bench.prefill import cutoff_at
from tests.tuner.conftest import FAST, MODULE, alive, env_for
from tuner.trial import Worker

WORKLOAD = ["workload.requests=3", "workload.prompt_tokens=[8,24]", "workload.output_tokens=[2,4]",
            "workload.concurrency=2"]


def _trial(number: int, **policy) -> dict:
    return {"op": "trial", "trial": number, "policy": {"cpu.threads": 1, **policy}, "measure": "workload"}


def test_worker_reuses_its_model_and_restarts_when_it_must(conf, tuner_runs, tmp_path):
    env = env_for(conf, tuner_runs, HYBRID_TEST_INJECT_FAULT="2:crash,4:hang,6:die")
    w = Worker(MODULE, [*FAST, *WORKLOAD, "mode=bench", "bench=slo", "tracking.enabled=false"], env, tmp_path)
    log = lambda n: tmp_path / f"trial-{n}.log"  # noqa: E731
    try:
        first = w.run((), _trial(0), 120, log(0))
        assert first.status == "ok", first.detail
        assert first.started and first.builds == 1 and first.metrics["goodput_req_s"] > 0
        assert "plan: device cpu" in log(0).read_text(), "the trial's log holds the worker's build"
        second = w.run((), _trial(1, **{"cpu.threads": 2, "decode.batch_cap": 2, "prefill.chunk_tokens": 8}), 120,
                       log(1))
        assert second.status == "ok", second.detail
        assert not second.started and second.builds == 1 and second.pid == first.pid, "the model loaded once"
        assert second.report["plan"]["decode.batch_cap"] == 2 and second.report["threads"] == 2
        slo = w.run((), {**_trial(10), "measure": "slo"}, 120, log(10))  # tuner.objective=decode_tok_s
        assert slo.status == "ok" and not slo.started and slo.metrics["decode_tok_s"] > 0, slo.detail
        print(f"\nfirst trial {first.seconds:.2f} s (build {first.build_s:.2f} s, measure {first.measure_s:.2f} s); "
              f"second {second.seconds:.2f} s (rebuild {second.build_s:.3f} s, measure {second.measure_s:.2f} s)")

        crash = w.run((), _trial(2), 120, log(2))
        assert crash.status == "crash" and "injected crash" in crash.detail
        after_crash = w.run((), _trial(3), 120, log(3))
        assert after_crash.status == "ok" and after_crash.started and after_crash.pid != first.pid
        assert not alive(first.pid)

        t0 = time.monotonic()
        hung = w.run((), _trial(4), 3, log(4))
        assert hung.status == "deadline" and time.monotonic() - t0 < 20
        deadline = time.monotonic() + 5
        while alive(hung.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(hung.pid), "the hung worker was killed"
        after_hang = w.run((), _trial(5), 120, log(5))
        assert after_hang.status == "ok" and after_hang.started

        died = w.run((), _trial(6), 120, log(6))
        assert died.status == "crash" and "exited with status 3" in died.detail
        reloaded = w.run(("cpu.moe_backend=torch",), _trial(7, **{"cpu.moe_backend": "torch"}), 120, log(7))
        assert reloaded.status == "ok" and reloaded.started and reloaded.report["plan"]["cpu.moe_backend"] == "torch"
        refused = w.run(("cpu.moe_backend=torch",), _trial(8, **{"decode.batch_cap": 99}), 120, log(8))
        assert refused.status == "crash" and "policy.decode.batch_cap" in refused.detail
        kept = w.run(("cpu.moe_backend=torch",), _trial(9, **{"cpu.moe_backend": "torch"}), 120, log(9))
        assert kept.status == "ok" and not kept.started, "a refused policy leaves the worker as it was"
        assert w.starts == 4  # trials 0, 3 (after the crash), 5 (after the deadline), 7 (died; a reload knob)
    finally:
        w.stop()


def test_cutoff_from_the_crossover():
    cpu = [(32, 0.01), (64, 0.02), (128, 0.04), (256, 0.08)]
    slp = [(32, 0.03), (64, 0.03), (128, 0.03), (256, 0.03)]
    assert 64 < cutoff_at(slp, cpu) < 128
    assert cutoff_at([(n, 1.0) for n, _ in cpu], cpu) == 256, "the CPU path wins everywhere"
    assert cutoff_at([(n, 1e-3) for n, _ in cpu], cpu) == 31, "stream-loading wins everywhere"
