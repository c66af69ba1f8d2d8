"""bench=gpu_gemm: its settings, and a clear refusal where there is no GPU (its timings run on the GPU only)."""
from __future__ import annotations

import pytest
import torch

from hybrid.bench import run_bench
from hybrid.config.compose import compose, to_settings
from hybrid.errors import ConfigError
from hybrid.kernels import fp8_linear


def test_its_settings_compose_and_bad_rows_are_refused():
    s = to_settings(compose(["mode=bench", "bench=gpu_gemm", "bench.gemm_rows=[64,4096]"]))
    assert s.bench.name == "gpu_gemm" and list(s.bench.gemm_rows) == [64, 4096] and s.bench.hidden == 7168
    with pytest.raises(Exception, match="token counts"):
        to_settings(compose(["mode=bench", "bench=gpu_gemm", "bench.gemm_rows=[0]"]))


@pytest.mark.skipif(torch.cuda.is_available() and fp8_linear.triton is not None, reason="has a GPU and Triton")
def test_without_a_gpu_it_says_what_it_needs():
    with pytest.raises(ConfigError, match="needs CUDA and Triton"):
        run_bench(to_settings(compose(["mode=bench", "bench=gpu_gemm"])))


@pytest.mark.skipif(not torch.cuda.is_available() or fp8_linear.triton is None, reason="needs CUDA and Triton")
def test_on_a_gpu_every_way_is_timed_against_cublas():
    recs = run_bench(to_settings(compose(["mode=bench", "bench=gpu_gemm", "bench.gemm_rows=[64,512]",
                                          "bench.repeats=1", "bench.fp8_tiles=[128x128x64/8/3,128x128x128/8/3]"])))
    names = {(r.extra["matrix"], r.m, r.name) for r in recs}
    assert ("gate_up", 512, "triton_gemm 128x128x64/8/3") in names and ("down", 64, "dequant_triton") in names
    assert all(r.value > 0 for r in recs) and fp8_linear.backend() == "triton"
