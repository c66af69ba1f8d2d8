"""The tuner's typed configuration: `conf/tune.yaml` = the engine's HybridConfig plus `tuner` (conf/tuner/)."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional

from hydra.core.config_store import ConfigStore

from hybrid.config.schema import HybridConfig, PolicyConfig


class Objective(Enum):
    constrained = "constrained"
    pareto = "pareto"


class Direction(Enum):
    minimize = "minimize"
    maximize = "maximize"


class KnobType(Enum):
    int = "int"
    float = "float"
    categorical = "categorical"


@dataclass
class Knob:
    type: KnobType = KnobType.categorical
    low: Optional[float] = None  # int / float
    high: Optional[float] = None  # int / float; cpu.threads: 0 = the machine's physical cores
    step: Optional[float] = None
    log: bool = False
    choices: List[Any] = field(default_factory=list)  # categorical; null is a choice too (the knob's auto)


@dataclass
class TunerConfig:
    n_trials: int = 20
    objective: Objective = Objective.constrained
    metric: str = "decode_tok_s"
    direction: Direction = Direction.maximize
    pareto: Dict[str, Direction] = field(default_factory=lambda: {"ttft_s": Direction.minimize,
                                                                    "tpot_s": Direction.minimize})
    limits: Dict[str, float] = field(default_factory=lambda: {"ttft_s": 30.0})
    # group -> knob -> {type, low, high, step, log, choices}, nested like the policy: plain dicts for Hydra (a knob
    # can be added on the command line: '+tuner.space.kv.max_batch={type:int,low:1,high:8}'), checked below and
    # flattened to Knobs by dotted path ("cpu.threads": the policy knob, the Optuna parameter's name)
    space: Dict[str, Any] = field(default_factory=dict)
    enqueue: List[Dict[str, Any]] = field(default_factory=list)  # knob -> value, nested or by dotted path
    storage: str = ""
    study_name: str = ""
    trial_timeout_s: float = 300.0
    startup_trials: int = 4
    seed: Optional[int] = None
    heartbeat_s: int = 10
    grace_s: int = 30
    max_retry: int = 2
    write_policy: bool = True
    trial_module: str = "hybrid"  # each trial runs `python -m <it> mode=bench bench=slo ...`

    def __post_init__(self) -> None:
        if self.n_trials < 1:
            raise ValueError(f"tuner.n_trials must be >= 1, got {self.n_trials}")
        if not all(part.isidentifier() for part in self.trial_module.split(".")):
            raise ValueError(f"tuner.trial_module must be a module name, got {self.trial_module!r}")
        if self.trial_timeout_s <= 0:
            raise ValueError(f"tuner.trial_timeout_s must be > 0, got {self.trial_timeout_s}")
        if self.heartbeat_s < 1 or self.grace_s <= self.heartbeat_s:
            raise ValueError(f"tuner: need heartbeat_s >= 1 and grace_s > heartbeat_s, got {self.heartbeat_s}, "
                             f"{self.grace_s}")
        self.space = knobs(self.space)
        for name, knob in self.space.items():
            if knob.type == KnobType.categorical and not knob.choices:
                raise ValueError(f"tuner.space.{name}: categorical without choices")
            if knob.type != KnobType.categorical and (knob.low is None or knob.high is None):
                raise ValueError(f"tuner.space.{name}: {knob.type.value} needs low and high")
        if self.objective == Objective.pareto and len(self.pareto) < 2:
            raise ValueError("tuner.pareto: a Pareto front needs two or more metrics")


def knob_paths(schema: type = PolicyConfig, prefix: str = "") -> list[str]:
    """Every knob of the policy by dotted path: "adapt_to_hardware", "cpu.threads", ..."""
    out, types = [], typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(types[f.name]):
            out += knob_paths(types[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def groups() -> set[str]:
    return {path.rsplit(".", 1)[0] for path in knob_paths() if "." in path}


def knobs(space: Mapping[str, Any], prefix: str = "") -> dict[str, Knob]:
    """The space, nested like the policy ({cpu: {threads: {type: int, ...}}}; dotted keys work too), as
    {"cpu.threads": Knob}; a path that is no policy knob is refused."""
    out: dict[str, Knob] = {}
    known = knob_paths()
    for key, spec in space.items():
        path = f"{prefix}{key}"
        if path in known:
            out[path] = _knob(path, spec)
        elif path in groups() and isinstance(spec, Mapping):
            out.update(knobs(spec, f"{path}."))
        else:
            raise ValueError(f"tuner.space.{path}: not a policy knob (known: {', '.join(known)})")
    return out


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Knob values nested like the policy ({cpu: {threads: 2}}) or by dotted path, as {"cpu.threads": 2}."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        path = f"{prefix}{key}"
        if path in groups() and isinstance(value, Mapping):
            out.update(flat_params(value, f"{path}."))
        else:
            out[path] = value
    return out


def _knob(name: str, spec: Any) -> Knob:
    if isinstance(spec, Knob):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f"tuner.space.{name}: expected {{type: ..., ...}}, got {spec!r}")
    unknown = set(spec) - set(Knob.__dataclass_fields__)
    if unknown:
        raise ValueError(f"tuner.space.{name}: unknown field {sorted(unknown)[0]} (known: type, low, high, step, log, "
                         "choices)")
    try:
        kind = KnobType(spec.get("type", "categorical"))
    except ValueError:
        raise ValueError(f"tuner.space.{name}.type: int, float or categorical, got {spec.get('type')!r}") from None
    return Knob(**{**spec, "type": kind, "choices": list(spec.get("choices") or [])})


@dataclass
class TuneConfig(HybridConfig):
    tuner: TunerConfig = field(default_factory=TunerConfig)


def register() -> None:
    """The tuner's schema in the engine's place: conf/config.yaml's `schema` entry then types `tuner` too (a
    subclass listed after it would reset every value composed before it to its defaults)."""
    ConfigStore.instance().store(name="schema", node=TuneConfig)
