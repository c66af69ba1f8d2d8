"""The trial worker: `python -m tuner.worker <overrides>` composes the engine's config as `python -m hybrid
<overrides>` would, then takes requests, one JSON line each on stdin, and answers each with one JSON line on stdout
(everything else it prints goes to stderr). The model is loaded and placed once, by the first request; every later
one rebuilds the engine around it for the request's policy (hybrid/engine/build.py `replan`), so a trial that
changes only knobs placement does not read costs its measurement alone. The tuner restarts the worker for the other
knobs.

    {"op": "trial", "trial": 3, "policy": {"decode.batch_cap": 4, ...}, "measure": "workload" | "slo"}
    {"op": "crossover", "policy": {...}, "lengths": [32, 64, 128, 256]}
 -> {"status": "ok", "metrics": {...}, "report": {"records": [...], "plan": {...}, ...}, "builds": 1, ...}
    (a crossover's metrics: {"slp": [[length, ttft_s], ...], "cpu": [...], "cutoff": tokens}, and no report)
 -> {"status": "error", "error": "ValueError: ...", "builds": 1, "alive": false}

After an error in a build or a measurement the worker exits (its engine may be half-changed); a policy refused
before anything changed (`Refused`: the schema's checks, a workload longer than a KV slot) leaves it running.
`main(before=...)` runs a hook before each request (tests inject faults with it).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import replace
from typing import Any, Callable, Optional


class Refused(Exception):
    """A request whose policy (or workload) the engine cannot take, refused before anything changed."""


class TrialWorker:
    def __init__(self, overrides: list[str]):
        from hybrid.config.compose import compose, settings_of
        from hybrid.hw.check import resolve
        from hybrid.hw.detect import detect

        self.base = settings_of(compose(overrides))
        self.hw, notes = resolve(self.base.hw, self.base.policy, detect())
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
        self.engine = None
        self.builds = 0

    def settings(self, policy: dict[str, Any], measure: str = ""):
        from hybrid.bench.serve import check_fits
        from tuner.policy import checked

        try:
            s = replace(self.base, policy=checked(self.base.policy, policy), hw=self.hw)
            if measure == "workload":
                check_fits(s)
        except Exception as e:  # noqa: BLE001 - the schema's checks and the KV slot's size, as one line
            raise Refused(str(getattr(e, "msg", e)).splitlines()[0]) from e
        return s

    def engine_for(self, s) -> tuple[Any, float]:
        """The engine for settings s (built the first time, rebuilt after) and the seconds that took."""
        from hybrid.engine.build import build, replan

        t0 = time.perf_counter()
        if self.engine is None:
            self.engine = build(s, self.hw, progress=False)
            self.builds += 1
        else:
            old, self.engine = self.engine, None
            self.engine = replan(old, s, self.hw)
        return self.engine, time.perf_counter() - t0

    def trial(self, req: dict) -> dict:
        s = self.settings(req["policy"], req["measure"])
        engine, build_s = self.engine_for(s)
        t0 = time.perf_counter()
        if req["measure"] == "workload":
            metrics, records = measure_workload(engine, s)
        else:
            metrics, records = measure_slo(engine, s)
        from hybrid.kernels import thread_pool

        report = {"records": records, "plan": engine.plan.params(), "threads": thread_pool.threads(),
                  "kernel": engine.plan.cpu.kernel, "hw": self.hw.name}
        return {"metrics": metrics, "report": report, "build_s": build_s, "measure_s": time.perf_counter() - t0}

    def crossover(self, req: dict) -> dict:
        from hybrid.bench.prefill import both_paths, cutoff_at

        engine, build_s = self.engine_for(self.settings(req["policy"]))
        t0 = time.perf_counter()
        slp, cpu = both_paths(engine, list(req["lengths"]))
        # Under "metrics", as every ok reply (the protocol above): what Worker.call hands the tuner's set_cutoff.
        return {"metrics": {"slp": slp, "cpu": cpu, "cutoff": cutoff_at(slp, cpu)}, "build_s": build_s,
                "measure_s": time.perf_counter() - t0}


def measure_workload(engine, s) -> tuple[dict[str, float], list[dict]]:
    """The workload at the engine (after a short warm-up): the figures the objectives read, and the records."""
    from hybrid.bench.serve import records_of, workload
    from hybrid.bench.workload import drive, warm_up

    w = workload(s)
    warm_up(engine, w)
    rep = drive(engine, w, s.model.name)
    metrics = {"goodput_req_s": rep["goodput_req_s"], "slo_attainment": rep["slo_attainment"],
               "throughput_req_s": rep["throughput_req_s"], "output_tok_s": rep["output_tok_s"],
               "errors": float(rep["errors"]), "duration_s": rep["duration_s"]}
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        base = name[:-2]
        metrics[name] = rep[name]["p50"]
        metrics.update({f"{base}_{q}_s": rep[name][q] for q in ("p90", "p99")})
    return metrics, [r.as_json() for r in records_of(rep, w.concurrency)]


def measure_slo(engine, s) -> tuple[dict[str, float], list[dict]]:
    """bench=slo's report card on the engine: its figures (the first of each name; `.of_bound` beside bounded
    ones) and records."""
    from hybrid.bench.slo import measure

    records = [r.as_json() for r in measure(engine, s)]
    metrics: dict[str, float] = {}
    for r in records:
        if isinstance(r.get("value"), (int, float)) and r["name"] not in metrics:
            metrics[r["name"]] = float(r["value"])
            if r.get("fraction_of_bound") is not None:
                metrics[f"{r['name']}.of_bound"] = float(r["fraction_of_bound"])
    return metrics, records


def serve(worker_factory: Callable[[], TrialWorker], before: Optional[Callable[[dict], None]] = None) -> int:
    """Answer requests from stdin until it closes; stdout carries nothing but the answers."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints of the engine (and of native code) go to stderr
    sys.stdout = sys.stderr
    worker = None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        alive = True
        try:
            if before is not None:
                before(req)
            worker = worker or worker_factory()
            op = worker.trial if req["op"] == "trial" else worker.crossover
            out = {"status": "ok", **op(req)}
        except Exception as e:  # noqa: BLE001 - reported to the tuner, which fails the trial
            traceback.print_exc()
            alive = isinstance(e, Refused)  # else the engine may be half-changed: the tuner starts a fresh worker
            out = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        out.update(builds=worker.builds if worker else 0, pid=os.getpid(), alive=alive)
        sys.stderr.flush()
        answers.write(json.dumps(out, default=str) + "\n")
        if not alive:
            return 1
    return 0


def main(before: Optional[Callable[[dict], None]] = None) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `python -m hybrid` (hybrid/cli.py)
    overrides = sys.argv[1:]
    sys.exit(serve(lambda: TrialWorker(overrides), before))


if __name__ == "__main__":
    main()
