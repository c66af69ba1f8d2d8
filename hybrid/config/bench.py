"""Each benchmark's config (`bench=NAME`, conf/bench/NAME.yaml): one dataclass per benchmark with only its keys, and
`bench.sweep`, the one form a benchmark varies policy knobs in.

Hydra composes `bench` as an open node (the schema types it Any); `bench_config` checks it by its `name` into the
benchmark's dataclass while the config becomes settings (compose.to_settings): a key of another benchmark, a value
of the wrong type or a sweep the policy would refuse is a ConfigError naming the key, before anything runs.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybrid.config.schema import KERNELS, PolicyConfig
from hybrid.errors import ConfigError


def _at_least(low: int, **values) -> None:
    """Each value (a number, or every number of a list) >= low, else a ValueError naming bench.<key>."""
    for key, value in values.items():
        if min(value if isinstance(value, list) else [value], default=low) < low:
            raise ValueError(f"bench.{key} must be >= {low}, got {value}")


@dataclass
class KernelsBench:
    """The CPU expert kernels at DeepSeek-V3 shapes against the measured read roof (hybrid/bench/kernels.py)."""
    name: str = "kernels"
    hidden: int = 7168
    inter: int = 2048
    experts: int = 256
    top_k: int = 8
    ms: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 32, 128, 512])  # tokens of the GEMMs
    moe_tokens: List[int] = field(default_factory=lambda: [1, 2, 4])  # tokens through the MoE layer
    cpu_kernels: List[str] = field(default_factory=list)  # variants side by side; empty: policy.cpu.kernel's
    # (and avx512_bf16 beside it when that is amx)
    moe_experts: int = 0  # experts in the benchmarked layer; 0 = `experts` (fewer if memory is short)
    pool_gb: float = 0.0  # cold-weight pool and roof buffer; 0 = auto (1-4 GB by memory)
    repeats: int = 5  # passes; the best counts
    torch_peers: bool = True  # torch's BF16 / FP32 paths side by side

    def __post_init__(self) -> None:
        _at_least(1, ms=self.ms, moe_tokens=self.moe_tokens, repeats=self.repeats, hidden=self.hidden,
                  inter=self.inter, experts=self.experts, top_k=self.top_k)
        if set(self.cpu_kernels) - set(KERNELS):
            raise ValueError(f"bench.cpu_kernels takes {', '.join(KERNELS)}, got {list(self.cpu_kernels)}")


@dataclass
class DecodeBench:
    """Hybrid decode's TPOT and its split per layer at each context length (hybrid/bench/decode.py)."""
    name: str = "decode"
    contexts: List[int] = field(default_factory=lambda: [1024, 4096, 16384, 32768])
    steps: int = 8  # decode steps timed per context
    batch: int = 1
    roof_gb: float = 2.0  # buffer of the read roof that bounds decode
    graph_modes: List[str] = field(default_factory=lambda: ["hostfn", "segments"])  # timed beside eager (GPU)
    numa: List[bool] = field(default_factory=list)  # policy.cpu.numa at each, the model placed anew; []: the policy's

    def __post_init__(self) -> None:
        _at_least(1, contexts=self.contexts, steps=self.steps, batch=self.batch)
        if set(self.graph_modes) - {"hostfn", "segments"}:
            raise ValueError(f"bench.graph_modes takes hostfn and/or segments, got {list(self.graph_modes)}")


@dataclass
class PrefillBench:
    """TTFT by prompt length, stream-loaded against its bound and on the CPU path (hybrid/bench/prefill.py)."""
    name: str = "prefill"
    prompt_lengths: List[int] = field(default_factory=lambda: [128, 512, 2048, 8192, 16384])
    cpu_max_tokens: int = 2048  # the CPU path is timed up to this prompt length
    fp8_tiles: List[str] = field(default_factory=list)  # Triton tiles for prefill-sized rows, e.g. 128x256x64/8/3
    trace: bool = False  # save the profiled run's timeline (Chrome trace beside the results)
    sweep: Optional[Dict[str, Any]] = None  # policy key -> values: the longest prompt again at each combination

    def __post_init__(self) -> None:
        _at_least(1, prompt_lengths=self.prompt_lengths)
        _at_least(0, cpu_max_tokens=self.cpu_max_tokens)


@dataclass
class ConcurrencyBench:
    """nD, 1P, 1P+nD through the scheduler (P: a long prompt, D: a decoding request; hybrid/bench/concurrency.py)."""
    name: str = "concurrency"
    scenarios: List[str] = field(default_factory=lambda: ["1D", "2D", "4D", "1P", "1P+1D", "1P+2D"])
    long_prompt_tokens: int = 32768  # P's prompt
    prompt_tokens: int = 128  # each D's prompt
    new_tokens: int = 24  # D's decode steps timed before P arrives
    roof_gb: float = 0.5  # buffer of the read roof that bounds decode; 0 = no roof, no bound
    dual_batch: bool = False  # the nD scenarios (n >= 2) again without and with policy.decode.dual_batch
    dual_rounds: int = 1  # ... both ways in turn this many times (medians reported)
    sweep: Optional[Dict[str, Any]] = None  # policy key -> values: the scenarios again at each combination

    def __post_init__(self) -> None:
        _at_least(1, long_prompt_tokens=self.long_prompt_tokens, prompt_tokens=self.prompt_tokens,
                  new_tokens=self.new_tokens, dual_rounds=self.dual_rounds)
        _at_least(0, roof_gb=self.roof_gb)
        for scenario in self.scenarios:
            scenario_counts(scenario)


@dataclass
class SloBench:
    """The SLO report card through the engine generate uses: TTFT, TPOT, tokens/s (hybrid/bench/slo.py)."""
    name: str = "slo"
    prompt_tokens: int = 256  # synthetic prompt length, per sequence
    new_tokens: int = 32  # tokens generated per sequence
    batch: int = 1  # requests queued at once: prefilled, then decoded together
    batches: List[int] = field(default_factory=list)  # each of these batch sizes in one run (replaces batch)
    repeats: int = 3  # measured passes after one warm-up; the median counts
    roof_gb: float = 0.5  # buffer of the read roof that bounds decode; 0 = no roof, no bound

    def __post_init__(self) -> None:
        _at_least(1, prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens, batch=self.batch,
                  batches=self.batches, repeats=self.repeats)
        _at_least(0, roof_gb=self.roof_gb)


PROMPT_FORMS = ("ids", "text")


@dataclass
class ServeBench:
    """Load against the real HTTP server, the workload (conf/workload/) at each concurrency (hybrid/bench/serve.py);
    or against any OpenAI-compatible endpoint (a replica, a gateway, another server) instead of one of its own."""
    name: str = "serve"
    concurrency: List[int] = field(default_factory=lambda: [1, 2, 4])  # empty: the workload's own
    endpoint: Optional[str] = None  # a base URL (http://host:port/v1) to drive; null: start a server of our own
    model: Optional[str] = None  # the model to ask the endpoint for; null: the first it lists
    prompt: str = "ids"  # ids: random token ids; text: their text (gateways that take text prompts only)
    metrics: List[str] = field(default_factory=list)  # /metrics URLs whose prefix-cache counters add up (`replicas`:
    # those of mode=replicas' replicas.*); empty: the endpoint's own

    def __post_init__(self) -> None:
        _at_least(1, concurrency=self.concurrency)
        if self.prompt not in PROMPT_FORMS:
            raise ValueError(f"bench.prompt must be one of {', '.join(PROMPT_FORMS)}, got {self.prompt!r}")
        for url in ([self.endpoint] if self.endpoint else []) + [m for m in self.metrics if m != "replicas"]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"bench.endpoint and bench.metrics take http(s) URLs, got {url!r}")


@dataclass
class GpuGemmBench:
    """The GPU ways through one routed expert's FP8 weights at prefill row counts (hybrid/bench/gpu_gemm.py)."""
    name: str = "gpu_gemm"
    hidden: int = 7168
    inter: int = 2048
    repeats: int = 5
    gemm_rows: List[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048, 4096, 8192])
    fp8_tiles: List[str] = field(default_factory=list)  # Triton tiles (BMxBNxBK/warps/stages); empty: the configured

    def __post_init__(self) -> None:
        _at_least(1, hidden=self.hidden, inter=self.inter, repeats=self.repeats, gemm_rows=self.gemm_rows)


BENCHES = {cls.name: cls for cls in (KernelsBench, DecodeBench, PrefillBench, ConcurrencyBench, SloBench, ServeBench,
                                     GpuGemmBench)}


def scenario_counts(name: str) -> tuple[int, int]:
    """bench.scenarios' form: '2D', '1P', '1P+2D' -> (long prompts, decoding requests); anything else is a
    ConfigError naming the form."""
    m = re.fullmatch(r"(1P)?(?:(?(1)\+)([1-9]\d*)D)?", name.replace(" ", ""))
    if not m or not any(m.groups()):
        raise ConfigError(f"bench.scenarios: {name!r} is not nD, 1P or 1P+nD (n >= 1)")
    return 1 if m.group(1) else 0, int(m.group(2) or 0)


def keys_error(name: str, keys) -> Optional[str]:
    """Why bench=NAME cannot take these keys (no such benchmark, or a key it lacks), or None."""
    if name not in BENCHES:
        return f"bench={name}: no such benchmark (available: {', '.join(sorted(BENCHES))})"
    known = [f.name for f in dataclasses.fields(BENCHES[name])]
    unknown = [k for k in keys if k not in known]
    if unknown:
        return f"unknown config key bench.{unknown[0]}: bench={name} takes {', '.join(known)}"
    return None


def bench_config(node: Mapping[str, Any], policy: PolicyConfig):
    """The composed `bench` node as its benchmark's dataclass (by its name), every check run; a sweep flattened
    to {policy key: values} and each value checked against `policy`."""
    name = node.get("name", "kernels")
    error = keys_error(name, node)
    if error:
        raise ConfigError(error)
    try:
        typed = OmegaConf.merge(OmegaConf.structured(BENCHES[name]), dict(node))
    except OmegaConfBaseException as e:
        raise ConfigError(f"bench.{e.full_key}: {str(e.msg).splitlines()[0]}") from None
    b = OmegaConf.to_object(typed)
    if hasattr(b, "sweep"):
        b.sweep = checked_sweep(b.sweep, policy)
    return b


# ----------------------------------------------------------------------------------------------------- sweeps

def policy_keys() -> list[str]:
    """Every knob of the policy by dotted path: "adapt_to_hardware", "cpu.threads", ..."""
    return list(_flat(dataclasses.asdict(PolicyConfig())))


def _flat(sweep: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{prefill: {beside_sms: [..]}} or {prefill.beside_sms: [..]} -> {"prefill.beside_sms": [..]}"""
    out: dict[str, Any] = {}
    for key, values in sweep.items():
        if isinstance(values, Mapping):
            out.update(_flat(values, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = values
    return out


def checked_sweep(sweep: Optional[Mapping[str, Any]], policy: PolicyConfig) -> dict[str, list]:
    """bench.sweep as {policy key: values}: each key a knob of the policy (else a ConfigError naming the close
    ones), each value one the policy takes beside the rest of `policy` (else its own check's error)."""
    flat = _flat(sweep or {})
    known = policy_keys()
    for key, values in flat.items():
        if key not in known:
            close = [k for k in known if k.endswith(f".{key}")] or difflib.get_close_matches(key, known, 3, 0.6)
            hint = f"did you mean {' or '.join(close)}?" if close else f"policy keys: {', '.join(known)}"
            raise ConfigError(f"bench.sweep: {key} is not a policy key ({hint})")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"bench.sweep.{key}: a list of values to measure at, got {values!r}")
        for value in values:
            with_knobs(policy, {key: value})
    return flat


def with_knobs(policy: PolicyConfig, knobs: Mapping[str, Any]) -> PolicyConfig:
    """`policy` with these knobs (dotted paths) set, checked as a composed policy is: each value's type, then the
    policy's own checks; a refusal is a ConfigError naming the sweep's point."""
    cfg = OmegaConf.structured(policy)
    try:
        for key, value in knobs.items():
            OmegaConf.update(cfg, key, value, merge=False)
        return OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError) as e:
        why = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"bench.sweep at {label(knobs)}: {why}") from None


def points(sweep: Optional[Mapping[str, list]]) -> list[dict[str, Any]]:
    """Every combination of a checked sweep's values, [{policy key: value}]; one empty point without a sweep."""
    keys = list(sweep or {})
    return [dict(zip(keys, values)) for values in itertools.product(*[sweep[k] for k in keys])]


def label(point: Mapping[str, Any]) -> str:
    """A point as one line: 'prefill.beside_sms 16, decode.cpu_join host' (null: none)."""
    return ", ".join(f"{k} {'none' if v is None else v}" for k, v in point.items())
