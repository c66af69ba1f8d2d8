"""Typed configuration: the dataclass schemas Hydra validates every config against.

Each group of `conf/` mirrors one dataclass here. Hydra checks names and types while composing; `to_object` then
runs the `__post_init__` checks, so every config error surfaces before anything is built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hybrid.config.replicas import ReplicasConfig
from hybrid.errors import ConfigError

BUILTIN_PROMPT = "The three laws of thermodynamics are"


class Mode(Enum):
    generate = "generate"
    bench = "bench"
    serve = "serve"
    replicas = "replicas"


class OutputFormat(Enum):
    text = "text"
    json = "json"


class DType(Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"


@dataclass
class CpuSpec:
    model: str = ""  # brand string, informational
    isa: List[str] = field(default_factory=list)  # features the profile's kernels need, cpuid names
    sockets: int = 1
    cores: int = 0  # physical cores in total; 0 = no requirement
    numa_nodes: int = 1
    memory_gb: float = 0.0  # DRAM; 0 = no requirement
    mem_bw_gbps: float = 0.0  # theoretical DRAM bandwidth; 0 = unknown

    def __post_init__(self) -> None:
        if self.cores < 0 or self.memory_gb < 0 or self.sockets < 1 or self.numa_nodes < 1:
            raise ValueError(f"hw.cpu: counts must be positive, got {self}")


@dataclass
class GpuSpec:
    name: str = ""
    memory_gb: float = 0.0
    pcie_gbps: float = 0.0  # host<->device, one direction, theoretical


@dataclass
class HwConfig:
    name: str = "auto"  # "auto" = the detected machine, else a profile from conf/hw/
    description: str = ""
    cpu: CpuSpec = field(default_factory=CpuSpec)
    gpus: List[GpuSpec] = field(default_factory=list)
    # Prompt length (tokens) where `bench=prefill` measured the CPU path and stream-loading equally fast on this
    # machine (DeepSeek-V3's expert shape); policy.prefill.slp_cutoff_tokens' default. null: not measured (128).
    slp_crossover_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.slp_crossover_tokens is not None and self.slp_crossover_tokens < 0:
            raise ValueError(f"hw.slp_crossover_tokens must be >= 0 or null, got {self.slp_crossover_tokens}")


DEFAULT_SLP_CUTOFF = 128  # tokens: policy.prefill.slp_cutoff_tokens where neither the policy nor the profile says


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: Optional[str] = None  # a Hugging Face checkpoint directory; its config.json decides the architecture
    # A generated checkpoint instead of `path`: `base` (deepseek_v3 | kimi_k2) plus config.json fields to override.
    synthetic: Optional[Dict[str, Any]] = None
    seed: int = 0  # seed of the generated weights
    in_memory: bool = False  # generate the synthetic weights in memory and skip the disk
    dtype: DType = DType.bfloat16  # activation / compute dtype; weights stay as stored

    def __post_init__(self) -> None:
        if self.path is not None:  # a checkpoint directory wins over the group's generated default
            self.synthetic, self.in_memory = None, False
            self.name = Path(self.path).name or self.name
        elif self.synthetic is None:
            raise ValueError(f"model '{self.name}': set model.path (a checkpoint directory) or model.synthetic")


# CPU kernel ISA variants (hybrid/kernels/dispatch.py VARIANTS)
KERNELS = ("amx", "avx512_bf16", "avx512", "avx2", "generic")


def _at_least(group: object, path: str, low: int, *knobs: str, optional: bool = False) -> None:
    """Each knob >= low (or null, where optional), else a ValueError naming policy.<path>.<knob>."""
    for knob in knobs:
        value = getattr(group, knob)
        if value is None and optional:
            continue
        if value is None or value < low:
            null = " or null" if optional else ""
            raise ValueError(f"policy.{path}.{knob} must be >= {low}{null}, got {value}")


def _one_of(group: object, path: str, knob: str, choices: tuple) -> None:
    value = getattr(group, knob)
    if value not in choices:
        names = ", ".join("null" if c is None else str(c).lower() if isinstance(c, bool) else c for c in choices)
        raise ValueError(f"policy.{path}.{knob} must be one of {names}, got {value!r}")


@dataclass
class CpuPolicy:
    """The CPU expert kernels (hybrid/kernels/, placement's CpuExperts)."""
    threads: Optional[int] = None  # threads of the kernels; null = the profile's physical cores, else the machine's
    # ISA: null (HYBRID_CPU_KERNEL, else the best) | amx | avx512_bf16 | avx512 | avx2 | generic
    kernel: Optional[str] = None
    moe_backend: str = "native"  # routed experts: native (the C++ CPU kernels) | torch (reference path)
    gemm_tile_tokens: Optional[int] = None  # tokens per expert from which FP8 tiles are converted once and reused;
    # null = 16 where avx512_bf16 multiplies them in the outer-product form, 64 elsewhere and under batch_invariant
    amx_min_tokens: Optional[int] = None  # kernel amx: tokens per expert from which AMX tiles run; null = 4 (H200
    # host: AMX ahead from 4), 1 under decode.batch_invariant (every expert call on tiles)
    deferred_experts: int = 0  # experts deferred to overlap the next layer (changes outputs slightly)
    lm_head: str = "bf16"  # lm_head without a GPU: bf16 (as published) | fp8 (quantised at load; changes logits)
    amx_overlap: Optional[bool] = None  # kernel amx: the next weight slab converted while this one's tiles multiply
    # (the same bits either way); null = on
    numa: Optional[bool] = None  # per-node thread pools, each node's share of the experts bound to it; null = on
    # where the machine has more than one NUMA node
    numa_simulated: int = 0  # N >= 2: this machine's CPUs in N groups run as N nodes, memory left where it is (tests)
    numa_split: Optional[List[float]] = None  # each node's share of every MoE layer's expert bytes; null = equal

    def __post_init__(self) -> None:
        _at_least(self, "cpu", 1, "threads", optional=True)
        if self.numa_simulated == 1 or self.numa_simulated < 0:
            raise ConfigError(f"policy.cpu.numa_simulated must be 0 (off) or >= 2, got {self.numa_simulated}")
        if self.numa_split is not None and (not self.numa_split or min(self.numa_split) <= 0):
            raise ConfigError(f"policy.cpu.numa_split: a positive share per node, got {list(self.numa_split)}")
        _one_of(self, "cpu", "lm_head", ("bf16", "fp8"))
        _one_of(self, "cpu", "kernel", (None, *KERNELS))
        _one_of(self, "cpu", "moe_backend", ("native", "torch"))
        _at_least(self, "cpu", 1, "gemm_tile_tokens", "amx_min_tokens", optional=True)
        _at_least(self, "cpu", 0, "deferred_experts")


@dataclass
class KvPolicy:
    """The KV cache."""
    max_batch: int = 8  # KV-cache slots (sequences held at once)
    max_context: int = 4096  # tokens per sequence the KV cache holds
    block_tokens: int = 256  # positions per block of the paged cache (a multiple of 256; a prefix is reused in these)
    prefix_cache: bool = True  # a request reuses the KV of the longest prompt prefix cached (whole blocks)
    cache_gb: float = 0.0  # device pool room beyond the slots' own blocks, for cached prefixes
    host_cache_gb: Optional[float] = None  # host tier for prefixes evicted from the device; null: what the host has left

    def __post_init__(self) -> None:
        _at_least(self, "kv", 1, "max_batch", "max_context", "block_tokens")
        if self.block_tokens % 256:
            raise ConfigError(f"policy.kv.block_tokens={self.block_tokens}: a multiple of 256 (the decode-attention "
                              "kernels' chunk of positions)")
        if self.cache_gb < 0 or (self.host_cache_gb is not None and self.host_cache_gb < 0):
            raise ConfigError("policy.kv.cache_gb and policy.kv.host_cache_gb are >= 0")


@dataclass
class PrefillPolicy:
    """Prefill: chunked on the engine's step, or stream-loaded on the GPU (hybrid/prefill/)."""
    chunk_tokens: int = 512  # prompts on the chunked path go in this many tokens per engine step
    slp_cutoff_tokens: Optional[int] = None  # longer prompts are stream-loaded; null: hw.slp_crossover_tokens or 128
    ring_len: Optional[int] = None  # expert slots of the stream-loading ring buffer; null = as memory allows
    slp_chunk_tokens: Optional[int] = None  # stream-loading prefill in chunks of this many tokens; null: as memory fits
    slp_group_experts: Optional[int] = None  # SLP: up to this many experts computed together; null: 16 where it applies
    gpus: Optional[int] = None  # GPUs a long prompt's prefill may take when nothing decodes: 1 | 2; null: min(2, hw's)
    ep: str = "smallep"  # experts over two GPUs: smallep (tokens gathered, partial sums exchanged) | ep (picks sent)
    beside_decode: bool = False  # a stream-loaded prompt runs on a thread of its own while the others keep decoding
    stream_cap_gbps: Optional[float] = None  # beside decode, while requests decode: the stream's copies at most this
    stream_duty: Optional[float] = None  # ... and the prefill at work at most this share of the time (null: always)
    attention_chunk_tokens: int = 2048  # a prompt's attention in query chunks of this many (0: one call per layer)
    beside_cores: int = 2  # while a prompt streams beside decode, decode's CPU experts leave this many cores to it
    stream_queue_mb: int = 16  # beside decode, while requests decode: the stream's copies queued at a time (0: any)
    cores_back_in_rests: bool = True  # a decode step begun in the duty cycle's rest runs on beside_cores too
    # beside decode, the prefill's kernels leave this many SMs to decode's (None: auto)
    beside_sms: Optional[int] = None

    def __post_init__(self) -> None:
        _at_least(self, "prefill", 1, "chunk_tokens")
        _at_least(self, "prefill", 0, "slp_cutoff_tokens", "beside_sms", optional=True)
        _at_least(self, "prefill", 0, "attention_chunk_tokens", "beside_cores", "stream_queue_mb")
        _at_least(self, "prefill", 1, "ring_len", "slp_chunk_tokens", "slp_group_experts", optional=True)
        if self.gpus not in (None, 1, 2):
            raise ValueError(f"policy.prefill.gpus must be 1, 2 or null, got {self.gpus}")
        _one_of(self, "prefill", "ep", ("smallep", "ep"))
        if self.stream_cap_gbps is not None and not self.stream_cap_gbps > 0:
            raise ValueError(f"policy.prefill.stream_cap_gbps must be > 0 GB/s or null (no cap), "
                             f"got {self.stream_cap_gbps}")
        if self.stream_duty is not None and not 0 < self.stream_duty <= 1:
            raise ValueError(f"policy.prefill.stream_duty is the prefill's share of the time while requests decode, "
                             f"in (0, 1] or null (always at work), got {self.stream_duty}")


CPU_JOINS = ("signal", "host")  # policy.decode.cpu_join's values (null: auto)


@dataclass
class DecodePolicy:
    """Decode steps and the requests batched into them."""
    batch_cap: int = 6  # most requests running at once (holding a KV slot: prefilling or decoding)
    cuda_graphs: str = "hostfn"  # CUDA graphs: hostfn (one graph, CPU hand-off as host nodes) | segments | off
    dual_batch: Optional[bool] = None  # >= 2 decoding: two micro-batches, one's GPU work beside the other's CPU
    # experts (null: on where decode runs hostfn graphs, off elsewhere)
    dual_stagger: bool = True  # dual_batch under hostfn graphs: each micro-batch's next step launched once sampled
    batch_invariant: bool = False  # a sequence's numbers independent of its batch mates: GPU GEMMs padded, MLA
    # decode attention in fixed chunks (placement); the CPU kernels one form at every token count (configure_cpu)
    mapped_outputs: bool = True  # GPU: the CPU experts' outputs read in place from pinned memory, not copied back
    cpu_join: Optional[str] = None  # hostfn graphs: the GPU waits for the CPU experts on a signal word | a host node

    def __post_init__(self) -> None:
        _at_least(self, "decode", 1, "batch_cap")
        _one_of(self, "decode", "cuda_graphs", ("hostfn", "segments", "off"))
        _one_of(self, "decode", "cpu_join", (None, *CPU_JOINS))
        _one_of(self, "decode", "dual_batch", (None, False, True))


@dataclass
class GpuPolicy:
    """The GPU side: its memory, its weights, hot experts."""
    memory_budget_gb: Optional[float] = None  # GPU memory the engine may hold; null = all free memory less a reserve
    weights: str = "dense"  # FP8 weights of the GPU side: dense (dequantised once) | fp8 (kept; dequantised per use)
    fp8_gemm: str = "triton"  # FP8 weights on the GPU (streamed experts, weights=fp8): triton | dequant | auto
    fp8_dequant_rows: int = 512  # auto: from this many rows, dequantise + cuBLAS instead of the FP8 GEMM
    experts_per_layer: int = 0  # hot routed experts kept resident on the GPU, per layer

    def __post_init__(self) -> None:
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise ValueError(f"policy.gpu.memory_budget_gb must be > 0 or null, got {self.memory_budget_gb}")
        _one_of(self, "gpu", "weights", ("dense", "fp8"))
        _one_of(self, "gpu", "fp8_gemm", ("auto", "triton", "dequant"))
        _at_least(self, "gpu", 1, "fp8_dequant_rows")
        _at_least(self, "gpu", 0, "experts_per_layer")


@dataclass
class PolicyConfig:
    """The tunable knobs (conf/policy/), grouped by what reads them; null = decided by hybrid/plan/resolve.py, which
    also checks the knobs against each other and the machine, into the Plan."""
    # When the machine lacks what the hw profile needs: false = stop and say what is missing,
    # true = warn, then adapt (GPU work on the CPU, fewer threads, ...).
    adapt_to_hardware: bool = False
    cpu: CpuPolicy = field(default_factory=CpuPolicy)
    kv: KvPolicy = field(default_factory=KvPolicy)
    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    decode: DecodePolicy = field(default_factory=DecodePolicy)
    gpu: GpuPolicy = field(default_factory=GpuPolicy)


# The flat policy keys of before 2026-12-01 -> their paths since (named when a command line still gives an old one)
MOVED = {"cpu_threads": "cpu.threads", "cpu_kernel": "cpu.kernel", "moe_backend": "cpu.moe_backend",
         "cpu_gemm_tile_tokens": "cpu.gemm_tile_tokens", "deferred_experts": "cpu.deferred_experts",
         "max_batch": "kv.max_batch", "max_context": "kv.max_context", "prefill_chunk_tokens": "prefill.chunk_tokens",
         "slp_cutoff_tokens": "prefill.slp_cutoff_tokens", "ring_len": "prefill.ring_len",
         "slp_chunk_tokens": "prefill.slp_chunk_tokens", "slp_group_experts": "prefill.slp_group_experts",
         "batch_cap": "decode.batch_cap", "cuda_graphs": "decode.cuda_graphs",
         "gpu_memory_budget_gb": "gpu.memory_budget_gb", "gpu_weights": "gpu.weights", "gpu_fp8_gemm": "gpu.fp8_gemm",
         "gpu_fp8_dequant_rows": "gpu.fp8_dequant_rows", "gpu_experts_per_layer": "gpu.experts_per_layer"}


@dataclass
class TrackingConfig:
    """MLflow run tracking (hybrid/tracking.py): every run logs params, metrics, the resolved config, plots."""
    enabled: bool = True  # conf/config.yaml: true unless the environment sets HYBRID_TRACKING=0
    uri: str = ""  # "" = sqlite under runs/ (runs/mlflow.db); or a server, e.g. http://host:5000
    artifact_root: str = ""  # "" = runs/mlartifacts (local stores only; a server keeps its own)
    experiment: str = ""  # "" = one experiment per model: hybrid-<model.name>


@dataclass
class ServerConfig:
    """`mode=serve`: the OpenAI-compatible HTTP server (hybrid/serve/)."""
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    api_key: Optional[str] = None  # set: every route but /health needs `Authorization: Bearer <api_key>`
    api_key_file: Optional[str] = None  # or the key from this file (its first line); else $HYBRID_API_KEY if set
    model_name: Optional[str] = None  # the `model` clients name; null = the model config's name
    max_waiting: int = 64  # requests that found no free KV slot; at this many, new ones get 429
    shutdown_grace_s: float = 30.0  # on SIGTERM/Ctrl-C: time the requests in flight get to finish
    max_body_mb: float = 8.0  # larger request bodies get 413 before they are read
    cors_origins: List[str] = field(default_factory=list)  # origins browsers may call from (["*"]: any)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in 0..65535, got {self.port}")
        if self.max_waiting < 1:
            raise ConfigError(f"server.max_waiting must be >= 1, got {self.max_waiting}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"server.shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("server.api_key must not be empty (null: no key)")
        if self.max_body_mb <= 0:
            raise ConfigError(f"server.max_body_mb must be > 0, got {self.max_body_mb}")


WORKLOAD_KINDS = ("single", "multi_turn")


@dataclass
class WorkloadConfig:
    """`bench=serve`'s load (conf/workload/), of one of two kinds; the SLO limits goodput counts against and the
    output lengths (drawn uniformly per request) are both kinds'.

    single: independent requests, prompt lengths drawn uniformly, at a fixed concurrency or a Poisson arrival rate.
    multi_turn: `sessions` conversations sharing one system prompt of `system_tokens` random ids; each turn re-sends
    the conversation so far plus a new message of `message_tokens` ids, until a session's next turn (its prompt and
    answer) would exceed `context_tokens`; `concurrency` sessions in flight at once. Each kind ignores the other's
    fields."""
    name: str = "chat"
    kind: str = "single"  # single | multi_turn
    output_tokens: List[int] = field(default_factory=lambda: [16, 128])  # [lo, hi], inclusive
    ttft_limit_s: float = 2.0
    tpot_limit_s: float = 0.2
    concurrency: Optional[int] = 4  # clients (sessions), each sending its next request when its last one ends
    seed: int = 0
    # single
    prompt_tokens: List[int] = field(default_factory=lambda: [32, 256])  # [lo, hi], inclusive
    requests: int = 32
    rate: Optional[float] = None  # or requests per second (Poisson arrivals); set concurrency to null
    # multi_turn
    sessions: int = 4
    system_tokens: int = 1024  # the one system prompt every session starts with
    message_tokens: List[int] = field(default_factory=lambda: [500, 4000])  # each turn's new user / tool message
    context_tokens: int = 32768  # a session ends before a turn whose prompt and answer would exceed this

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ConfigError(f"workload.kind must be one of {', '.join(WORKLOAD_KINDS)}, got {self.kind!r}")
        ranges = ("prompt_tokens", "output_tokens") if self.kind == "single" else ("message_tokens", "output_tokens")
        for knob in ranges:
            lo_hi = list(getattr(self, knob))
            if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
                raise ConfigError(f"workload.{knob} must be [lo, hi] with 1 <= lo <= hi, got {lo_hi}")
        if min(self.ttft_limit_s, self.tpot_limit_s) <= 0:
            raise ConfigError("workload.ttft_limit_s and workload.tpot_limit_s must be > 0")
        if self.kind == "multi_turn":
            self._check_turns()
            return
        if (self.concurrency is None) == (self.rate is None):
            raise ConfigError("workload: set exactly one of workload.concurrency and workload.rate")
        if (self.concurrency is not None and self.concurrency < 1) or (self.rate is not None and self.rate <= 0):
            raise ConfigError("workload.concurrency must be >= 1 and workload.rate > 0")
        if self.requests < 1:
            raise ConfigError("workload.requests must be >= 1")

    def _check_turns(self) -> None:
        if self.rate is not None or self.concurrency is None or self.concurrency < 1:
            raise ConfigError(f"workload {self.name} (multi_turn): sessions in flight are workload.concurrency "
                              f"(>= 1), with workload.rate null; got concurrency {self.concurrency}, rate {self.rate}")
        if self.sessions < 1 or self.system_tokens < 0:
            raise ConfigError(f"workload.sessions must be >= 1 and workload.system_tokens >= 0, got "
                              f"{self.sessions} and {self.system_tokens}")
        first = self.system_tokens + self.message_tokens[1] + self.output_tokens[1]
        if first > self.context_tokens:
            raise ConfigError(f"workload {self.name}: a first turn takes up to system_tokens {self.system_tokens} + "
                              f"message_tokens {self.message_tokens[1]} + output_tokens {self.output_tokens[1]} = "
                              f"{first} tokens, over workload.context_tokens {self.context_tokens}")


@dataclass
class HybridConfig:
    hw: HwConfig = field(default_factory=HwConfig)
    model: ModelConfig = MISSING  # from the model group (conf/model/)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    mode: Mode = Mode.generate
    # generate mode
    prompt: str = BUILTIN_PROMPT
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int = 0
    chat: bool = False  # wrap the prompt in the checkpoint's chat template
    output: OutputFormat = OutputFormat.text
    # mode=bench: the benchmark's own dataclass, by bench.name (hybrid/config/bench.py; checked in to_settings)
    bench: Any = field(default_factory=lambda: {"name": "kernels"})
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def register() -> None:
    ConfigStore.instance().store(name="schema", node=HybridConfig)
