"""hybrid.kernels.gemm against a float64 reference, for every kernel variant this CPU has (forced by name).

Reference: the same FP8 weights dequantised in float64 (fp8.dequantize; the kernels apply each 128x128 block's
scale after that block's dot product, which is the same value in exact arithmetic), or the same BF16 weights,
times the same BF16 activations, in float64.

Error bound: p95 over the output elements of |err|/Σ|x·w| <= 2e-3 (Σ|x·w|, the dot product's absolute sum, is |ref|
where nothing cancels; where the products cancel, |ref| can be far below the fp32 rounding any summation order
carries), and max|err| <= 1e-4 * max|ref|. The kernels accumulate in fp32 (products exact: BF16 x FP8-as-BF16), so
they sit orders of magnitude inside both: the observed levels (printed at the end of the run) are ~1e-6 (p95) and
~1e-7 (max). Outputs are poisoned with NaN before each call, so an element the kernel fails to write fails the test.
Inputs are fresh each run; the seed is in every assertion message (HYBRID_TEST_SEED=<seed> reproduces a run).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.cpu_features import cpu_features
from hybrid.kernels.gemm import OUTER_MIN_TOKENS, TILE_MIN_TOKENS, gemm, set_batch_invariant, set_tile_min_tokens
from hybrid.kernels.thread_pool import set_threads, threads
from tests.kernels.common import (FP8, SUBNORMAL_CODES, VALID_CODES, ZERO_CODES, bf16, block_scales, dense64,
                                  fp8_codes, record, rel_errors, rng_for, seed_note)

P95_BOUND = 2e-3
MAX_BOUND = 1e-4

VARIANTS = dispatch.available()
WTYPES = ["fp8", "bf16"]

# (N, K): none, some or all of them non-multiples of 128, 64 and 4; 576 x ... is DeepSeek's kv_a_proj row count.
SHAPES = [(1, 1), (1, 3), (3, 1), (5, 5), (3, 257), (63, 65), (65, 63), (127, 127), (128, 128), (130, 200),
          (200, 130), (257, 300), (300, 257), (384, 576), (576, 384), (1000, 130), (130, 1000), (576, 1000)]
M_SAMPLE = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64]


def weights(rng, N, K, wtype, codes=None):
    if wtype == "fp8":
        w = fp8_codes(rng, (N, K), codes)
        s = block_scales(rng, (N, K))
        return w, s
    return bf16(rng, (N, K)), None


def run_and_check(x, w, s, variant, what, w64=None, out=None):
    """Poisoned out, one call, the two bounds; returns the output."""
    M, N = x.shape[0], w.shape[0]
    if out is None:
        out = torch.full((M, N), float("nan"), dtype=torch.float32)
    else:
        out.fill_(float("nan"))
    got = gemm(x, w, s, out, kernel=variant)
    assert got is out
    w64 = dense64(w, s) if w64 is None else w64
    ref = x.to(torch.float64) @ w64.T
    terms = x.to(torch.float64).abs() @ w64.abs().T  # Σ|x·w| per output: the scale of its fp32 rounding
    msg = f"{variant} {what} M={M} N={N} K={x.shape[1]}; {seed_note()}"
    bad = (~torch.isfinite(out)).nonzero()
    assert bad.numel() == 0, f"{msg}: {bad.shape[0]} outputs not written or not finite, first at {bad[0].tolist()}"
    p95, mx = rel_errors(out, ref, terms)
    wtype = "fp8" if w.dtype == FP8 else "bf16"
    record("gemm", variant, wtype, p95, mx)
    assert p95 <= P95_BOUND, f"{msg}: p95 |err|/Σ|x·w| = {p95:.3e} > {P95_BOUND} (max|err|/max|ref| = {mx:.3e})"
    assert mx <= MAX_BOUND, f"{msg}: max|err| = {mx:.3e} * max|ref| > {MAX_BOUND} (p95 rel = {p95:.3e})"
    return out


# ------------------------------------------------------------------------------------------------ the sweep

@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_m(variant, wtype):
    """M = 1..64, each with fresh inputs: every decode / small-batch path and every M-tile remainder."""
    N, K = 130, 257
    for M in range(1, 65):
        rng = rng_for("every_m", variant, wtype, M)
        w, s = weights(rng, N, K, wtype)
        run_and_check(bf16(rng, (M, K)), w, s, variant, wtype)


@pytest.mark.parametrize("N,K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes(variant, wtype, N, K):
    rng = rng_for("shapes", variant, wtype, N, K)
    w, s = weights(rng, N, K, wtype)
    w64 = dense64(w, s)
    for M in M_SAMPLE + [int(rng.integers(10, 64))]:
        run_and_check(bf16(rng, (M, K)), w, s, variant, wtype, w64)


@pytest.mark.parametrize("M,N,K", [(67, 130, 257), (200, 300, 257), (201, 65, 130), (514, 130, 200)])
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill(variant, wtype, M, N, K):
    """Prefill-sized M (past the AVX-512 FP8 tile threshold), with every remainder of M mod 4."""
    rng = rng_for("prefill", variant, wtype, M, N, K)
    w, s = weights(rng, N, K, wtype)
    run_and_check(bf16(rng, (M, K)), w, s, variant, wtype)


@functools.lru_cache(maxsize=None)
def _deepseek(wtype):
    """One real DeepSeek-V3 shape (2048 x 7168, e.g. an expert's gate/up stacked at hidden 7168), shared by the
    variants; its float64 reference weight is built once."""
    rng = rng_for("deepseek", wtype)
    w, s = weights(rng, 2048, 7168, wtype)
    return w, s, dense64(w, s)


@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_deepseek_shape(variant, wtype, M):
    w, s, w64 = _deepseek(wtype)
    run_and_check(bf16(rng_for("deepseek-x", variant, wtype, M), (M, 7168)), w, s, variant, wtype, w64)


# ---------------------------------------------------------------------------------- FP8 decoding, exactly

@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_every_code_exact(variant):
    """Identity activations read single weights back: every valid code (subnormals 0x01..0x07 and 0x81..0x87,
    both zeros included) at every lane position of a 64-wide chunk must decode exactly (scale 1). M = K takes
    the prefill path, M = 1 and M = 5 one-hot rows the decode paths."""
    rng = rng_for("codes", variant)
    N, K = len(VALID_CODES), 130  # K: two full 64-chunks and a ragged tail
    codes = np.array(VALID_CODES, dtype=np.uint8)
    grid = codes[(np.arange(N)[:, None] + np.arange(K)[None, :] * 7) % N]  # each code visits many k positions
    w = torch.from_numpy(grid).view(FP8)
    s = torch.ones(2, 2)
    exact = w.to(torch.float32)  # torch's own E4M3 decoding
    eye = torch.eye(K, dtype=torch.bfloat16)
    for rows in (np.arange(K), rng.choice(K, 1), rng.choice(K, 5, replace=False)):
        x = eye[torch.from_numpy(rows)]
        y = gemm(x, w, s, torch.full((len(rows), N), float("nan")), kernel=variant)
        want = exact[:, torch.from_numpy(rows)].T
        diff = (y != want).nonzero()
        assert diff.numel() == 0, (
            f"{variant}: code 0x{grid[diff[0, 1], rows[diff[0, 0]]]:02x} at k={rows[diff[0, 0]]} decoded as "
            f"{y[diff[0, 0], diff[0, 1]].item()!r}, expected {want[diff[0, 0], diff[0, 1]].item()!r}; {seed_note()}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_subnormals_and_negative_zero(variant):
    """Weights made only of subnormal codes and ±0 (0x00, 0x80), random scales: through the normal bound."""
    for N, K, M in [(130, 257, 1), (130, 257, 3), (64, 200, 16), (257, 130, 9), (130, 257, 66)]:
        rng = rng_for("subnormal", variant, N, K, M)
        w, s = weights(rng, N, K, "fp8", SUBNORMAL_CODES + ZERO_CODES)
        assert (w.view(torch.uint8) == 0x80).any() and (w.view(torch.uint8) == 0x01).any()
        run_and_check(bf16(rng, (M, K)), w, s, variant, "fp8 subnormal/-0")


# ------------------------------------------------------------------------------------------------ layouts

@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_operands(variant, wtype):
    """x, w, scale and y as slices of wider tensors (row stride > row length, shifted start): correct, and the
    columns of y's parent outside the slice stay untouched."""
    for M, N, K in [(1, 130, 257), (5, 200, 300), (20, 64, 128), (70, 130, 257)]:  # 70: the converted tiles
        rng = rng_for("strided", variant, wtype, M, N, K)
        x = bf16(rng, (M, K + 37))[:, 5:5 + K]
        w_full, s_full = weights(rng, N, K + 150, wtype)
        w = w_full[:, 3:3 + K] if wtype == "bf16" else w_full[:, :K]  # FP8 blocks must stay aligned to 128
        s = None if s_full is None else torch.cat([s_full, s_full], 1)[:, :-(-K // 128)]
        assert x.stride(0) == K + 37 and w.stride(0) == K + 150 and (s is None or s.stride(0) > s.shape[1])
        parent = torch.zeros(M, N + 11)
        y = parent[:, 4:4 + N]
        run_and_check(x, w, s, variant, f"{wtype} strided", dense64(w.contiguous(), s), out=y)
        outside = torch.cat([parent[:, :4], parent[:, 4 + N:]], 1)
        assert torch.isnan(outside).sum() == 0 and (outside == 0).all(), f"{variant}: wrote outside y; {seed_note()}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_out_allocated(variant):
    rng = rng_for("alloc", variant)
    w, s = weights(rng, 65, 130, "fp8")
    x = bf16(rng, (3, 130))
    y = gemm(x, w, s, kernel=variant)
    assert y.shape == (3, 65) and y.dtype == torch.float32
    p95, mx = rel_errors(y, x.double() @ dense64(w, s).T)
    assert p95 <= P95_BOUND and mx <= MAX_BOUND, f"{variant}: p95 {p95:.2e}, max {mx:.2e}; {seed_note()}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_thread_count_does_not_change_results(variant):
    """The N split over threads changes nothing: one thread and two give the same bits."""
    same_on_1_and_2_threads(rng_for("threads", variant), variant, tokens=9)


def same_on_1_and_2_threads(rng, variant: str, tokens: int) -> None:
    w, s = weights(rng, 1000, 300, "fp8")
    x = bf16(rng, (tokens, 300))
    before = threads()
    try:
        set_threads(1)
        one = gemm(x, w, s, kernel=variant)
        set_threads(2)
        two = gemm(x, w, s, kernel=variant)
    finally:
        set_threads(before)
    assert torch.equal(one, two), f"{variant}: results differ between 1 and 2 threads; {seed_note()}"


# ------------------------------------------------------------------------------------------------ dispatch

def _problem():
    """M = 20: past variant amx's default amx_min_tokens, so amx runs its tiles, not the AVX-512 kernel."""
    rng = rng_for("dispatch")
    w, s = weights(rng, 300, 1000, "fp8")
    return bf16(rng, (20, 1000)), w, s


@pytest.fixture
def tiles():
    """Yields (set_tile_min_tokens, set_batch_invariant) for one test; the defaults are back after it."""
    yield set_tile_min_tokens, set_batch_invariant
    set_tile_min_tokens(TILE_MIN_TOKENS)
    set_batch_invariant(False)


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", ["avx512_bf16", "avx512"])
def test_avx512_batch_invariant(variant, wtype, tiles):
    """The AVX-512 kernels under batch invariance: every output the same FP32 operations whichever path computes it
    (streaming rows of 1, 2, 3, 4 or 8 tokens below tile_min_m tokens, in tiles of 1 to 16 accumulators, a
    converted tile from there on), so a token's row is bitwise the same alone and in any batch."""
    if variant not in VARIANTS:
        pytest.skip(f"this CPU lacks the {variant} variant")
    tiles[1](True)
    N, K = 300, 1000  # ragged 128-row blocks, 3-row steps, 16-row tiles and 128-column blocks
    rng = rng_for("avx512-batch", wtype)
    w, s = weights(rng, N, K, wtype)
    x = bf16(rng, (70, K))
    alone = torch.cat([gemm(x[t:t + 1], w, s, kernel=variant) for t in range(x.shape[0])])
    for M in [2, 3, 4, 5, 7, 8, 9, 13, 16, 63, 64, 65, 66, 70]:
        diff = (gemm(x[:M], w, s, kernel=variant) != alone[:M]).nonzero()
        assert diff.numel() == 0, (f"{variant} {wtype} M={M}: token {diff[0, 0].item()} row {diff[0, 1].item()} "
                                   f"differs from the token alone; {seed_note()}")


needs_avx512_bf16 = pytest.mark.skipif("avx512_bf16" not in VARIANTS, reason="this CPU lacks AVX-512 BF16: the "
                                       "outer-product form is variant avx512_bf16's")


@needs_avx512_bf16
@pytest.mark.parametrize("N,K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_outer_form_shapes(N, K, tiles):
    """avx512_bf16's outer-product form (its converted tiles unless batch-invariant), at every M of the sweep (tile
    threshold 1) and past one 8-token tile, against float64: 32-row passes with ragged groups of 16, one scale per
    group, 128-wide K blocks with a ragged last one."""
    tiles[0](1)
    rng = rng_for("outer-shapes", N, K)
    w, s = weights(rng, N, K, "fp8")
    w64 = dense64(w, s)
    for M in M_SAMPLE + [15, 70]:
        run_and_check(bf16(rng, (M, K)), w, s, "avx512_bf16", "fp8 outer", w64)


@needs_avx512_bf16
def test_outer_form_is_batch_invariant_within_itself(tiles):
    """On the outer form (threshold 1) a token's row is the same alone and in any batch: each output one chain per
    K block whatever tokens share its tile. Under the default threshold a token alone (the streaming form) and in a
    batch of 64 (the outer form) differ in the last bits: what batch invariance turns off."""
    rng = rng_for("outer-batch")
    w, s = weights(rng, 300, 1000, "fp8")
    x = bf16(rng, (70, 1000))
    tiles[0](1)
    alone = torch.cat([gemm(x[t:t + 1], w, s, kernel="avx512_bf16") for t in range(x.shape[0])])
    for M in [2, 3, 5, 8, 9, 13, 16, 64, 70]:
        diff = (gemm(x[:M], w, s, kernel="avx512_bf16") != alone[:M]).nonzero()
        assert diff.numel() == 0, f"M={M}: token {diff[0, 0].item()} row {diff[0, 1].item()} differs alone"
    tiles[0](OUTER_MIN_TOKENS)
    assert not torch.equal(gemm(x[:1], w, s, kernel="avx512_bf16"), gemm(x[:64], w, s, kernel="avx512_bf16")[:1])


def test_variants_differ_bitwise():
    """Different variants round differently (fp32 sums in different orders), so bitwise equality identifies the
    variant that ran; the tests below rely on that. (Variants avx512 and avx512_bf16 share their products where the
    CPU's vdpbf16ps rounds like two FP32 FMAs, but not the order of their sums: LaneSums and QuadSums.)"""
    x, w, s = _problem()
    outs = [gemm(x, w, s, kernel=v) for v in VARIANTS]
    for i in range(len(outs)):
        for j in range(i):
            assert not torch.equal(outs[i], outs[j]), f"{VARIANTS[i]} and {VARIANTS[j]} gave identical bits"


@pytest.mark.parametrize("variant", VARIANTS)
def test_force_by_argument_and_env(variant, monkeypatch):
    x, w, s = _problem()
    monkeypatch.delenv(dispatch.ENV, raising=False)
    by_arg = {v: gemm(x, w, s, kernel=v) for v in VARIANTS}
    assert dispatch.selected(variant) == variant
    monkeypatch.setenv(dispatch.ENV, variant)
    assert dispatch.selected() == variant and dispatch.selected("auto") == variant
    assert torch.equal(gemm(x, w, s), by_arg[variant]), f"{dispatch.ENV}={variant} did not run {variant}"
    for other in VARIANTS:  # an explicit request beats the environment
        assert dispatch.selected(other) == other
        assert torch.equal(gemm(x, w, s, kernel=other), by_arg[other]), f"kernel={other} lost to the env var"


def test_auto_is_best(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    f = cpu_features()
    avx512 = ["avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vbmi"]
    needs = {"amx": avx512 + ["amx_tile", "amx_bf16"], "avx512_bf16": avx512,
             "avx512": [n for n in avx512 if n != "avx512_bf16"], "avx2": ["avx2", "fma", "f16c"], "generic": []}
    expected = next(v for v in dispatch.VARIANTS if all(f.get(n, False) for n in needs[v]))
    assert VARIANTS[0] == expected and "generic" in VARIANTS
    assert dispatch.selected() == dispatch.selected("auto") == expected
    x, w, s = _problem()
    assert torch.equal(gemm(x, w, s), gemm(x, w, s, kernel=expected))


@pytest.mark.parametrize("where", ["argument", "env", "selected"])
def test_unknown_variant(where, monkeypatch):
    x, w, s = _problem()
    monkeypatch.delenv(dispatch.ENV, raising=False)
    with pytest.raises(ValueError) as e:
        if where == "argument":
            gemm(x, w, s, kernel="avx9000")
        elif where == "env":
            monkeypatch.setenv(dispatch.ENV, "avx9000")
            gemm(x, w, s)
        else:
            dispatch.selected("avx9000")
    msg = str(e.value)
    assert "avx9000" in msg and all(v in msg for v in ("auto",) + dispatch.VARIANTS), msg


def test_bad_env_ignored_when_variant_forced(monkeypatch):
    x, w, s = _problem()
    monkeypatch.delenv(dispatch.ENV, raising=False)
    want = gemm(x, w, s, kernel="generic")
    monkeypatch.setenv(dispatch.ENV, "avx9000")
    assert torch.equal(gemm(x, w, s, kernel="generic"), want)


@pytest.mark.parametrize("variant", [v for v in dispatch.VARIANTS if v not in VARIANTS] or ["(none)"])
def test_missing_variant_names_features(variant):
    if variant == "(none)":
        pytest.skip("this CPU has every kernel variant; the unknown-name error is tested above")
    with pytest.raises(ValueError, match="which this CPU lacks"):
        dispatch.selected(variant)
