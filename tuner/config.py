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
    decode_tok_s = "decode_tok_s"  # bench=slo's decode tokens/s (maximise), one prompt size
    goodput = "goodput"  # the workload's requests/s meeting its TTFT and TPOT limits (maximise)
    ttft_p90 = "ttft_p90"  # the workload's p90 TTFT (minimise) subject to p90 TPOT <= its TPOT limit
    pareto = "pareto"  # the workload's p90 TTFT and p90 TPOT (both minimised); the policy: the front's best goodput


@dataclass(frozen=True)
class Goal:
    """What an objective measures (`slo`: bench=slo's report card; `workload`: the workload driven at the engine)
    and optimises: metric -> direction."""
    measure: str
    metrics: Dict[str, str]


GOALS = {Objective.decode_tok_s: Goal("slo", {"decode_tok_s": "maximize"}),
         Objective.goodput: Goal("workload", {"goodput_req_s": "maximize"}),
         Objective.ttft_p90: Goal("workload", {"ttft_p90_s": "minimize"}),
         Objective.pareto: Goal("workload", {"ttft_p90_s": "minimize", "tpot_p90_s": "minimize"})}


class Sampler(Enum):
    tpe = "tpe"  # TPE, warm-started with the current policy
    grid = "grid"  # every combination of the space's values (int ranges by their step), each once


class Cutoff(Enum):
    measure = "measure"  # the crossover of the two prefill paths' TTFT on the workload's prompt lengths
    search = "search"  # sampled like any other knob


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
    # A change of this knob needs the model loaded and placed again (the trial worker restarts); false: the worker
    # rebuilds the engine around the placed model. null: as the plan says (hybrid/plan/plan.py).
    reload: Optional[bool] = None


@dataclass
class TunerConfig:
    n_trials: int = 20
    objective: Objective = Objective.goodput
    # Extra constraints, whatever the objective: metric -> most it may be (ttft_p90 adds its own TPOT limit)
    limits: Dict[str, float] = field(default_factory=dict)
    # The search space per kind of hw profile (gpu: the profile lists GPUs; cpu_only: it does not). Each: group ->
    # knob -> {type, low, high, step, log, choices, reload}, nested like the policy: plain dicts for Hydra (a knob
    # can be added on the command line: '+tuner.spaces.gpu.kv.max_batch={type:int,low:1,high:8}'), checked below
    # and flattened to Knobs by dotted path ("cpu.threads": the policy knob, the Optuna parameter's name)
    spaces: Dict[str, Any] = field(default_factory=lambda: {"cpu_only": {}, "gpu": {}})
    cutoff: Cutoff = Cutoff.measure
    crossover_lengths: int = 5  # prompt lengths the cutoff is measured at, spread over the workload's range
    sampler: Sampler = Sampler.tpe
    enqueue: List[Dict[str, Any]] = field(default_factory=list)  # knob -> value, nested or by dotted path
    storage: str = ""
    study_name: str = ""
    trial_timeout_s: float = 300.0
    startup_trials: int = 4
    multivariate: bool = True  # TPE models the knobs jointly (their interactions), not one by one
    seed: Optional[int] = None
    heartbeat_s: int = 10
    grace_s: int = 30
    max_retry: int = 2
    write_policy: bool = True
    trial_module: str = "tuner.worker"  # `python -m <it> <overrides>`: the trial worker, or a wrapper of its main()

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
        if set(self.spaces) != set(SPACE_KINDS):
            raise ValueError(f"tuner.spaces: one space per kind of profile, {' and '.join(SPACE_KINDS)}; got "
                             f"{sorted(self.spaces)}")
        if self.crossover_lengths < 2:
            raise ValueError(f"tuner.crossover_lengths must be >= 2, got {self.crossover_lengths}")
        self.spaces = {kind: knobs(space or {}, f"{kind}.") for kind, space in self.spaces.items()}
        for kind, space in self.spaces.items():
            for name, knob in space.items():
                where = f"tuner.spaces.{kind}.{name}"
                if knob.type == KnobType.categorical and not knob.choices:
                    raise ValueError(f"{where}: categorical without choices")
                if knob.type != KnobType.categorical and (knob.low is None or knob.high is None):
                    raise ValueError(f"{where}: {knob.type.value} needs low and high")
                if self.sampler == Sampler.grid and knob.type == KnobType.float and knob.step is None:
                    raise ValueError(f"{where}: tuner.sampler=grid needs a step for a float knob")

    @property
    def goal(self) -> Goal:
        return GOALS[self.objective]

    def space(self, gpu: bool) -> dict[str, Knob]:
        """The space of a profile with GPUs (gpu) or without."""
        return self.spaces["gpu" if gpu else "cpu_only"]


SPACE_KINDS = ("cpu_only", "gpu")


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


def knobs(space: Mapping[str, Any], where: str = "", prefix: str = "") -> dict[str, Knob]:
    """A space, nested like the policy ({cpu: {threads: {type: int, ...}}}; dotted keys work too), as
    {"cpu.threads": Knob}; a path that is no policy knob is refused (`where`: the space's name in messages)."""
    out: dict[str, Knob] = {}
    known = knob_paths()
    for key, spec in space.items():
        path = f"{prefix}{key}"
        if path in known:
            out[path] = _knob(f"{where}{path}", spec)
        elif path in groups() and isinstance(spec, Mapping):
            out.update(knobs(spec, where, f"{path}."))
        else:
            raise ValueError(f"tuner.spaces.{where}{path}: not a policy knob (known: {', '.join(known)})")
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
        raise ValueError(f"tuner.spaces.{name}: expected {{type: ..., ...}}, got {spec!r}")
    unknown = set(spec) - set(Knob.__dataclass_fields__)
    if unknown:
        raise ValueError(f"tuner.spaces.{name}: unknown field {sorted(unknown)[0]} (known: type, low, high, step, log, "
                         "choices, reload)")
    try:
        kind = KnobType(spec.get("type", "categorical"))
    except ValueError:
        raise ValueError(f"tuner.spaces.{name}.type: int, float or categorical, got {spec.get('type')!r}") from None
    return Knob(**{**spec, "type": kind, "choices": list(spec.get("choices") or [])})


@dataclass
class TuneConfig(HybridConfig):
    tuner: TunerConfig = field(default_factory=TunerConfig)


def register() -> None:
    """The tuner's schema in the engine's place: conf/config.yaml's `schema` entry then types `tuner` too (a
    subclass listed after it would reset every value composed before it to its defaults)."""
    ConfigStore.instance().store(name="schema", node=TuneConfig)
