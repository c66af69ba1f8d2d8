"""`mode=bench bench=kernels`: the native FP8 expert kernels against the measured memory read roof, with torch's
CPU paths beside them (the paper's Table 1 on this machine): torch holding the weights already upcast to BF16 and to
FP32 (its best case: `torch_bf16`, `torch_fp32`), and torch holding the same FP8 weights, dequantised to BF16 on
every call (`torch_fp8_upcast`).

Each native kernel variant of `bench.cpu_kernels` is timed in turn (by default the configured one, and avx512_bf16
beside amx: on an AMX CPU, the AMX tiles against the AVX-512 kernel at every token count); the torch paths are
compared with the first. Every record carries its variant (`kernel`), TFLOP/s and GB/s.

Cold weights: every call reads a different matrix from a pool far larger than the last-level cache, so the
figures are DRAM figures.

Under policy.cpu.numa (docs/design/numa.md) each node's read roof from its own and the other nodes' memory
(`node_read_roof`, hybrid/bench/numa.py), and the MoE layer's experts split across the nodes and bound there as
placement does, the layer timed on the per-node pools and on one pool over the same memory (`pools`), each node's
bytes against its local roof. Legend: M tokens, N output rows, K input dim (DeepSeek-V3: gate/up 2048x7168, down
7168x2048; a layer has 256 experts, top-8).
"""
from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hybrid.bench import bounds, numa
from hybrid.bench.records import Record
from hybrid.bench.timing import best_per_call, calls_for
from hybrid.engine.build import plan_for
from hybrid.hw.detect import meminfo_bytes
from hybrid.kernels.dispatch import selected
from hybrid.kernels.gemm import gemm
from hybrid.kernels.membw import calibrate, read_roof
from hybrid.kernels.moe import CpuMoE
from hybrid.kernels.numa import bind_tensor
from hybrid.kernels.thread_pool import set_groups, set_threads, threads
from hybrid.placement.numa import expert_nodes
from hybrid.plan.plan import CpuPlan
from hybrid.quant.fp8 import dequantize, scale_shape
from hybrid.weights.synthetic import fp8_codes

GB = 1e9


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _memory_gb() -> float:
    return meminfo_bytes("MemAvailable") / GB


def _scales(rng, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(rng.uniform(1e-4, 1e-3, size=scale_shape((n, k), (128, 128))).astype(np.float32))


class Roof:
    """The memory read roof, measured beside every measurement: on a shared machine the bandwidth left to us
    drifts, so each record's bound is the higher of the readings just before and just after it."""

    def __init__(self, gigabytes: float):
        self.gigabytes, self.readings = gigabytes, []
        self.streams, self.calibration = calibrate(gigabytes)

    def measure(self) -> float:
        self.readings.append(read_roof(self.gigabytes, 5, self.streams))
        return self.readings[-1]

    def bracket(self, measure: Callable[[], Record]) -> Record:
        before = self.readings[-1] if self.readings else self.measure()
        record = measure()
        record.bound = max(before, self.measure())
        return record

    @property
    def gbs(self) -> float:
        return max(self.readings)


def _gemv_records(cfg, roof: Roof, kernels: list[str], pool_gb: float, rng) -> list[Record]:
    out = []
    for label, n, k in (("gate_up", cfg.inter, cfg.hidden), ("down", cfg.hidden, cfg.inter)):
        count = max(4, math.ceil(pool_gb * GB / (n * k)))
        _log(f"  fp8 {label} {n}x{k}: pool of {count} matrices ({count * n * k / GB:.1f} GB)")
        pool = [(fp8_codes(rng, (n, k)), _scales(rng, n, k)) for _ in range(count)]
        for m in cfg.ms:
            x = torch.randn(m, k).to(torch.bfloat16)
            y = torch.empty(m, n)
            for kernel in kernels:
                calls = [lambda w=w, s=s, kernel=kernel: gemm(x, w, s, y, kernel) for w, s in pool]
                out.append(roof.bracket(lambda: _timed(f"fp8_gemm.{label}", calls, cfg.repeats, m, n, k, 1, "fp8",
                                                      {"kernel": kernel})))
        ours = [r for r in out if r.extra.get("kernel") == kernels[0]]
        if cfg.torch_peers:
            out += _torch_upcast_records(cfg, roof, label, n, k, pool, ours)
        del pool
        if cfg.torch_peers:
            out += _torch_records(cfg, roof, label, n, k, pool_gb, ours)
    return out


def _torch_upcast_records(cfg, roof: Roof, label: str, n: int, k: int, pool, ours: list[Record]) -> list[Record]:
    """Torch holding the same FP8 weights: dequantise to BF16 on every call, then matmul (the plain torch path)."""
    out = []
    for m in cfg.ms:
        x = torch.randn(m, k).to(torch.bfloat16)
        calls = [lambda w=w, s=s: torch.matmul(x, dequantize(w, s, (128, 128), torch.bfloat16).t()) for w, s in pool]
        theirs = roof.bracket(lambda: _timed(f"torch_fp8_upcast.{label}", calls, cfg.repeats, m, n, k, 1, "fp8"))
        mine = next(r for r in ours if r.name == f"fp8_gemm.{label}" and r.m == m)
        out += [theirs, Record(f"speedup_vs_torch_fp8_upcast.{label}",
                               theirs.extra["time_us"] / mine.extra["time_us"], "x", None, m, n, k, "fp8")]
    return out


def _timed(name: str, calls: list, repeats: int, m: int, n: int, k: int, itemsize: int, dtype: str,
           extra: dict | None = None) -> Record:
    """Weight bytes read per second over a pass of cold calls (as many as fit ~0.5 s)."""
    one = best_per_call(calls[:1], 1)
    t = best_per_call(calls[:calls_for(0.5, one, len(calls))], repeats)
    return Record(name, n * k * itemsize / t / GB, "GB/s", None, m, n, k, dtype,
                  {"time_us": t * 1e6, "tflops": bounds.gemm_flops(m, n, k) / t / 1e12, **(extra or {})})


def _torch_records(cfg, roof: Roof, label: str, n: int, k: int, pool_gb: float, ours: list[Record]) -> list[Record]:
    out = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        size = torch.empty((), dtype=dtype).element_size()
        count = max(4, math.ceil(pool_gb * GB / (n * k * size)))
        _log(f"  torch {name} {label}: pool of {count} matrices ({count * n * k * size / GB:.1f} GB)")
        pool = [torch.randn(n, k).to(dtype) for _ in range(count)]
        for m in cfg.ms:
            x = torch.randn(m, k).to(dtype)
            calls = [lambda w=w: torch.matmul(x, w.t()) for w in pool]
            theirs = roof.bracket(lambda: _timed(f"torch_{name}.{label}", calls, cfg.repeats, m, n, k, size, name))
            mine = next(r for r in ours if r.name == f"fp8_gemm.{label}" and r.m == m)
            out += [theirs, Record(f"speedup_vs_torch_{name}.{label}",
                                   theirs.extra["time_us"] / mine.extra["time_us"], "x", None, m, n, k, "fp8")]
        del pool
    return out


def _pools(cpu: Optional[CpuPlan]) -> dict:
    """The ways the MoE layer is timed: the pool as configured; under NUMA also one plain pool of as many threads
    (each way sets the pool; the configured one comes last, so the pool is left as it was)."""
    def per_node():
        set_groups(cpu.numa_nodes, cpu.numa_threads)
        set_threads(cpu.threads)

    def one_pool():
        set_groups([], [])
        set_threads(cpu.threads)
    return {"one_pool": one_pool, "per_node": per_node} if cpu and cpu.numa else {None: lambda: None}


def _moe_records(cfg, roof: Roof, kernels: list[str], rng, cpu: Optional[CpuPlan] = None,
                 roofs: Sequence[float] = ()) -> list[Record]:
    """The MoE layer per token count and kernel; under cpu.numa its experts on the nodes (bound where they are the
    machine's), timed on the per-node pools and on one pool, each node's bytes against its local roof (`roofs`)."""
    expert_bytes = 3 * cfg.hidden * cfg.inter
    fits = int(0.6 * _memory_gb() * GB / expert_bytes)
    experts = min(cfg.moe_experts or cfg.experts, fits)
    note = "" if experts == (cfg.moe_experts or cfg.experts) else f" (memory allows {experts} of {cfg.experts})"
    _log(f"  MoE layer: {experts} experts of {expert_bytes / 1e6:.0f} MB{note}, top-{cfg.top_k}")
    d, i = cfg.hidden, cfg.inter
    gate = [fp8_codes(rng, (i, d)) for _ in range(experts)]
    up = [fp8_codes(rng, (i, d)) for _ in range(experts)]
    down = [fp8_codes(rng, (d, i)) for _ in range(experts)]
    scales = [[_scales(rng, i, d) for _ in gate], [_scales(rng, i, d) for _ in up], [_scales(rng, d, i) for _ in down]]
    on = cpu is not None and cpu.numa
    nodes = expert_nodes(experts, cpu.numa_split) if on else None
    for e, node in enumerate(nodes if on and not cpu.numa_simulated else []):  # as placement binds them
        for t in (gate[e], up[e], down[e], *(s[e] for s in scales)):
            bind_tensor(t, node)
    op = CpuMoE(gate, up, down, *scales, nodes=nodes)
    out = []
    for t in cfg.moe_tokens:
        x = torch.randn(t, d).to(torch.bfloat16)
        w = torch.rand(t, cfg.top_k)
        routes = [torch.stack([torch.randperm(experts)[:cfg.top_k] for _ in range(t)]) for _ in range(32)]
        res = torch.empty(t, d)
        spent: dict = {}  # over the calls: seconds, and the threads' seconds waiting, idle at the end, per stage

        def call(ids, x=x, w=w, res=res, spent=spent):
            t0 = time.perf_counter()
            op(x, ids, w, res)
            sec = time.perf_counter() - t0
            for k, v in (("time", sec), ("calls", 1), ("waiting", op.wait_s), ("end_idle", op.tail_s),
                         *op.stage_s.items(), *((f"node{n}", b) for n, b in enumerate(op.node_bytes) if on)):
                spent[k] = spent.get(k, 0.0) + v
        calls = [functools.partial(call, ids) for ids in routes]
        read = sum(len(ids.unique()) for ids in routes) / len(routes) * expert_bytes
        flops = 3 * bounds.gemm_flops(t * cfg.top_k, i, d)  # gate, up, down: each [t*top_k, d] x [d, i] or back

        def measure(t=t, calls=calls, read=read, flops=flops, spent=spent, kernel="auto", pools=None) -> Record:
            op.kernel = kernel
            sec = best_per_call(calls, cfg.repeats)
            # the threads' time waiting for another's task, idle at the layer's end and in each stage of the tasks
            # (prep, gate_up, silu, down, sums: CpuMoE.stage_s), as shares of threads x time
            made = spent.pop("calls")
            by_node = [spent.pop(k) / made for k in sorted((k for k in spent if k.startswith("node")),
                                                           key=lambda k: int(k[4:]))]
            total = threads() * spent.pop("time")
            shares = {k: round(v / total, 4) for k, v in spent.items()}
            spent.clear()
            per_node = numa.node_extra(by_node, roofs, sec) if pools == "per_node" else {}
            return Record("moe_layer", read / sec / GB, "GB/s", None, t, None, None, "fp8",
                          {"time_ms": sec * 1e3, "tflops": flops / sec / 1e12, "experts": experts,
                           "top_k": cfg.top_k, "expert_mb_read": read / 1e6, "global_syncs": op.global_syncs,
                           **shares, "kernel": kernel, **({"pools": pools} if pools else {}), **per_node})
        for kernel in kernels:
            for pools, use in _pools(cpu).items():
                use()
                out.append(roof.bracket(functools.partial(measure, kernel=kernel, pools=pools)))
    return out


def kernels_timed(cpu_kernels: list[str], configured: str) -> list[str]:
    """bench.cpu_kernels (each must run here), else the plan's variant, with avx512_bf16 beside amx."""
    if cpu_kernels:
        return [selected(k) for k in cpu_kernels]
    first = selected(configured)
    return [first, "avx512_bf16"] if first == "amx" else [first]


def run(settings) -> list[Record]:
    cfg = settings.bench
    cpu = plan_for(settings, settings.hw).cpu
    kernels = kernels_timed(cfg.cpu_kernels, cpu.kernel)
    rng = np.random.default_rng(settings.seed)
    pool_gb = cfg.pool_gb or min(4.0, max(1.0, _memory_gb() / 12))
    roof = Roof(pool_gb)
    _log(f"kernels {', '.join(kernels)}; measuring the read roof over {pool_gb:.1f} GB ...")
    nodes = numa.node_roofs(cpu, pool_gb, roof.streams)
    records = nodes + _gemv_records(cfg, roof, kernels, pool_gb, rng)
    if cfg.moe_tokens:
        records += _moe_records(cfg, roof, kernels, rng, cpu, numa.local_roofs(nodes))
    roof_rec = Record("read_roof", roof.gbs, "GB/s", extra={
        "min": min(roof.readings), "readings": len(roof.readings), "buffer_gb": pool_gb, "streams": roof.streams,
        "by_streams": {s: round(v, 1) for s, v in roof.calibration.items()}})
    return [roof_rec] + records


def plot(records: list[Record], png: Path) -> Optional[Path]:
    """The run at a glance, log-log against tokens: the GEMMs' TFLOP/s per kernel and shape (torch's paths beside
    them) under the FP8 memory roof (2 FLOP per weight byte and token at the run's best read: a kernel on the line is
    memory-bound, one below it at large M compute-bound); and the MoE layer's time per kernel over the time its
    experts' bytes take at each record's roof (the bound). None when the run has neither."""
    gemms = [r for r in records if r.unit == "GB/s" and r.m and "tflops" in r.extra
             and (r.name.startswith("fp8_gemm.") or r.name.startswith("torch_"))]
    layers = [r for r in records if r.name == "moe_layer" and r.m]
    if not gemms and not layers:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [(p, recs) for p, recs in (("gemm", gemms), ("moe", layers)) if recs]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 6), squeeze=False)
    for ax, (panel, recs) in zip(axes[0], panels):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if panel == "gemm":
            _gemm_panel(ax, recs, next((r.value for r in records if r.name == "read_roof"), None))
        else:
            _moe_panel(ax, recs)
        ax.set_xticks(sorted({r.m for r in recs}))  # the token counts measured, as numbers
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%d"))
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _series(recs: list[Record], key: Callable[[Record], str], y: Callable[[Record], float]) -> dict:
    out: dict[str, list] = {}
    for r in sorted(recs, key=lambda r: r.m):
        out.setdefault(key(r), []).append((r.m, y(r)))
    return out


def _gemm_panel(ax, recs: list[Record], roof_gbs: Optional[float]) -> None:
    def label(r: Record) -> str:  # ours by shape and kernel, torch's paths by name
        return f"{r.name.removeprefix('fp8_gemm.')}, {r.extra['kernel']}" if "kernel" in r.extra else r.name

    for name, points in _series(recs, label, lambda r: r.extra["tflops"]).items():
        ours = not name.startswith("torch_")
        ax.plot(*zip(*points), marker="o" if ours else "x", linestyle="-" if ours else ":", label=name)
    if roof_gbs:
        ms = sorted({r.m for r in recs})
        ax.plot(ms, [2 * m * roof_gbs / 1e3 for m in ms], linestyle="--", color="grey",
                label=f"FP8 memory roof ({roof_gbs:.0f} GB/s, best reading)")
        tflops = [r.extra["tflops"] for r in recs]
        ax.set_ylim(min(tflops) / 2, 3 * max(tflops))  # the roof climbs far past compute-bound kernels
    ax.set(xlabel="tokens M", ylabel="TFLOP/s", title="FP8 GEMMs (cold weights)")


def _moe_panel(ax, recs: list[Record]) -> None:
    for kernel, points in _series(recs, lambda r: r.extra.get("kernel", "auto"), lambda r: r.extra["time_ms"]).items():
        ax.plot(*zip(*points), marker="o", label=f"MoE layer, {kernel}")
    bound = [r for r in recs if r.bound and "expert_mb_read" in r.extra]
    if bound:
        fastest: dict[int, float] = {}  # per T, the highest roof reading beside any kernel's record
        for r in bound:
            fastest[r.m] = min(fastest.get(r.m, math.inf), r.extra["expert_mb_read"] / r.bound)
        points = sorted(fastest.items())
        ax.plot(*zip(*points), linestyle="--", color="grey", label="experts' bytes at the roof (bound)")
    r = recs[0].extra
    ax.set(xlabel="tokens T", ylabel="ms per layer",
           title=f"MoE layer ({r.get('experts', '?')} experts, top-{r.get('top_k', '?')})")
