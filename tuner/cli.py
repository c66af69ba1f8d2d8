"""`python -m tuner +hw=NAME [overrides]` (console script `hybrid-tune`): tune the policy of a hardware profile on
this machine. Composes conf/tune.yaml (the engine's config plus conf/tuner/) with Hydra; `--cfg job` prints it."""
from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybrid.config.compose import CONF_DIR, unknown_override
from hybrid.errors import HybridError
from tuner.config import TuneConfig, register


def _task(cfg: DictConfig) -> None:
    from tuner.study import Tuner, install_sigterm

    install_sigterm()
    try:
        Tuner(cfg, list(HydraConfig.get().overrides.task)).run()
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def main() -> None:
    register()
    unknown = unknown_override(sys.argv[1:], TuneConfig, config="tune")
    if unknown:
        print(f"error: {unknown}", file=sys.stderr)
        sys.exit(2)
    hydra.main(config_path=str(CONF_DIR), config_name="tune", version_base="1.3")(_task)()
