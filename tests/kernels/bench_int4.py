"""INT4 beside FP8 on the CPU kernels at Kimi-K2's expert shapes: the GEMV (M = 1) in GB/s of weights read against
the memory read roof measured in the same run, and one MoE layer at T = 1 (top-8 of `--experts` experts, random
routing); docs/perf/kernels.md.

    python -m tests.kernels.bench_int4 [--threads 0] [--experts 64] [--reps 30]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.gemm import gemm
from hybrid.kernels.membw import calibrate
from hybrid.kernels.moe import CpuMoE
from hybrid.kernels.thread_pool import set_threads
from hybrid.quant import fp8, int4
from hybrid.weights.synthetic import fp8_codes

D, I, TOPK = 7168, 2048, 8


def _weights(kind: str, rng, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "int4":
        words = rng.bit_generator.random_raw(-(-n * k // 16)).view(np.int32)[:n * k // 8]
        return torch.from_numpy(words).reshape(n, k // 8), torch.full(int4.scale_shape((n, k)), 0.01).bfloat16()
    return fp8_codes(rng, (n, k)), torch.full(fp8.scale_shape((n, k), (128, 128)), 0.01)


def _median(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def gemv(kind: str, variant: str, reps: int, mats: int = 24) -> float:
    """GB/s over `mats` distinct [2I, D] weights (gate and up stacked) taken in turn: far more than the caches."""
    rng = np.random.default_rng(0)
    ws = [_weights(kind, rng, 2 * I, D) for _ in range(mats)]
    x = torch.randn(1, D).bfloat16()
    out = torch.empty(1, 2 * I)
    turn = iter(range(10 ** 9))

    def call():
        w, s = ws[next(turn) % mats]
        gemm(x, w, s, out, kernel=variant)
    return ws[0][0].nbytes / _median(call, reps) / 1e9


def moe_layer(kind: str, variant: str, experts: int, reps: int) -> float:
    """Seconds per layer at T = 1."""
    rng = np.random.default_rng(1)
    mats = [[_weights(kind, rng, n, k) for _ in range(experts)] for n, k in ((I, D), (I, D), (D, I))]
    op = CpuMoE(*[[w for w, _ in m] for m in mats], *[[s for _, s in m] for m in mats], kernel=variant)
    x = torch.randn(1, D).bfloat16()
    weights = torch.full((1, TOPK), 1.0 / TOPK)
    return _median(lambda: op(x, torch.from_numpy(rng.choice(experts, TOPK, replace=False))[None], weights), reps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    set_threads(args.threads)
    streams, readings = calibrate()
    roof = readings[streams]
    print(f"read roof {roof:.1f} GB/s ({streams} streams per thread)")
    variant = dispatch.selected()
    times = {}
    for kind in ("fp8", "int4"):
        rate = gemv(kind, variant, args.reps)
        print(f"{variant} {kind} GEMV M=1 [{2 * I}x{D}]: {rate:.1f} GB/s = {rate / roof:.0%} of the roof")
        times[kind] = moe_layer(kind, variant, args.experts, args.reps)
        print(f"{variant} {kind} MoE layer T=1 (top-{TOPK} of {args.experts}): {times[kind] * 1e3:.2f} ms")
    print(f"MoE layer T=1: INT4 / FP8 = {times['int4'] / times['fp8']:.2f}")


if __name__ == "__main__":
    main()
