"""The plan: every knob of the policy as this machine and model get it, decided once by `resolve`
(hybrid/plan/resolve.py) before anything is built, frozen, printed at start-up and logged with the run.

Nested like the policy and under the policy's names; a knob the policy leaves `null` holds its decided value here.
Where a number stands for "none" it says so (ring_len 0: as deep as memory allows per prompt; stream_cap_gbps 0: no
cap; stream_duty 1: always at work; beside_sms 0: the prefill on every SM). The memory ledger comes from the bytes
placement measured (`resolve_memory`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Optional

# What placing the model reads of the plan: a plan that differs there needs the model placed again (build); one
# that differs elsewhere is applied around the placed model (replan). The tuner's trials follow the same line.
PLACED = {"placed": True}


@dataclass(frozen=True)
class Ledger:
    """Device memory (bytes) as planned at build: the budget left beside the placed weights and what each use
    takes from it; the stream-loading ring and the prompt's activations share `free`, per prompt."""
    budget: float
    weights: float
    kv_cache: float
    hot_experts: float
    group_buffer: float

    @property
    def free(self) -> float:
        return self.budget - self.kv_cache - self.group_buffer

    def rows(self) -> list[tuple[str, float]]:
        return [("weights", self.weights), ("hot experts", self.hot_experts), ("KV cache", self.kv_cache),
                ("SLP group buffer", self.group_buffer), ("left for ring + activations", self.free)]

    def params(self) -> dict:
        return {**asdict(self), "free": self.free}


@dataclass(frozen=True)
class CpuPlan:
    """The native kernels' process-wide settings and the routed experts' form (configure_cpu, placement)."""
    threads: int
    kernel: str = field(metadata=PLACED)  # the ISA variant that runs: amx | avx512_bf16 | avx512 | avx2 | generic
    moe_backend: str = field(metadata=PLACED)
    gemm_tile_tokens: int
    amx_min_tokens: int
    batch_invariant: bool  # the kernels keep one form of sums at every token count (decode.batch_invariant)
    deferred_experts: int = field(metadata=PLACED)
    lm_head: str = field(metadata=PLACED)  # bf16 | fp8: the lm_head's weights on the CPU (bf16 where a GPU holds it)
    amx_overlap: bool
    # NUMA (docs/design/numa.md): pools per node, each node's share of the experts bound to it
    numa: bool = field(default=False, metadata=PLACED)
    numa_simulated: int = field(default=0, metadata=PLACED)  # N: the nodes are N groups of CPUs, memory left as is
    numa_nodes: tuple[tuple[int, ...], ...] = field(default=(), metadata=PLACED)  # per node, its threads' CPUs
    numa_threads: tuple[int, ...] = ()  # per node, its threads (summing to threads)
    numa_split: tuple[float, ...] = field(default=(), metadata=PLACED)  # per node, its share of each layer's experts


@dataclass(frozen=True)
class KvPlan:
    max_batch: int = field(metadata=PLACED)
    max_context: int = field(metadata=PLACED)
    block_tokens: int = field(metadata=PLACED)  # min(the policy's, max_context): a slot's whole context in one block
    prefix_cache: bool
    cache_gb: float = field(metadata=PLACED)
    host_cache_gb: float  # 0: no host tier (decided with the ledger: resolve_memory)


@dataclass(frozen=True)
class PrefillPlan:
    chunk_tokens: int
    attention_chunk_tokens: int  # 0: one attention call per layer
    slp_cutoff_tokens: int
    slp: bool  # whether prompts above the cutoff are stream-loaded here (a GPU, native experts, a MoE model)
    ring_len: int  # 0: per prompt, as deep as memory allows
    slp_chunk_tokens: int  # 0: the whole prompt at once (decided with the ledger: resolve_memory)
    slp_group_experts: int
    gpus: int = field(metadata=PLACED)  # 2: a prefill peer process serves the second device
    ep: str
    beside_decode: bool
    beside_cores: int
    stream_cap_gbps: float  # 0: no cap
    stream_queue_mb: float  # 0: no bound
    stream_duty: float  # 1: always at work
    cores_back_in_rests: bool
    beside_sms: int  # SMs the prefill beside decode leaves to decode (0: it takes every SM)


@dataclass(frozen=True)
class DecodePlan:
    batch_cap: int
    cuda_graphs: str  # off where graphs do not apply here
    dual_batch: bool
    dual_stagger: bool
    batch_invariant: bool = field(metadata=PLACED)
    mapped_outputs: bool
    cpu_join: str  # signal | host (hostfn graphs' join; host elsewhere)


@dataclass(frozen=True)
class GpuPlan:
    memory_budget_gb: float = field(metadata=PLACED)  # 0: all free memory less a reserve
    weights: str = field(metadata=PLACED)
    fp8_gemm: str = field(metadata=PLACED)
    fp8_dequant_rows: int = field(metadata=PLACED)
    experts_per_layer: int
    pad_rows: int = field(metadata=PLACED)  # batch-invariant decode: GPU GEMMs padded to this many rows (0: off)
    sms: int  # the device's SMs (0 without a GPU)


@dataclass(frozen=True)
class Plan:
    device: str = field(metadata=PLACED)  # the compute device: cuda:0 | cpu
    cpu: CpuPlan
    kv: KvPlan
    prefill: PrefillPlan
    decode: DecodePlan
    gpu: GpuPlan
    ledger: Optional[Ledger] = None  # resolve_memory's, once placement measured the bytes
    notes: tuple[str, ...] = ()  # what resolve decided against the policy's wish (printed at build)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def prefill_sms(self) -> Optional[int]:
        """The SMs a prompt prefilled beside decode computes on (None: every SM)."""
        p = self.prefill
        return self.gpu.sms - p.beside_sms if p.beside_decode and p.beside_sms else None

    def decode_threads(self, beside: bool) -> int:
        """Threads of decode's CPU experts: all of them, but while a prompt streams beside decode `beside_cores`
        fewer (at least one): the pool's workers are pinned, one per core, so a core the prefill's own threads take
        from a worker holds that worker's task, and the step, until the scheduler gives it back."""
        return max(1, self.cpu.threads - self.prefill.beside_cores) if beside else self.cpu.threads

    def params(self) -> dict:
        """Flat dotted name -> value, for tracking."""
        out = {k: v for k, v in flat(self).items() if k not in ("notes", "ledger")}
        if self.ledger is not None:
            out["ledger.free"] = self.ledger.free
        return out

    def describe(self) -> str:
        """The plan as the start-up banner prints it."""
        c, k, p, d, g = self.cpu, self.kv, self.prefill, self.decode, self.gpu
        amx = f", AMX from {c.amx_min_tokens}" if c.kernel == "amx" else ""
        lines = [f"plan: device {self.device}, {c.threads} CPU threads, CPU kernel {c.kernel} "
                 f"(tiles reused from {c.gemm_tile_tokens} tokens per expert{amx}"
                 + ("; batch-invariant: one form of sums at every token count" if c.batch_invariant else "")
                 + f"), experts on {c.moe_backend}" + ("" if self.cuda else f", lm_head {c.lm_head}"),
                 f"  requests: {k.max_batch} KV slots x {k.max_context} tokens in blocks of {k.block_tokens}"
                 + (f" (+{k.cache_gb:g} GB)" if k.cache_gb else "") + ", prefix cache "
                 + ((f"on (host tier {k.host_cache_gb:.1f} GB)" if k.host_cache_gb else "on") if k.prefix_cache
                    else "off") + f", at most {d.batch_cap} running, "
                 f"prefill chunks of {p.chunk_tokens} tokens, "
                 + (f"attention over longer prompts in query chunks of {p.attention_chunk_tokens}"
                    if p.attention_chunk_tokens else "attention in one call per layer")
                 + (", decode in two micro-batches " + (f"overlapped ({d.cuda_graphs} graphs on two streams"
                                                        + (", half a step apart)" if d.dual_stagger else ")")
                                                        if d.cuda_graphs != "off" else "in turn (no overlap)")
                    if d.dual_batch else "")]
        if c.numa:
            lines.insert(1, self._describe_numa())
        if self.cuda:
            lines += [self._describe_prefill(),
                      f"  GPU: weights {g.weights}, FP8 GEMM {g.fp8_gemm}, CUDA graphs {d.cuda_graphs}"
                      + (f" (CPU experts joined by {'a signal word' if d.cpu_join == 'signal' else 'a host node'})"
                         if d.cuda_graphs == "hostfn" else "") + ", "
                      f"CPU experts' outputs {'read in place' if d.mapped_outputs else 'copied back'}, "
                      f"{g.experts_per_layer} hot experts per layer, decode "
                      + (f"batch-invariant (GEMMs padded to {g.pad_rows} rows, attention in fixed chunks)"
                         if g.pad_rows else "not batch-invariant (einsum attention)")]
            if self.ledger is not None:
                lines.append("  memory: " + ", ".join(f"{name} {b / 1e9:.2f} GB" for name, b in self.ledger.rows()))
        return "\n".join(lines)

    def _describe_numa(self) -> str:
        c = self.cpu
        nodes = f"{len(c.numa_nodes)} nodes (CPUs " + " | ".join(cpu_ranges(n) for n in c.numa_nodes) + ")"
        if c.numa_simulated:
            nodes = f"{len(c.numa_nodes)} CPU groups as nodes (CPUs " + nodes.split("(CPUs ", 1)[1]
        where = "memory left where it is (simulated)" if c.numa_simulated else "each bound to its node"
        return (f"  NUMA: {nodes}, a thread pool per node of " + " + ".join(map(str, c.numa_threads))
                + " threads; each MoE layer's experts split by bytes " + " / ".join(f"{s:.0%}" for s in c.numa_split)
                + f", {where}, run by their node's threads")

    def _describe_prefill(self) -> str:
        p = self.prefill
        gpus = "one GPU"
        if p.gpus > 1:
            gpus += (f" ({p.gpus} when nothing decodes, {p.ep}, with the prefill peer process; while requests "
                     "decode, the peer alone)")
        beside = "alone in its step (decode held)"
        if p.beside_decode:
            cap = f"{p.stream_cap_gbps:g} GB/s" if p.stream_cap_gbps else "uncapped"
            if p.stream_queue_mb:
                cap += f", at most {p.stream_queue_mb:g} MB of copies queued"
            if p.stream_duty < 1:
                cap += f", at work {p.stream_duty:.0%} of the time"
            cores = (f", decode's experts on {self.decode_threads(True)} threads meanwhile" if p.beside_cores else "")
            if p.beside_cores and p.stream_duty < 1 and p.cores_back_in_rests:
                cores += f" ({self.cpu.threads} in the prefill's rests)"
            if self.prefill_sms:
                cores += f", its kernels on {self.prefill_sms} SMs (a green context)"
            beside = f"beside decode ({cap} while requests decode{cores})"
        ring = str(p.ring_len) if p.ring_len else "auto (per prompt)"
        return (f"  stream-loading prefill above {p.slp_cutoff_tokens} tokens: ring {ring}, experts in groups of "
                f"{p.slp_group_experts}, chunks {p.slp_chunk_tokens or 'whole prompt'}, on {gpus}, {beside}")


def cpu_ranges(cpus) -> str:
    """CPU numbers in sysfs's list form: 0-3,8."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def placed_changes(old: Plan, new: Plan) -> list[str]:
    """The dotted names of the placed fields whose values differ between two plans."""
    return [name for name, f in _fields(Plan) if f.metadata.get("placed") and _get(old, name) != _get(new, name)]


def rebuildable() -> frozenset:
    """The plan's (and so the policy's) names that a replan changes around the placed model."""
    return frozenset(name for name, f in _fields(Plan) if not f.metadata.get("placed"))


def _fields(cls, prefix: str = "") -> list:
    out = []
    for f in fields(cls):
        if isinstance(f.type, str) and f.type in _SUBPLANS:
            out += _fields(_SUBPLANS[f.type], f"{prefix}{f.name}.")
        elif f.name not in ("ledger", "notes"):
            out.append((prefix + f.name, f))
    return out


def _get(obj, name: str):
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def flat(obj, prefix: str = "") -> dict:
    """A nested dataclass as dotted name -> value."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if is_dataclass(v):
            out.update(flat(v, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = v
    return out


_SUBPLANS = {"CpuPlan": CpuPlan, "KvPlan": KvPlan, "PrefillPlan": PrefillPlan, "DecodePlan": DecodePlan,
             "GpuPlan": GpuPlan}
