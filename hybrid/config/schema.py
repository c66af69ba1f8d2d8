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

BUILTIN_PROMPT = "The three laws of thermodynamics are"


class Mode(Enum):
    generate = "generate"
    bench = "bench"


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


@dataclass
class PolicyConfig:
    # When the machine lacks what the hw profile needs: false = stop and say what is missing,
    # true = warn, then adapt (GPU work on the CPU, fewer threads, ...).
    adapt_to_hardware: bool = False
    cpu_threads: int = 0  # threads of the CPU expert kernels; 0 = all physical cores
    cpu_kernel: str = "auto"  # CPU kernel ISA: auto | avx512_bf16 | avx2 | generic
    moe_backend: str = "native"  # routed experts: native (the C++ CPU kernels) | torch (reference path)
    cpu_gemm_tile_tokens: int = 64  # tokens per expert from which FP8 tiles are converted once and reused
    slp_cutoff_tokens: int = 128  # prompts longer than this are prefilled on the GPU by stream-loading
    ring_len: str = "auto"  # expert slots of the stream-loading ring buffer: a number >= 1, or auto
    slp_chunk_tokens: int = 0  # stream-loading prefill in chunks of this many tokens; 0 = auto (as memory allows)
    slp_group_experts: str = "auto"  # SLP: up to this many experts computed together; auto: 16 where it applies
    batch_cap: int = 6  # most requests running at once (holding a KV slot: prefilling or decoding)
    prefill_chunk_tokens: int = 512  # prompts on the chunked path go in this many tokens per engine step
    max_batch: int = 8  # KV-cache slots (sequences held at once)
    max_context: int = 4096  # tokens per sequence the KV cache holds
    gpu_experts_per_layer: int = 0  # hot routed experts kept resident on the GPU, per layer
    deferred_experts: int = 0  # experts deferred to overlap the next layer (changes outputs slightly)
    gpu_memory_budget_gb: float = 0.0  # GPU memory the engine may hold; 0 = all free memory less a reserve
    cuda_graphs: str = "hostfn"  # decode under CUDA graphs: hostfn (one graph, CPU hand-off as host nodes) | segments | off
    gpu_fp8_gemm: str = "triton"  # FP8 weights on the GPU (streamed experts, gpu_weights=fp8): triton | dequant | auto
    gpu_fp8_dequant_rows: int = 512  # auto: from this many rows, dequantise + cuBLAS instead of the FP8 GEMM
    gpu_weights: str = "dense"  # FP8 weights of the GPU side: dense (dequantised once) | fp8 (kept; dequantised per use)

    def __post_init__(self) -> None:
        for knob in ("ring_len", "slp_group_experts"):  # text knobs: a number or auto
            value = getattr(self, knob)
            if value != "auto" and not (value.isdecimal() and int(value) >= 1):
                raise ValueError(f"policy.{knob} must be a number >= 1 or 'auto', got {value!r}")
        if self.gpu_weights not in ("dense", "fp8"):
            raise ValueError(f"policy.gpu_weights must be dense or fp8, got {self.gpu_weights!r}")
        if self.cuda_graphs not in ("hostfn", "segments", "off"):
            raise ValueError(f"policy.cuda_graphs must be hostfn, segments or off, got {self.cuda_graphs!r}")
        if self.gpu_fp8_gemm not in ("auto", "triton", "dequant"):
            raise ValueError(f"policy.gpu_fp8_gemm must be auto, triton or dequant, got {self.gpu_fp8_gemm!r}")
        if self.moe_backend not in ("native", "torch"):
            raise ValueError(f"policy.moe_backend must be native or torch, got {self.moe_backend!r}")
        if self.cpu_kernel not in ("auto", "avx512_bf16", "avx2", "generic"):
            raise ValueError(
                f"policy.cpu_kernel must be auto, avx512_bf16, avx2 or generic, got {self.cpu_kernel!r}"
            )
        for knob in ("cpu_threads", "slp_cutoff_tokens", "slp_chunk_tokens", "gpu_experts_per_layer",
                     "deferred_experts"):
            if getattr(self, knob) < 0:
                raise ValueError(f"policy.{knob} must be >= 0, got {getattr(self, knob)}")
        for knob in ("batch_cap", "max_batch", "max_context", "cpu_gemm_tile_tokens", "gpu_fp8_dequant_rows",
                     "prefill_chunk_tokens"):
            if getattr(self, knob) < 1:
                raise ValueError(f"policy.{knob} must be >= 1, got {getattr(self, knob)}")
        if self.batch_cap > self.max_batch:
            raise ValueError(
                f"policy.batch_cap ({self.batch_cap}) exceeds policy.max_batch ({self.max_batch}), "
                "the number of KV-cache slots"
            )


@dataclass
class BenchConfig:
    name: str = "kernels"
    # kernels: DeepSeek-V3 expert shapes, token counts, the MoE layer
    hidden: int = 7168
    inter: int = 2048
    experts: int = 256
    top_k: int = 8
    ms: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 32, 128, 512])
    moe_tokens: List[int] = field(default_factory=lambda: [1, 2, 4])
    moe_experts: int = 0  # experts in the benchmarked layer; 0 = `experts` (fewer if memory is short)
    pool_gb: float = 0.0  # cold-weight pool and roof buffer; 0 = auto (1-4 GB by memory)
    repeats: int = 5  # passes; the best counts
    torch_peers: bool = True  # torch's BF16 / FP32 paths side by side
    # slo: the SLO report card of the configured model (TTFT, TPOT, prefill and decode tokens/s)
    prompt_tokens: int = 256  # synthetic prompt length, per sequence
    new_tokens: int = 32  # tokens generated per sequence
    batch: int = 1  # sequences prefilled, then decoded together
    roof_gb: float = 0.5  # buffer of the memory read roof that bounds decode; 0 = no roof, no bound
    # decode: TPOT and its per-layer split at these context lengths
    contexts: List[int] = field(default_factory=lambda: [1024, 4096, 16384, 32768])
    steps: int = 8  # decode steps timed per context
    graph_modes: List[str] = field(default_factory=lambda: ["hostfn", "segments"])  # measured beside eager (GPU)
    # prefill: TTFT by prompt length, stream-loading vs the CPU path, ring-length sweep
    prompt_lengths: List[int] = field(default_factory=lambda: [128, 512, 2048, 8192, 16384])
    ring_sweep: List[int] = field(default_factory=lambda: [2, 8, 32, 128])  # at the longest prompt
    group_sweep: List[int] = field(default_factory=list)  # policy.slp_group_experts values timed at the longest
    cpu_max_tokens: int = 2048  # the CPU path is timed up to this prompt length
    fp8_tiles: List[str] = field(default_factory=list)  # Triton tiles for prefill-sized rows to time, e.g. 128x256x64/8/3
    # gpu_gemm: the GPU ways through one expert's FP8 weights (fp8_tiles above; hidden, inter, repeats)
    gemm_rows: List[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048, 4096, 8192])
    trace: bool = False  # prefill: save the profiled run's timeline (Chrome trace, .trace.json.gz beside the results)

    def __post_init__(self) -> None:
        if min([*self.ms, *self.moe_tokens, *self.gemm_rows, *self.group_sweep], default=1) < 1 or self.repeats < 1:
            raise ValueError("bench: token counts, group sizes and repeats must be >= 1")
        for knob in ("prompt_tokens", "new_tokens", "batch"):
            if getattr(self, knob) < 1:
                raise ValueError(f"bench.{knob} must be >= 1, got {getattr(self, knob)}")
        if self.roof_gb < 0:
            raise ValueError(f"bench.roof_gb must be >= 0, got {self.roof_gb}")
        if set(self.graph_modes) - {"hostfn", "segments"}:
            raise ValueError(f"bench.graph_modes takes hostfn and/or segments, got {list(self.graph_modes)}")


@dataclass
class TrackingConfig:
    """MLflow run tracking (hybrid/tracking.py): every run logs params, metrics, the resolved config, plots."""
    enabled: bool = True  # conf/config.yaml: true unless the environment sets HYBRID_TRACKING=0
    uri: str = ""  # "" = sqlite under runs/ (runs/mlflow.db); or a server, e.g. http://host:5000
    artifact_root: str = ""  # "" = runs/mlartifacts (local stores only; a server keeps its own)
    experiment: str = ""  # "" = one experiment per model: hybrid-<model.name>


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
    bench: BenchConfig = field(default_factory=BenchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def register() -> None:
    ConfigStore.instance().store(name="schema", node=HybridConfig)
