"""policy.prefill.slp_cutoff_tokens measured for a study (`tuner.cutoff=measure`, a GPU profile with a workload
objective): the crossover of the two prefill paths' TTFT on the workload's prompt lengths, timed by the trial worker
before the first trial and kept in the study's user attributes.
"""
from __future__ import annotations

import sys
import time
from typing import Optional

from tuner import space as sp
from tuner.track import fresh_user_attrs

CUTOFF = "prefill.slp_cutoff_tokens"


def measured_crossover(tuner, study) -> Optional[dict]:
    """tuner.cutoff=measure on a GPU profile: the crossover of the two prefill paths on the workload's prompt
    lengths (measured once per study, by the first tuner to get there), which becomes every trial's cutoff;
    None where it is not measured."""
    t = tuner.cfg.tuner
    if not tuner.gpu:
        if t.goal.measure == "workload":
            print("cutoff: no GPU in this profile: every prompt takes the CPU path, so "
                  f"policy.{CUTOFF} is moot (not measured)", flush=True)
        return None
    if not tuner.measure_cutoff:
        return None
    cross = study.user_attrs.get("crossover")
    if cross is None:
        w = tuner.cfg.workload
        lengths = spread(w.prompt_tokens[0], w.prompt_tokens[1], t.crossover_lengths)
        warm = {**sp.warm_start(tuner.cfg, tuner.space, tuner.machine.physical_cores)}
        print(f"cutoff: timing the first token on both prefill paths at {lengths} tokens ...", flush=True)
        t0 = time.monotonic()
        try:
            cross = tuner.worker.call(tuner.key(warm), {"op": "crossover", "policy": warm, "lengths": lengths},
                                     t.trial_timeout_s, tuner.log_dir / "crossover.log")
        except RuntimeError as e:
            print(f"warning: cutoff not measured ({e}): policy.{CUTOFF} stays as configured "
                  f"({tuner.cfg.policy.prefill.slp_cutoff_tokens})", file=sys.stderr, flush=True)
            return None
        cross = {**cross, "lengths": lengths, "policy": warm, "seconds": round(time.monotonic() - t0, 2)}
        if "crossover" not in fresh_user_attrs(study):
            study.set_user_attr("crossover", cross)
        cross = fresh_user_attrs(study)["crossover"]
    shown = ", ".join(f"{n}: CPU {c:.3f} s / SLP {g:.3f} s" for (n, c), (_, g) in zip(cross["cpu"], cross["slp"]))
    print(f"cutoff: policy.{CUTOFF}={cross['cutoff']} for every trial (TTFT {shown})", flush=True)
    return cross


def spread(lo: int, hi: int, n: int) -> list[int]:
    """n prompt lengths from lo to hi, evenly on a log scale (fewer where they round to the same)."""
    if lo == hi:
        return [lo]
    return sorted({round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)})

