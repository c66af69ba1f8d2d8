"""The native kernels' thread pool, narrowed and widened in place (set_threads up to the most it has had): no thread
made or ended, the kernels' results the same bits at every width, parked workers taking no part in the jobs."""
from __future__ import annotations

import os

import torch

from hybrid.kernels import dispatch
from hybrid.kernels.gemm import gemm
from hybrid.kernels.thread_pool import set_threads, threads
from tests.kernels.common import bf16, block_scales, fp8_codes, rng_for, seed_note


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_narrowing_and_widening_keeps_the_threads_and_the_results():
    rng = rng_for("thread pool widths")
    w, s = fp8_codes(rng, (1000, 300)), block_scales(rng, (1000, 300))
    xs = [bf16(rng, (m, 300)) for m in (1, 4, 33)]
    variant = dispatch.available()[0]
    before = threads()
    try:
        set_threads(1)
        want = [gemm(x, w, s, kernel=variant) for x in xs]
        set_threads(4)  # grown past what it had: made anew, four threads (on however many CPUs)
        made = None
        for round_ in range(2):  # the threads counted after the first round (torch makes its own on first use)
            for width in (2, 4, 1, 3, 4, 2, 1, 4):
                set_threads(width)
                assert threads() == width
                for x, ref in zip(xs, want):
                    got = gemm(x, w, s, kernel=variant)
                    assert torch.equal(got, ref), f"width {width}, {x.shape[0]} tokens: other bits; {seed_note()}"
            set_threads(3)
            made = made or _os_threads()
        assert _os_threads() == made, "narrowing and widening in place makes or ends no thread"
        set_threads(5)  # past the most it had: one more thread
        assert threads() == 5 and _os_threads() == made + 1
        for x, ref in zip(xs, want):
            assert torch.equal(gemm(x, w, s, kernel=variant), ref), seed_note()
    finally:
        set_threads(before)
    assert threads() == before
