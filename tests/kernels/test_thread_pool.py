"""The native kernels' thread pool, narrowed and widened in place (set_threads up to the most it has had): no thread
made or ended, the kernels' results the same bits at every width, parked workers taking no part in the jobs. Run in
a fresh process, whose pool has had no size but the default (every allowed CPU) before."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.kernels.common import SEED, seed_note

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    from hybrid.kernels import dispatch
    from hybrid.kernels.gemm import gemm
    from hybrid.kernels.thread_pool import set_threads, threads
    from tests.kernels.common import bf16, block_scales, fp8_codes, rng_for

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    rng = rng_for("thread pool widths")
    w, s = fp8_codes(rng, (1000, 300)), block_scales(rng, (1000, 300))
    xs = [bf16(rng, (m, 300)) for m in (1, 4, 33)]
    variant = dispatch.available()[0]
    set_threads(1)
    want = [gemm(x, w, s, kernel=variant) for x in xs]
    big = len(os.sched_getaffinity(0)) + 2
    set_threads(big)  # past the default: made anew
    made = None
    for round_ in range(2):  # threads counted after the first round (torch makes its own on first use)
        for width in (2, big, 1, 3, big, 2, 1, big - 1):
            set_threads(width)
            assert threads() == width, (threads(), width)
            for x, ref in zip(xs, want):
                assert torch.equal(gemm(x, w, s, kernel=variant), ref), f"width {width}, {x.shape[0]} tokens"
        set_threads(3)
        made = made or os_threads()
    assert os_threads() == made, f"narrowing and widening made or ended threads: {os_threads()} vs {made}"
    set_threads(big + 1)  # past the most it had: made anew, one thread more
    assert threads() == big + 1 and os_threads() == made + 1, (threads(), os_threads(), made)
    for x, ref in zip(xs, want):
        assert torch.equal(gemm(x, w, s, kernel=variant), ref)
    print("ok")
""")


def test_narrowing_and_widening_keeps_the_threads_and_the_results():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HYBRID_TEST_SEED": str(SEED)})  # a hang (a parked worker in a job) fails
    assert p.returncode == 0 and p.stdout.strip() == "ok", f"{p.stderr[-3000:]}; {seed_note()}"
