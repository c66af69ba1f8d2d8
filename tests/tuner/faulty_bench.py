"""A trial worker for the tuner's tests (`tuner.trial_module=tests.tuner.faulty_bench`): tuner.worker with a fault
injected first. HYBRID_TEST_INJECT_FAULT="<trial>:<crash|hang|die>[,...]" makes the request of that trial number
raise (the worker reports the error and exits), hang, or end the worker without a word; every other request is
served as usual."""
from __future__ import annotations

import os
import sys
import time

FAULT_ENV = "HYBRID_TEST_INJECT_FAULT"
MODULE = "tests.tuner.faulty_bench"


def inject(request: dict) -> None:
    spec, trial = os.environ.get(FAULT_ENV), request.get("trial")
    if not spec or trial is None:
        return
    for item in spec.split(","):
        number, _, kind = item.partition(":")
        if number.strip() == str(trial):
            print(f"{FAULT_ENV}: injected {kind} in trial {trial}", file=sys.stderr, flush=True)
            if kind == "hang":
                while True:
                    time.sleep(60)
            if kind == "die":
                os._exit(3)
            raise RuntimeError(f"{FAULT_ENV}: injected crash in trial {trial}")


if __name__ == "__main__":
    from tuner.worker import main

    main(before=inject)
