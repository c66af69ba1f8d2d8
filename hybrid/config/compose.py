"""Where configs and run outputs live, and composition outside of the command line (tests, the tuner)."""
from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf

from hybrid.config.bench import bench_config, keys_error
from hybrid.config.schema import MOVED, HybridConfig, register
from hybrid.errors import ConfigError

PROJECT_DIR = Path(__file__).resolve().parents[2]
CONF_DIR = Path(os.environ.get("HYBRID_CONF_DIR", PROJECT_DIR / "conf"))  # another conf/ tree: tests, the tuner's
RUNS_DIR = Path(os.environ.get("HYBRID_RUNS_DIR", PROJECT_DIR / "runs"))
# hydra.run.dir ends in the process id (conf/config.yaml): processes started in the same second get their own.
OmegaConf.register_new_resolver("hybrid.pid", os.getpid, replace=True)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the config as `python -m hybrid <overrides>` would."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def to_settings(cfg: DictConfig) -> HybridConfig:
    """The composed config as validated dataclasses (runs every `__post_init__` check). Keys the schema does not
    know (`+policy.typo=1` gets past Hydra) are refused rather than silently ignored; `bench` becomes its
    benchmark's dataclass (hybrid/config/bench.py)."""
    settings = OmegaConf.to_object(cfg)
    _refuse_unknown(settings, "")
    settings.bench = bench_config(settings.bench, settings.policy)
    return settings


def settings_of(cfg: DictConfig) -> HybridConfig:
    """to_settings, with a schema check's failure as one line of ConfigError (what a user sees)."""
    try:
        return to_settings(cfg)
    except Exception as e:  # omegaconf wraps the schema's __post_init__ errors
        raise ConfigError(str(getattr(e, "msg", e)).splitlines()[0]) from e


def unknown_override(overrides: Iterable[str], schema: type = HybridConfig, config: str = "config") -> Optional[str]:
    """The first `key=value` override whose key the schema lacks, as one line (what a user sees instead of Hydra's
    several), or None. A `bench.KEY` is checked against the benchmark chosen (`bench=NAME`, else conf/<config>.yaml's
    default). Keys below a node the schema leaves open (dicts, lists) are Hydra's to check; `+key=...` is refused
    after composition (to_settings), `~key` and Hydra's own options are left alone."""
    overrides = list(overrides)
    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" not in o or key.startswith(("-", "+", "~", "hydra")) or "@" in key or "/" in key:
            continue
        node: object = schema
        parts = key.split(".")
        if parts[0] == "bench" and len(parts) > 1:
            error = keys_error(_choice("bench", overrides, config), parts[1:2])
            if error:
                return error
            continue
        for i, part in enumerate(parts):
            if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
                break
            types = typing.get_type_hints(node)
            known = [f.name for f in dataclasses.fields(node)]
            if part not in known:
                return _unknown(".".join(parts[:i + 1]), known)
            node = _unwrap(types[part])
    return None


def _choice(group: str, overrides: Sequence[str], config: str) -> Optional[str]:
    """The option of `group` a command line picks: its last `group=NAME`, else the config's defaults list's."""
    picked = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == group]
    return picked[-1] if picked else _default(group, config)


def _default(group: str, config: str) -> Optional[str]:
    """The option conf/<config>.yaml's defaults list picks for `group` (an `override` after what it includes)."""
    choice = None
    for entry in yaml.safe_load((CONF_DIR / f"{config}.yaml").read_text()).get("defaults", []):
        if isinstance(entry, str) and (CONF_DIR / f"{entry}.yaml").exists():
            choice = _default(group, entry) or choice
        elif isinstance(entry, dict):
            choice = next((v for k, v in entry.items() if k.removeprefix("override ") == group), choice)
    return choice


def _unwrap(t: object) -> object:
    """Optional[X] -> X; other types as they are."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t


def _unknown(key: str, known: Iterable[str]) -> str:
    moved = MOVED.get(key.removeprefix("policy.")) if key.startswith("policy.") else None
    if moved:
        return f"unknown config key {key}: now policy.{moved} (the policy's keys were regrouped on 2026-12-01)"
    return f"unknown config key {key} (known: {', '.join(sorted(known))})"


def _refuse_unknown(obj, prefix: str) -> None:
    if not dataclasses.is_dataclass(obj):
        return
    known = {f.name for f in dataclasses.fields(obj)}
    unknown = sorted(set(vars(obj)) - known)
    if unknown:
        raise ValueError(_unknown(prefix + unknown[0], known))
    for name in known:
        _refuse_unknown(getattr(obj, name), f"{prefix}{name}.")
