"""The search space: declared in conf/tuner/ (policy knob -> how to sample it, nested like the policy), resolved
against this machine, hashed into the study's version, sampled per trial, and the current policy as the warm start.
A knob's name here is its dotted path in the policy ("cpu.threads"): the Optuna parameter and the trial's override
`policy.cpu.threads=...`. null (None) is a categorical choice like any other: the knob's auto."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from tuner.config import KnobType, Objective, TuneConfig


def resolve(cfg: TuneConfig, cores: int, kernels: list[str]) -> dict[str, dict[str, Any]]:
    """Plain dicts by knob path, with the machine filled in: cpu.threads' high 0 = `cores`; cpu.kernel variants this
    CPU lacks dropped (null stays: the best it has). The result is what the study samples and what its version
    hashes."""
    out: dict[str, dict[str, Any]] = {}
    for name, knob in sorted(cfg.tuner.space.items()):
        if knob.type == KnobType.categorical:
            choices = list(knob.choices)
            if name == "cpu.kernel":
                choices = [c for c in choices if c is None or c in kernels]
            out[name] = {"type": "categorical", "choices": choices}
            continue
        cast = int if knob.type == KnobType.int else float
        low, high = cast(knob.low), cast(knob.high)
        if name == "cpu.threads" and high == 0:
            high = cores
        if high < low:
            raise ValueError(f"tuner.space.{name}: high {high} < low {low}")
        spec = {"type": knob.type.value, "low": low, "high": high, "log": knob.log}
        if knob.step is not None:
            spec["step"] = cast(knob.step)
        out[name] = spec
    return out


def objective_spec(cfg: TuneConfig) -> dict[str, Any]:
    t = cfg.tuner
    spec: dict[str, Any] = {"objective": t.objective.value, "limits": dict(sorted(t.limits.items()))}
    if t.objective == Objective.constrained:
        spec.update(metric=t.metric, direction=t.direction.value)
    else:
        spec["pareto"] = {k: v.value for k, v in t.pareto.items()}
    return spec


def directions(cfg: TuneConfig) -> list[str]:
    t = cfg.tuner
    if t.objective == Objective.constrained:
        return [t.direction.value]
    return [d.value for d in t.pareto.values()]


def objective_metrics(cfg: TuneConfig) -> list[str]:
    t = cfg.tuner
    return [t.metric] if t.objective == Objective.constrained else list(t.pareto)


def version(space: dict, cfg: TuneConfig) -> str:
    """A hash of what makes trials comparable: the space, the objective and the bench's sizes. Optuna refuses a
    categorical whose choices changed within a study, and mixing measurements of different benches is wrong: a
    new version is a new study."""
    b = cfg.bench
    what = {"space": space, "objective": objective_spec(cfg),
            "bench": {"name": b.name, "prompt_tokens": b.prompt_tokens, "new_tokens": b.new_tokens,
                      "batch": b.batch}}
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:8]


def study_name(cfg: TuneConfig, space: dict) -> str:
    if cfg.tuner.study_name:
        return cfg.tuner.study_name
    return f"{cfg.hw.name}-{cfg.model.name}-{cfg.tuner.objective.value}-v{version(space, cfg)}"


def suggest(trial, space: dict) -> dict[str, Any]:
    params = {}
    for name, spec in space.items():
        if spec["type"] == "categorical":
            params[name] = trial.suggest_categorical(name, spec["choices"])
        elif spec["type"] == "int":
            params[name] = trial.suggest_int(name, spec["low"], spec["high"], step=spec.get("step", 1),
                                             log=spec["log"])
        else:
            params[name] = trial.suggest_float(name, spec["low"], spec["high"], step=spec.get("step"),
                                               log=spec["log"])
    return params


def in_space(params: dict[str, Any], space: dict) -> dict[str, Any]:
    """The entries of `params` (knob path -> value) the space can hold (others are left for the sampler): a
    categorical's choice (null included), a number in a numeric range (null lies in none)."""
    out = {}
    for name, value in params.items():
        spec = space.get(name)
        if spec is None:
            continue
        if spec["type"] == "categorical":
            same = [c for c in spec["choices"] if c == value and isinstance(c, bool) == isinstance(value, bool)]
            if same:
                out[name] = same[0]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and spec["low"] <= value <= spec["high"]:
            out[name] = value
    return out


def warm_start(cfg: TuneConfig, space: dict, cores: int) -> dict[str, Any]:
    """The current policy (the composed one: conf/policy/<hw>.yaml once tuned) as a point of the space, each knob
    read by its path."""
    current = {}
    for name in space:
        node = cfg.policy
        for part in name.split("."):
            node = getattr(node, part)
        current[name] = node
    if "cpu.threads" in current and current["cpu.threads"] is None:  # null = all physical cores
        current["cpu.threads"] = cores
    return in_space(current, space)


def as_override_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value.replace("_", "").isalnum() else json.dumps(value)
    return str(value)

