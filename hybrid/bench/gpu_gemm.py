"""`mode=bench bench=gpu_gemm`: the GPU ways through one routed expert's FP8 and INT4 weights at prefill row counts.

For gate+up fused ([2I, D]) and down ([D, I]) at DeepSeek-V3 shapes (Kimi-K2's too) and each of `bench.gemm_rows`:
the Triton FP8 GEMM (each tile of `bench.fp8_tiles`, else the configured one), dequantise-then-cuBLAS (the Triton
dequantise kernel, and torch ops), the same two ways through INT4 weights (compressed-tensors' packing, group 32:
the W4A16 Triton GEMM, hybrid/kernels/int4_linear.py, and its dequantise pass then cuBLAS), and 8 experts' BF16
weights in one grouped GEMM (per expert), in TFLOP/s against the bound: cuBLAS BF16 on weights dequantised
beforehand, same shapes, same run.
Several distinct experts are cycled so that the L2 cache does not hold the weights. Each timing includes the host's
launch cost, as the stream-loading prefill pays it per expert.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from hybrid.bench import bounds
from hybrid.bench.records import Record
from hybrid.bench.timing import cuda_seconds
from hybrid.errors import ConfigError
from hybrid.kernels import fp8_linear, int4_linear
from hybrid.prefill.slp import grouped_gemm_missing
from hybrid.quant import fp8, int4

EXPERTS = 8  # distinct weights cycled (one expert's FP8 gate+up is 29 MB; the H200's L2 is 50 MB)


def _seconds(fn, reps: int) -> float:
    return cuda_seconds(fn, reps, warmup=3)


def run(settings) -> list[Record]:
    cfg = settings.bench
    if not torch.cuda.is_available() or fp8_linear.triton is None:
        raise ConfigError("bench=gpu_gemm times GPU kernels: it needs CUDA and Triton")
    default = fp8_linear.DEFAULT_GEMM
    tiles = [fp8_linear.Tile.parse(t) for t in cfg.fp8_tiles] or [default.large_tile]
    dev, block = torch.device("cuda"), (128, 128)
    records = []
    for name, (n, k) in (("gate_up", (2 * cfg.inter, cfg.hidden)), ("down", (cfg.hidden, cfg.inter))):
        g = torch.Generator().manual_seed(n)
        weights = [tuple(t.to(dev) for t in fp8.quantize(torch.randn(n, k, generator=g) * 0.02, block))
                   for _ in range(EXPERTS)]
        stack = torch.stack([fp8.dequantize(q, s, block, torch.bfloat16) for q, s in weights])  # [G, N, K]
        dense = stack.unbind(0)
        packed = [(torch.randint(-2 ** 31, 2 ** 31 - 1, int4.packed_shape((n, k)), generator=g, dtype=torch.int32)
                   .to(dev), torch.full(int4.scale_shape((n, k)), 0.01, dtype=torch.bfloat16, device=dev))
                  for _ in range(EXPERTS)]
        for m in cfg.gemm_rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            flop = bounds.gemm_flops(m, n, k)
            bound = flop / _seconds(lambda i: F.linear(x, dense[i % EXPERTS]), cfg.repeats * 6) / 1e12
            ways = {"dequant_triton": lambda i: F.linear(x, fp8_linear.dequantize(*weights[i % EXPERTS], block)),
                    "dequant_torch": lambda i: F.linear(x, fp8.dequantize(*weights[i % EXPERTS], block))}
            first = len(records)
            # the swept tile serves prefill-sized rows only
            for tile in tiles if default.uses_large_tile(m) else tiles[:1]:
                gemm = default.with_("triton", tile)
                records.append(_record(f"triton_gemm {gemm.tile_for(m)}",
                                       lambda i: gemm.linear(x, *weights[i % EXPERTS], block),
                                       cfg, flop, bound, m, n, k, name))
                records.append(_record(f"int4_triton_gemm {gemm.tile_for(m)}",
                                       lambda i: int4_linear.linear(x, *packed[i % EXPERTS], k, gemm=gemm),
                                       cfg, flop, bound, m, n, k, name, "int4_g32"))
            for way, fn in ways.items():
                records.append(_record(way, fn, cfg, flop, bound, m, n, k, name))
            records.append(_record("int4_dequant_triton",
                                   lambda i: F.linear(x, int4_linear.dequantize(*packed[i % EXPERTS], k)),
                                   cfg, flop, bound, m, n, k, name, "int4_g32"))
            records += _grouped(stack, m, n, k, cfg, flop, bound, name)
            records.append(Record("cublas_bf16", bound, "TFLOP/s", None, m, n, k, "bf16", {"matrix": name}))
            print(f"{name} m={m}: " + ", ".join(f"{r.name} {r.value:.0f}" for r in records[first:])
                  + " TFLOP/s", file=sys.stderr)
    return records


def _grouped(stack, m, n, k, cfg, flop, bound, matrix) -> list[Record]:
    """All the cycled experts' BF16 weights ([G, N, K]) in one grouped GEMM (torch._grouped_mm, as stream-loading
    prefill's expert groups run), m rows each; reported per expert. None where torch has no grouped GEMM here."""
    g = len(stack)
    x = torch.randn(g * m, k, device=stack.device, dtype=torch.bfloat16)
    ends = torch.arange(1, g + 1, device=stack.device, dtype=torch.int32) * m
    if grouped_gemm_missing(x.device, x.dtype):  # torch's loop elsewhere is not what stream-loading prefill runs
        return []
    try:
        t = _seconds(lambda i: torch._grouped_mm(x, stack.transpose(1, 2), offs=ends), cfg.repeats * 6) / g
    except (RuntimeError, NotImplementedError) as err:
        print(f"grouped GEMM: not available here ({err})", file=sys.stderr)
        return []
    return [Record(f"grouped_bf16_x{g}", flop / t / 1e12, "TFLOP/s", bound, m, n, k, "bf16",
                   {"matrix": matrix, "us_per_expert": round(t * 1e6, 1), "note": "weights already BF16"})]


def _record(way, fn, cfg, flop, bound, m, n, k, matrix, dtype: str = "fp8_e4m3") -> Record:
    t = _seconds(fn, cfg.repeats * 6)
    return Record(way, flop / t / 1e12, "TFLOP/s", bound, m, n, k, dtype, {"matrix": matrix, "us": round(t * 1e6, 1)})
