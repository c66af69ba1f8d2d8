"""A trial command for the tuner's tests (`tuner.trial_module=tests.tuner.faulty_bench`): `python -m hybrid` with a
fault injected first. HYBRID_TEST_INJECT_FAULT="<trial>:<crash|hang>[,...]" makes the trial of that number (the
tuner's HYBRID_TUNER_TRIAL) raise or hang; every other trial runs the bench as usual."""
from __future__ import annotations

import os
import sys
import time

from tuner.trial import TRIAL_ENV

FAULT_ENV = "HYBRID_TEST_INJECT_FAULT"
MODULE = "tests.tuner.faulty_bench"


def inject() -> None:
    spec, trial = os.environ.get(FAULT_ENV), os.environ.get(TRIAL_ENV)
    if not spec or trial is None:
        return
    for item in spec.split(","):
        number, _, kind = item.partition(":")
        if number.strip() == trial:
            print(f"{FAULT_ENV}: injected {kind} in trial {trial}", file=sys.stderr, flush=True)
            if kind == "hang":
                while True:
                    time.sleep(60)
            raise RuntimeError(f"{FAULT_ENV}: injected crash in trial {trial}")


if __name__ == "__main__":
    inject()
    from hybrid.cli import main

    main()
