"""The search space: declared in conf/tuner/ per kind of profile (with GPUs or without; policy knob -> how to sample
it, nested like the policy), resolved against this machine, hashed into the study's version, sampled per trial, and
the current policy as the warm start; the objective's metrics, directions and constraints. A knob's name here is its
dotted path in the policy ("cpu.threads"): the Optuna parameter and the key of the trial's policy. null (None) is a
categorical choice like any other: the knob's auto."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from hybrid.errors import ConfigError
from tuner.config import KnobType, Objective, TuneConfig


def resolve(cfg: TuneConfig, gpu: bool, cores: int, kernels: list[str]) -> dict[str, dict[str, Any]]:
    """The space of this kind of profile (gpu: it has GPUs) as plain dicts by knob path, with the machine filled in:
    cpu.threads' high 0 = `cores`; cpu.kernel variants this CPU lacks dropped (null stays: the best it has). The
    result is what the study samples and what its version hashes."""
    out: dict[str, dict[str, Any]] = {}
    for name, knob in sorted(cfg.tuner.space(gpu).items()):
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
        low = min(low, high) if name == "cpu.threads" else low  # a machine with fewer cores than the space's low
        if high < low:
            raise ValueError(f"tuner.spaces.{name}: high {high} < low {low}")
        spec = {"type": knob.type.value, "low": low, "high": high, "log": knob.log}
        if knob.step is not None:
            spec["step"] = cast(knob.step)
        out[name] = spec
    check_values(cfg, gpu, out)
    return out


def check_values(cfg: TuneConfig, gpu: bool, space: dict[str, dict[str, Any]]) -> None:
    """Every choice (and an int or float knob's two ends) is a value the policy's schema takes for that knob: its
    type and its group's own checks (not those across groups, such as batch_cap <= kv.max_batch, which depend on
    what else a trial samples). A space that would only fail trials is refused before the first one, naming the
    knob."""
    import dataclasses

    from tuner.policy import checked  # as each trial's policy goes through the schema, one group at a time

    for name, spec in space.items():
        group, _, knob = name.partition(".")
        current = getattr(cfg.policy, group, None)
        if not knob or not dataclasses.is_dataclass(current):
            continue  # a top-level knob: its type is all the schema knows, and the trial's merge checks it
        values = spec["choices"] if spec["type"] == "categorical" else [spec["low"], spec["high"]]
        for value in values:
            try:
                checked(current, {knob: value})
            except Exception as e:  # noqa: BLE001 - OmegaConf's validation errors and the schema's ValueErrors
                hint = (" (YAML reads an unquoted off/on/yes/no as a boolean: quote it)"
                        if isinstance(value, bool) and not isinstance(getattr(current, knob, None), bool) else "")
                raise ConfigError(f"tuner.spaces.{'gpu' if gpu else 'cpu_only'}.{name}: {value!r} is not a value of "
                                  f"policy.{name}{hint}: {str(e).splitlines()[0]}") from None


def reload_knobs(cfg: TuneConfig, gpu: bool, rebuildable: frozenset) -> set[str]:
    """The knobs of the space whose change needs the model placed again (the trial worker restarts): tagged
    `reload: true`, or untagged and not among those the engine rebuilds. `reload: false` on a knob the engine cannot
    rebuild is refused."""
    out = set()
    for name, knob in cfg.tuner.space(gpu).items():
        if knob.reload is False and name not in rebuildable:
            raise ConfigError(f"tuner.spaces.{'gpu' if gpu else 'cpu_only'}.{name}: reload: false, but the engine "
                              "cannot change it without placing the model again (it rebuilds "
                              f"{', '.join(sorted(rebuildable))})")
        if knob.reload or (knob.reload is None and name not in rebuildable):
            out.add(name)
    return out


def objective_spec(cfg: TuneConfig) -> dict[str, Any]:
    t = cfg.tuner
    spec: dict[str, Any] = {"objective": t.objective.value, "metrics": dict(t.goal.metrics),
                            "limits": dict(sorted(limits(cfg).items()))}
    if t.sampler.value != "tpe":
        spec["sampler"] = t.sampler.value
    return spec


def limits(cfg: TuneConfig) -> dict[str, float]:
    """Feasible only if metric <= limit for each: tuner.limits, and the objective's own (no failed request under a
    workload; ttft_p90: p90 TPOT within the workload's limit)."""
    t = cfg.tuner
    out = dict(t.limits)
    if t.goal.measure == "workload":
        out.setdefault("errors", 0.0)
    if t.objective == Objective.ttft_p90:
        out.setdefault("tpot_p90_s", cfg.workload.tpot_limit_s)
    return out


def directions(cfg: TuneConfig) -> list[str]:
    return list(cfg.tuner.goal.metrics.values())


def objective_metrics(cfg: TuneConfig) -> list[str]:
    return list(cfg.tuner.goal.metrics)


def measured(cfg: TuneConfig) -> dict[str, Any]:
    """What a trial measures, as its sizes: the workload, or bench=slo's prompt."""
    if cfg.tuner.goal.measure == "workload":
        w = cfg.workload
        return {"workload": {k: getattr(w, k) for k in ("name", "prompt_tokens", "output_tokens", "ttft_limit_s",
                                                         "tpot_limit_s", "requests", "concurrency", "rate", "seed")}}
    b = cfg.bench
    return {"bench": {"name": b.name, "prompt_tokens": b.prompt_tokens, "new_tokens": b.new_tokens, "batch": b.batch}}


def version(space: dict, cfg: TuneConfig) -> str:
    """A hash of what makes trials comparable: the space, the objective, what a trial measures and how the cutoff
    is set. Optuna refuses a categorical whose choices changed within a study, and mixing measurements of different
    loads is wrong: a new version is a new study."""
    what = {"space": space, "objective": objective_spec(cfg), **measured(cfg), "cutoff": cfg.tuner.cutoff.value}
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:8]


def study_name(cfg: TuneConfig, space: dict) -> str:
    if cfg.tuner.study_name:
        return cfg.tuner.study_name
    grid = "-grid" if cfg.tuner.sampler.value == "grid" else ""
    return f"{cfg.hw.name}-{cfg.model.name}-{cfg.tuner.objective.value}{grid}-v{version(space, cfg)}"


def grid(space: dict) -> dict[str, list]:
    """Every value of each knob: a categorical's choices, an int range by its step (1), a float range by its step."""
    out = {}
    for name, spec in space.items():
        if spec["type"] == "categorical":
            out[name] = list(spec["choices"])
        else:
            step = spec.get("step") or 1
            n = int(round((spec["high"] - spec["low"]) / step))
            out[name] = [spec["low"] + i * step for i in range(n + 1)]
    return out


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



def flat_measured(cfg: TuneConfig) -> dict[str, Any]:
    """`measured` flattened: {"workload.requests": 32, ...}."""
    return {f"{group}.{k}": v for group, sizes in measured(cfg).items() for k, v in sizes.items()}
