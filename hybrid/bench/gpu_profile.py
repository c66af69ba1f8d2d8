"""GPU time of a piece of work, from torch.profiler's kernel records (CUDA graphs' kernels included): how busy the
GPU was while it ran, and the heaviest rows."""
from __future__ import annotations

import time
from typing import Callable


def _device_us(row) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(row, name):
            return float(getattr(row, name))
    return 0.0


def gpu_times(fn: Callable[[], object], top: int = 15, trace=None) -> tuple[float, dict, str]:
    """fn() under the profiler: its wall seconds, GPU seconds in kernels and in host-to-device copies (summed over
    streams), and a table of the `top` rows by GPU time; the timeline saved as a Chrome trace at `trace` if given."""
    import torch
    from torch.profiler import DeviceType, ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    rows = [r for r in prof.key_averages() if r.device_type == DeviceType.CUDA]
    kernels = sum(_device_us(r) for r in rows if not r.key.startswith(("Memcpy", "Memset")))
    h2d = sum(_device_us(r) for r in rows if r.key.startswith("Memcpy HtoD"))
    heavy = sorted(rows, key=_device_us, reverse=True)[:top]
    table = "\n".join(f"{_device_us(r) / 1e3:10.2f} ms {r.count:7d}x  {r.key[:100]}" for r in heavy)
    return wall, {"kernels_s": kernels / 1e6, "h2d_s": h2d / 1e6}, table
