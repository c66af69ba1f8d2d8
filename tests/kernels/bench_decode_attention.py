"""The decode attention kernel's speed at DeepSeek-V3's dims (one sequence), per code and schedule, beside torch's
einsum / softmax / einsum on the same BF16 tensors (the CPU path before the kernel); docs/perf/cpu-attention.md.

    python -m tests.kernels.bench_decode_attention [--threads 2] [--contexts 512 4096 16384]
"""
from __future__ import annotations

import argparse

import torch

from hybrid.bench.timing import call_times
from hybrid.kernels import dispatch
from hybrid.kernels.decode_attention import attention_code, decode_attention, set_schedule
from hybrid.kernels.thread_pool import set_threads

H, C, R, SCALE = 128, 512, 64, 0.1


def _best(fn, reps: int) -> float:
    return min(call_times(fn, reps))


def _torch(q, qp, kv, pe):
    s = (torch.einsum("hc,tc->ht", q, kv) + torch.einsum("hr,tr->ht", qp, pe)).float() * SCALE
    return torch.einsum("ht,tc->hc", s.softmax(-1).to(torch.bfloat16), kv)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    set_threads(args.threads)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    codes = {attention_code(v): v for v in reversed(dispatch.available())}
    for T in args.contexts:
        g = torch.Generator().manual_seed(T)
        kv, pe = (torch.randn(1, T, n, generator=g).to(torch.bfloat16) for n in (C, R))
        q, qp = (torch.randn(1, H, n, generator=g).to(torch.bfloat16) for n in (C, R))
        table, one, length = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0]), torch.tensor([T])  # one block
        flop = 2 * H * T * (2 * C + R)
        for code, variant in codes.items():
            for schedule in ("auto", "split", "heads"):
                set_schedule(schedule)
                dt = _best(lambda: decode_attention(q, qp, kv, pe, table, one, length, SCALE, kernel=variant),
                           args.reps)
                print(f"context {T:6d} {code:12s} {schedule:6s} {dt * 1e3:8.2f} ms {flop / dt / 1e9:7.1f} GFLOP/s")
        set_schedule("auto")
        dt = _best(lambda: _torch(q[0], qp[0], kv[0], pe[0]), args.reps)
        print(f"context {T:6d} torch einsum        {dt * 1e3:8.2f} ms {flop / dt / 1e9:7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
