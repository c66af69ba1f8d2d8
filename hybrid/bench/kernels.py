"""`mode=bench bench=kernels`: the native FP8 expert kernels against the measured memory read roof, with torch's
CPU paths beside them (weights upcast to BF16 and to FP32, then matmul: the paper's Table 1 on this machine).

Cold weights: every call reads a different matrix from a pool far larger than the last-level cache, so the
figures are DRAM figures. Legend: M tokens, N output rows, K input dim (DeepSeek-V3: gate/up 2048x7168, down
7168x2048; a layer has 256 experts, top-8).
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from hybrid.bench.records import Record
from hybrid.bench.timing import best_per_call, calls_for
from hybrid.kernels.dispatch import selected
from hybrid.kernels.gemm import gemm
from hybrid.kernels.membw import read_roof
from hybrid.kernels.moe import CpuMoE
from hybrid.weights.fp8 import scale_shape
from hybrid.weights.synthetic import _fp8_codes

GB = 1e9


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _memory_gb() -> float:
    with open("/proc/meminfo") as f:
        avail = next(line for line in f if line.startswith("MemAvailable"))
    return int(avail.split()[1]) * 1024 / GB


def _scales(rng, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(rng.uniform(1e-4, 1e-3, size=scale_shape((n, k), (128, 128))).astype(np.float32))


class Roof:
    """The memory read roof, measured more than once in the run; the highest reading is the bound."""

    def __init__(self, gigabytes: float):
        self.gigabytes, self.readings = gigabytes, []

    def measure(self) -> float:
        self.readings.append(read_roof(self.gigabytes, 5))
        return self.readings[-1]

    @property
    def gbs(self) -> float:
        return max(self.readings)


def _gemv_records(cfg, roof: Roof, kernel: str, pool_gb: float, rng) -> list[Record]:
    out = []
    for label, n, k in (("gate_up", cfg.inter, cfg.hidden), ("down", cfg.hidden, cfg.inter)):
        count = max(4, math.ceil(pool_gb * GB / (n * k)))
        _log(f"  fp8 {label} {n}x{k}: pool of {count} matrices ({count * n * k / GB:.1f} GB)")
        pool = [(_fp8_codes(rng, (n, k)), _scales(rng, n, k)) for _ in range(count)]
        for m in cfg.ms:
            x = torch.randn(m, k).to(torch.bfloat16)
            y = torch.empty(m, n)
            calls = [lambda w=w, s=s: gemm(x, w, s, y, kernel) for w, s in pool]
            one = best_per_call(calls[:1], 1)
            t = best_per_call(calls[:calls_for(0.5, one, len(calls))], cfg.repeats)
            out.append(Record(f"fp8_gemm.{label}", n * k / t / GB, "GB/s", roof.gbs, m, n, k, "fp8",
                              {"time_us": t * 1e6, "tflops": 2 * m * n * k / t / 1e12, "kernel": kernel}))
        del pool
        if cfg.torch_peers:
            out += _torch_records(cfg, roof, label, n, k, pool_gb, out)
    return out


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
            one = best_per_call(calls[:1], 1)
            t = best_per_call(calls[:calls_for(0.5, one, len(calls))], cfg.repeats)
            out.append(Record(f"torch_{name}.{label}", n * k * size / t / GB, "GB/s", roof.gbs, m, n, k, name,
                              {"time_us": t * 1e6, "tflops": 2 * m * n * k / t / 1e12}))
            mine = next(r for r in ours if r.name == f"fp8_gemm.{label}" and r.m == m)
            out.append(Record(f"speedup_vs_torch_{name}.{label}", t / (mine.extra["time_us"] / 1e6), "x", None,
                              m, n, k, "fp8"))
        del pool
    return out


def _moe_records(cfg, roof: Roof, kernel: str, rng) -> list[Record]:
    expert_bytes = 3 * cfg.hidden * cfg.inter
    fits = int(0.6 * _memory_gb() * GB / expert_bytes)
    experts = min(cfg.moe_experts or cfg.experts, fits)
    note = "" if experts == (cfg.moe_experts or cfg.experts) else f" (memory allows {experts} of {cfg.experts})"
    _log(f"  MoE layer: {experts} experts of {expert_bytes / 1e6:.0f} MB{note}, top-{cfg.top_k}")
    d, i = cfg.hidden, cfg.inter
    gate = [_fp8_codes(rng, (i, d)) for _ in range(experts)]
    up = [_fp8_codes(rng, (i, d)) for _ in range(experts)]
    down = [_fp8_codes(rng, (d, i)) for _ in range(experts)]
    op = CpuMoE(gate, up, down, [_scales(rng, i, d) for _ in gate], [_scales(rng, i, d) for _ in up],
                [_scales(rng, d, i) for _ in down], kernel=kernel)
    out = []
    for t in cfg.moe_tokens:
        x = torch.randn(t, d).to(torch.bfloat16)
        w = torch.rand(t, cfg.top_k)
        routes = [torch.stack([torch.randperm(experts)[:cfg.top_k] for _ in range(t)]) for _ in range(16)]
        res = torch.empty(t, d)
        calls = [lambda ids=ids: op(x, ids, w, res) for ids in routes]
        sec = best_per_call(calls, cfg.repeats)
        read = sum(len(ids.unique()) for ids in routes) / len(routes) * expert_bytes
        out.append(Record("moe_layer", read / sec / GB, "GB/s", roof.gbs, t, None, None, "fp8",
                          {"time_ms": sec * 1e3, "experts": experts, "top_k": cfg.top_k,
                           "expert_mb_read": read / 1e6, "global_syncs": op.global_syncs, "kernel": kernel}))
    return out


def run(settings) -> list[Record]:
    cfg, kernel = settings.bench, selected(settings.policy.cpu_kernel)
    rng = np.random.default_rng(settings.seed)
    pool_gb = cfg.pool_gb or min(4.0, max(1.0, _memory_gb() / 12))
    roof = Roof(pool_gb)
    _log(f"kernel {kernel}; measuring the read roof over {pool_gb:.1f} GB ...")
    roof.measure()
    records = _gemv_records(cfg, roof, kernel, pool_gb, rng)
    roof.measure()
    if cfg.moe_tokens:
        records += _moe_records(cfg, roof, kernel, rng)
        roof.measure()
    for r in records:  # every fraction against the highest roof reading of the run
        if r.bound:
            r.bound = roof.gbs
    roof_rec = Record("read_roof", roof.gbs, "GB/s", extra={"readings": [round(v, 2) for v in roof.readings],
                                                             "buffer_gb": pool_gb})
    return [roof_rec] + records
