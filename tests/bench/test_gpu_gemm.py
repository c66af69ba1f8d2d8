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
    with pytest.raises(ValueError, match=r"bench.gemm_rows must be >= 1, got \[0\]"):
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
    assert ("gate_up", 512, "int4_triton_gemm 128x128x64/8/3") in names and ("down", 64, "int4_dequant_triton") in names
    assert all(r.value > 0 for r in recs)


def test_the_grouped_way_reports_per_expert_and_skips_where_torch_has_none(monkeypatch, capsys):
    from types import SimpleNamespace

    from hybrid.bench import gpu_gemm

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the timing helper's only GPU call
    stack = torch.randn(8, 64, 32).bfloat16()
    (rec,) = gpu_gemm._grouped(stack, 16, 64, 32, SimpleNamespace(repeats=1), 2 * 16 * 64 * 32, 100.0, "down")
    assert rec.name == "grouped_bf16_x8" and rec.value > 0 and rec.bound == 100.0 and rec.m == 16
    assert rec.extra["matrix"] == "down" and rec.extra["us_per_expert"] > 0

    def unsupported(*a, **k):
        raise RuntimeError("no grouped gemm")

    monkeypatch.setattr(torch, "_grouped_mm", unsupported)
    assert gpu_gemm._grouped(stack, 16, 64, 32, SimpleNamespace(repeats=1), 1.0, 1.0, "down") == []
    assert "not available here" in capsys.readouterr().err
