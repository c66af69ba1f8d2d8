"""hybrid.kernels.head_gemm (MLA's absorbed decode products) against float64, for every code this CPU can run.

Variants: the GEMM's (dispatch.available(): each runs the head kernel's code for its ISA) plus "avx512", the
AVX-512F/BW/VL code on its own, which also runs where the GEMM's avx512_bf16 variant cannot (AVX-512 without BF16).

Error bound, per output: the kernels sum exact products (BF16 x BF16) in FP32, then round once to BF16, so
|y - ref| <= 2^-9 |ref| (the rounding; 2^-8 here) + 2 I 2^-24 Σ_i |x_i w_i| (FP32 summation of I terms; 2^-22 here).
Outputs are poisoned with NaN before each call, so an element the kernel fails to write fails the test.
"""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.fp8_linear import DEFAULT_GEMM, CpuFp8Gemm
from hybrid.kernels.head_gemm import head_code, head_gemm
from hybrid.kernels.thread_pool import set_threads, threads
from tests.kernels.common import bf16, record, rel_errors, rng_for, seed_note


def _variants() -> list[str]:
    out = dispatch.available()  # since the GEMM has a variant avx512 (needs VBMI too), it may list "avx512" already
    try:
        head_code("avx512")
        if "avx512" not in out:
            out.append("avx512")
    except ValueError:
        pass
    return out


VARIANTS = _variants()
# (H, I, O): heads not a multiple of the thread count, dims not multiples of 8, 16 or 32, then MLA's own
SHAPES = [(1, 1, 1), (3, 7, 5), (5, 17, 33), (7, 33, 17), (3, 130, 70), (5, 65, 129), (9, 31, 200)]


def _weights(rng, H, I, O, by_rows):
    return bf16(rng, (H, I, O) if by_rows else (H, O, I))


def _reference(x_MHI, w, by_rows):
    """(float64 products, float64 Σ|x w| per output)."""
    eq = "mhi,hio->mho" if by_rows else "mhi,hoi->mho"
    x64, w64 = x_MHI.to(torch.float64), w.to(torch.float64)
    return torch.einsum(eq, x64, w64), torch.einsum(eq, x64.abs(), w64.abs())


def run_and_check(x_MHI, w, by_rows, variant, what=""):
    M, H, _ = x_MHI.shape
    I = w.shape[1] if by_rows else w.shape[2]
    O = w.shape[2] if by_rows else w.shape[1]
    out = torch.full((M, H, O), float("nan"), dtype=torch.bfloat16)
    assert head_gemm(x_MHI, w, by_rows, out=out, kernel=variant) is out
    ref, mag = _reference(x_MHI, w, by_rows)
    msg = f"{variant} {'rows' if by_rows else 'cols'} {what} M={M} H={H} I={I} O={O}; {seed_note()}"
    bad = (~torch.isfinite(out)).nonzero()
    assert bad.numel() == 0, f"{msg}: {bad.shape[0]} outputs not written or not finite, first at {bad[0].tolist()}"
    err = (out.to(torch.float64) - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + mag * (I * 2.0 ** -22)
    over = (err > bound).nonzero()
    assert over.numel() == 0, (f"{msg}: {over.shape[0]} outputs over the bound, first at {over[0].tolist()}: "
                               f"err {float(err[tuple(over[0])]):.3e} > {float(bound[tuple(over[0])]):.3e}")
    record("head", variant, "bf16", *rel_errors(out, ref))
    return out


@pytest.mark.parametrize("by_rows", [True, False], ids=["rows", "cols"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_rows(variant, by_rows):
    """Rows 1..8 over odd shapes: every row-group and column remainder of the vector codes."""
    for H, I, O in SHAPES:
        for M in range(1, 9):
            rng = rng_for("shapes", variant, by_rows, H, I, O, M)
            run_and_check(bf16(rng, (M, H, I)), _weights(rng, H, I, O, by_rows), by_rows, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mla_shapes_and_strided_views(variant):
    """DeepSeek-V3's heads and dims, x as the split views MLA passes (q_nope of the whole query; a last dim of
    stride 1, the others wider) and w as split halves of kv_b (the form before `keep_kv_b`)."""
    H, N, R, C, V = 128, 128, 64, 512, 128
    rng = rng_for("mla", variant)
    for M in (1, 3):
        q_MHK = bf16(rng, (M, H, N + R))
        kv_b_HXC = bf16(rng, (H, N + V, C), std=0.05)
        w_uk_HNC, w_uv_HVC = kv_b_HXC.split([N, V], dim=1)
        q_lat = run_and_check(q_MHK[..., :N], w_uk_HNC, True, variant, "q_nope")
        run_and_check(q_lat, w_uv_HVC, False, variant, "o")
        run_and_check(q_MHK[..., :N], w_uk_HNC.contiguous(), True, variant, "kept")


@pytest.mark.parametrize("variant", VARIANTS)
def test_thread_count_does_not_change_results(variant):
    """Heads split over 1, 2 or 3 threads (7 heads: uneven runs) give the same bits."""
    rng = rng_for("threads", variant)
    x, w_r, w_c = bf16(rng, (3, 7, 130)), bf16(rng, (7, 130, 70)), bf16(rng, (7, 70, 130))
    before, got = threads(), []
    try:
        for n in (1, 2, 3):
            set_threads(n)
            got.append((head_gemm(x, w_r, True, kernel=variant), head_gemm(x, w_c, False, kernel=variant)))
    finally:
        set_threads(before)
    for rows, cols in got[1:]:
        assert torch.equal(rows, got[0][0]) and torch.equal(cols, got[0][1]), f"{variant}: {seed_note()}"


def test_variants_agree_with_torch_within_one_rounding():
    """Every code and torch's einsum (FP32 accumulation, one rounding too) differ by at most one BF16 step."""
    rng = rng_for("torch")
    x, w = bf16(rng, (2, 1, 16, 200)), bf16(rng, (16, 200, 72))
    want = torch.einsum("bshn,hnc->bshc", x, w).float()
    for variant in VARIANTS:
        got = head_gemm(x[:, 0], w, True, kernel=variant)[:, None].float()
        assert ((got - want).abs() <= want.abs() * 2.0 ** -7 + 1e-6).all(), f"{variant}; {seed_note()}"


def test_inf_and_nan_propagate():
    rng = rng_for("nan")
    x, w = bf16(rng, (1, 2, 20)), bf16(rng, (2, 20, 24))
    x[0, 0, 3], x[0, 1, 5] = float("inf"), float("nan")
    for variant in VARIANTS:
        for by_rows, w_ in ((True, w), (False, w.transpose(1, 2).contiguous())):
            y = head_gemm(x, w_, by_rows, kernel=variant)
            assert torch.isnan(y[0, 1]).all(), variant
            ref = torch.einsum("mhi,hio->mho" if by_rows else "mhi,hoi->mho", x.double(), w_.double())[0, 0]
            assert torch.equal(torch.isinf(y[0, 0]), torch.isinf(ref)), variant


# ------------------------------------------------------------------------------------------------ bad calls

def _ok():
    return torch.zeros(2, 3, 8, dtype=torch.bfloat16), torch.zeros(3, 8, 5, dtype=torch.bfloat16)


@pytest.mark.parametrize("case, match", [
    ("x float32", "x: dtype float32, expected bfloat16"),
    ("w float8", "w: dtype float8_e4m3fn, expected bfloat16"),
    ("x 2-D", "x \\[M, H, I\\] and w"),
    ("heads differ", "does not fit x"),
    ("inner dims differ", "does not fit x"),
    ("w transposed", "w: last dimension must be contiguous"),
    ("x strided", "x: last dimension must be contiguous"),
    ("out wrong shape", "y: shape \\[2, 3, 4\\], expected \\[2, 3, 5\\]"),
    ("out not contiguous", "y: must be contiguous"),
    ("out float32", "y: dtype float32"),
    ("out overlaps x", "y overlaps an input"),
    ("unknown kernel", "unknown CPU kernel 'avx9'"),
])
def test_bad_calls_raise_clear_errors(case, match):
    x, w = _ok()
    out, kernel = None, "auto"
    if case == "x float32":
        x = x.float()
    elif case == "w float8":
        w = w.to(torch.float8_e4m3fn)
    elif case == "x 2-D":
        x = x[0]
    elif case == "heads differ":
        w = torch.zeros(4, 8, 5, dtype=torch.bfloat16)
    elif case == "inner dims differ":
        w = torch.zeros(3, 9, 5, dtype=torch.bfloat16)
    elif case == "w transposed":
        w = torch.zeros(3, 5, 8, dtype=torch.bfloat16).transpose(1, 2)
    elif case == "x strided":
        x = torch.zeros(2, 3, 16, dtype=torch.bfloat16)[..., ::2]
    elif case == "out wrong shape":
        out = torch.empty(2, 3, 4, dtype=torch.bfloat16)
    elif case == "out not contiguous":
        out = torch.empty(3, 2, 5, dtype=torch.bfloat16).transpose(0, 1)
    elif case == "out float32":
        out = torch.empty(2, 3, 5)
    elif case == "out overlaps x":
        x = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
        w, out = torch.zeros(3, 5, 5, dtype=torch.bfloat16), x
    elif case == "unknown kernel":
        kernel = "avx9"
    with pytest.raises(ValueError, match=match):
        head_gemm(x, w, True, out=out, kernel=kernel)


def test_a_code_this_cpu_cannot_run_is_refused_by_name():
    """As the GEMM's: the variant named, with the missing features (or why AMX is unavailable)."""
    missing = [v for v in ("amx", "avx512_bf16", "avx2") if v not in dispatch.available()]
    if "avx512" not in VARIANTS:
        missing.append("avx512")
    for v in missing:
        with pytest.raises(ValueError, match=f"CPU kernel '{v}' "):
            head_gemm(*_ok(), True, kernel=v)


# ------------------------------------------------------------------------------------------------ the gemm object

def test_cpu_gemm_runs_the_kernel_for_decode_rows_and_torch_otherwise(monkeypatch):
    """CpuFp8Gemm.per_head: BF16 on the CPU up to head_max_rows tokens on the kernel; more rows, float32,
    head_max_rows=0 (the path before) or the default gemm: torch's einsum, bit for bit."""
    import hybrid.kernels.fp8_linear as fl
    calls = []
    monkeypatch.setattr(fl, "head_gemm", lambda *a, **k: calls.append(a[0].shape) or head_gemm(*a, **k))
    rng = rng_for("per_head")
    w_uk, w_uv = bf16(rng, (4, 24, 40)), bf16(rng, (4, 16, 40))
    cpu, old = CpuFp8Gemm("auto", head_max_rows=4), CpuFp8Gemm("auto", head_max_rows=0)
    for B, native in ((1, True), (4, True), (5, False)):
        q, o = bf16(rng, (B, 1, 4, 24)), bf16(rng, (B, 1, 4, 40))
        calls.clear()
        got_uk, got_uv = cpu.per_head(q, w_uk, by_rows=True), cpu.per_head(o, w_uv, by_rows=False)
        assert calls == ([(B, 4, 24), (B, 4, 40)] if native else [])
        assert got_uk.shape == (B, 1, 4, 40) and got_uv.shape == (B, 1, 4, 16)
        for gemm in (old, DEFAULT_GEMM):
            assert torch.equal(gemm.per_head(q, w_uk, True), torch.einsum("bshn,hnc->bshc", q, w_uk))
            assert torch.equal(gemm.per_head(o, w_uv, False), torch.einsum("bshc,hvc->bshv", o, w_uv))
        want = torch.einsum("bshn,hnc->bshc", q.double(), w_uk.double())
        assert ((got_uk.double() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-3).all()
    calls.clear()
    q32 = torch.randn(1, 1, 4, 24)
    assert torch.equal(cpu.per_head(q32, w_uk.float(), True), torch.einsum("bshn,hnc->bshc", q32, w_uk.float()))
    assert calls == []
