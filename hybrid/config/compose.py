"""Where configs and run outputs live, and composition outside of the command line (tests, the tuner)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from hybrid.config.schema import HybridConfig, register
from hybrid.errors import ConfigError

PROJECT_DIR = Path(__file__).resolve().parents[2]
CONF_DIR = Path(os.environ.get("HYBRID_CONF_DIR", PROJECT_DIR / "conf"))  # another conf/ tree: tests, the tuner's
RUNS_DIR = Path(os.environ.get("HYBRID_RUNS_DIR", PROJECT_DIR / "runs"))


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the config as `python -m hybrid <overrides>` would."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def to_settings(cfg: DictConfig) -> HybridConfig:
    """The composed config as validated dataclasses (runs every `__post_init__` check). Keys the schema does not
    know (`+policy.typo=1` gets past Hydra) are refused rather than silently ignored."""
    settings = OmegaConf.to_object(cfg)
    _refuse_unknown(settings, "")
    return settings


def settings_of(cfg: DictConfig) -> HybridConfig:
    """to_settings, with a schema check's failure as one line of ConfigError (what a user sees)."""
    try:
        return to_settings(cfg)
    except Exception as e:  # omegaconf wraps the schema's __post_init__ errors
        raise ConfigError(str(getattr(e, "msg", e)).splitlines()[0]) from e


def _refuse_unknown(obj, prefix: str) -> None:
    if not dataclasses.is_dataclass(obj):
        return
    known = {f.name for f in dataclasses.fields(obj)}
    unknown = sorted(set(vars(obj)) - known)
    if unknown:
        raise ValueError(f"unknown config key {prefix}{unknown[0]} (known: {', '.join(sorted(known))})")
    for name in known:
        _refuse_unknown(getattr(obj, name), f"{prefix}{name}.")
