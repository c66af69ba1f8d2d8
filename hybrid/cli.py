"""`python -m hybrid`: compose the configs with Hydra, then run. Errors in the user's input end the run with one
clear message and exit status 2."""
from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from hybrid.config.compose import CONF_DIR, unknown_override
from hybrid.config.schema import register
from hybrid.errors import HybridError


def _task(cfg: DictConfig) -> None:
    from hybrid.run import run

    try:
        run(cfg)
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    # torch's OpenMP workers spin after each op by default, taking the cores from the native pool's workers that
    # run next (CPU decode of dsv3_slice: 190 -> 150 ms per token passive); read when torch loads, so set first
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    register()
    unknown = unknown_override(sys.argv[1:])
    if unknown:
        print(f"error: {unknown}", file=sys.stderr)
        sys.exit(2)
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_task)()
