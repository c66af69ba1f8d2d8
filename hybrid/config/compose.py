"""Where configs and run outputs live, and composition outside of the command line (tests, the tuner)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from hybrid.config.schema import HybridConfig, register

PROJECT_DIR = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_DIR / "conf"
RUNS_DIR = Path(os.environ.get("HYBRID_RUNS_DIR", PROJECT_DIR / "runs"))


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the config as `python -m hybrid <overrides>` would."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def to_settings(cfg: DictConfig) -> HybridConfig:
    """The composed config as validated dataclasses (runs every `__post_init__` check)."""
    return OmegaConf.to_object(cfg)
