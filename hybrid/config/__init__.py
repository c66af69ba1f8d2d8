"""Configuration: schemas, composition from `conf/`, validation."""
from hybrid.config.compose import CONF_DIR, RUNS_DIR, compose, to_settings
from hybrid.config.schema import HybridConfig

__all__ = ["CONF_DIR", "RUNS_DIR", "HybridConfig", "compose", "to_settings"]
