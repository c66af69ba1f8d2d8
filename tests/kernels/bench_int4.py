"""INT4 beside FP8 on the CPU kernels at Kimi-K2's expert shapes: the GEMV (M = 1) in GB/s of weights read against
the memory read roof, and one MoE layer at T = 1 (top-8 of `--experts` experts, random routing), each measured in
every one of `--rounds` rounds (roof, GEMVs, layers in turn: on a shared machine each round sees the same load),
then the best of the rounds; docs/perf/kernels.md.

    python -m tests.kernels.bench_int4 [--threads 0] [--experts 64] [--reps 30] [--rounds 3]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from hybrid.bench.timing import call_times
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
    return float(np.median(call_times(fn, reps)))


def gemv(kind: str, variant: str, mats: int = 24):
    """GB/s over `mats` distinct [2I, D] weights (gate and up stacked) taken in turn: far more than the caches."""
    rng = np.random.default_rng(0)
    ws = [_weights(kind, rng, 2 * I, D) for _ in range(mats)]
    x = torch.randn(1, D).bfloat16()
    out = torch.empty(1, 2 * I)
    turn = iter(range(10 ** 9))

    def call():
        w, s = ws[next(turn) % mats]
        gemm(x, w, s, out, kernel=variant)
    return lambda reps: ws[0][0].nbytes / _median(call, reps) / 1e9


def moe_layer(kind: str, variant: str, experts: int):
    """Seconds per layer at T = 1."""
    rng = np.random.default_rng(1)
    mats = [[_weights(kind, rng, n, k) for _ in range(experts)] for n, k in ((I, D), (I, D), (D, I))]
    op = CpuMoE(*[[w for w, _ in m] for m in mats], *[[s for _, s in m] for m in mats], kernel=variant)
    x = torch.randn(1, D).bfloat16()
    weights = torch.full((1, TOPK), 1.0 / TOPK)
    call = lambda: op(x, torch.from_numpy(rng.choice(experts, TOPK, replace=False))[None], weights)  # noqa: E731
    return lambda reps: _median(call, reps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    set_threads(args.threads)
    variant = dispatch.selected()
    gemvs = {kind: gemv(kind, variant) for kind in ("fp8", "int4")}
    layers = {kind: moe_layer(kind, variant, args.experts) for kind in ("fp8", "int4")}
    best = {"roof": 0.0, "fp8": 0.0, "int4": 0.0, "fp8 layer": 1e9, "int4 layer": 1e9}
    for r in range(args.rounds):
        streams, readings = calibrate()
        got = {"roof": readings[streams], **{k: f(args.reps) for k, f in gemvs.items()}}
        got.update({f"{k} layer": f(args.reps) for k, f in layers.items()})
        print(f"round {r}: roof {got['roof']:.1f} GB/s ({streams} streams per thread); {variant} GEMV M=1 "
              f"[{2 * I}x{D}] FP8 {got['fp8']:.1f} GB/s ({got['fp8'] / got['roof']:.0%}), INT4 {got['int4']:.1f} "
              f"({got['int4'] / got['roof']:.0%}); layer T=1 (top-{TOPK} of {args.experts}) FP8 "
              f"{got['fp8 layer'] * 1e3:.2f} ms, INT4 {got['int4 layer'] * 1e3:.2f} ms = "
              f"{got['int4 layer'] / got['fp8 layer']:.2f}x")
        best = {k: (max if k in ("roof", "fp8", "int4") else min)(v, got[k]) for k, v in best.items()}
    print(f"best of {args.rounds}: roof {best['roof']:.1f} GB/s; GEMV FP8 {best['fp8']:.1f} GB/s "
          f"({best['fp8'] / best['roof']:.0%}), INT4 {best['int4']:.1f} ({best['int4'] / best['roof']:.0%}); "
          f"layer FP8 {best['fp8 layer'] * 1e3:.2f} ms, INT4 {best['int4 layer'] * 1e3:.2f} ms = "
          f"{best['int4 layer'] / best['fp8 layer']:.2f}x")


if __name__ == "__main__":
    main()
