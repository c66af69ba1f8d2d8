"""hybrid.kernels.gemm over packed INT4 weights (compressed-tensors' layout, bf16 scales per group of 32) against a
float64 reference, for every kernel variant this CPU has (forced by name; variants without an INT4 kernel of their
own run another's: csrc/gemm_int4.cpp).

Reference: the weights dequantised in float64 (int4.dequantize: q·s, exact for bf16 scales), times the same BF16
activations, in float64. Bounds as for the FP8 kernels (tests/kernels/test_gemm.py): p95 of |err|/Σ|x·w| <= 2e-3
and max|err| <= 1e-4 · max|ref|; the kernels' products are exact and their sums fp32, far inside both. Outputs are
poisoned with NaN before each call. A flipped nibble order or a wrong scale layout is an O(1) error: identity
activations read every weight back exactly, each (row, group) with a scale of its own.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.gemm import gemm
from hybrid.kernels.thread_pool import set_threads, threads
from hybrid.quant import int4
from tests.kernels.common import bf16, record, rel_errors, rng_for, seed_note
from tests.kernels.test_gemm import M_SAMPLE, MAX_BOUND, P95_BOUND, SHAPES

VARIANTS = dispatch.available()


def int4_weights(rng, N: int, K: int, rms: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed words (a row's padding nibbles random too: the kernels must ignore them), log-uniform bf16
    group scales putting the weights' RMS near `rms`, and the float64 dense weight."""
    q = torch.from_numpy(rng.integers(-8, 8, size=(N, K), dtype=np.int8))
    packed = int4.pack(q)
    if K % int4.PER_WORD:
        pad = torch.from_numpy(rng.integers(0, 16, size=N).astype(np.int32)) << 28
        packed[:, -1] |= pad  # the last nibble of the row's last word is padding
    s = 10.0 ** rng.uniform(-0.5, 0.5, size=int4.scale_shape((N, K))) * rms / 4.64
    scale = torch.from_numpy(s.astype(np.float32)).to(torch.bfloat16)
    return packed, scale, int4.dequantize(packed, scale, (N, K), torch.float64)


def run_and_check(x, w, s, w64, variant, what, out=None):
    M, N = x.shape[0], w.shape[0]
    out = torch.full((M, N), float("nan")) if out is None else out.fill_(float("nan"))
    assert gemm(x, w, s, out, kernel=variant) is out
    ref = x.double() @ w64.T
    msg = f"{variant} {what} M={M} N={N} K={x.shape[1]}; {seed_note()}"
    assert torch.isfinite(out).all(), f"{msg}: outputs not written or not finite"
    p95, mx = rel_errors(out, ref, x.double().abs() @ w64.abs().T)
    record("gemm", variant, "int4", p95, mx)
    assert p95 <= P95_BOUND and mx <= MAX_BOUND, f"{msg}: p95 |err|/Σ|x·w| = {p95:.3e}, max|err|/max|ref| = {mx:.3e}"
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_m(variant):
    """M = 1..64, each with fresh inputs; K = 257: a ragged last group and a last word of one value."""
    for M in range(1, 65):
        rng = rng_for("int4-every-m", variant, M)
        w, s, w64 = int4_weights(rng, 130, 257)
        run_and_check(bf16(rng, (M, 257)), w, s, w64, variant, "int4")


@pytest.mark.parametrize("N,K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes(variant, N, K):
    rng = rng_for("int4-shapes", variant, N, K)
    w, s, w64 = int4_weights(rng, N, K)
    for M in M_SAMPLE + [int(rng.integers(10, 64))]:
        run_and_check(bf16(rng, (M, K)), w, s, w64, variant, "int4")


@pytest.mark.parametrize("M,N,K", [(67, 130, 257), (200, 300, 257), (201, 65, 130), (514, 130, 200)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill(variant, M, N, K):
    rng = rng_for("int4-prefill", variant, M, N, K)
    w, s, w64 = int4_weights(rng, N, K)
    run_and_check(bf16(rng, (M, K)), w, s, w64, variant, "int4")


@functools.lru_cache(maxsize=None)
def _kimi(N: int, K: int):
    """An expert's real Kimi-K2 shapes (gate/up 2048 x 7168, down 7168 x 2048), shared by the variants."""
    return int4_weights(rng_for("kimi", N, K), N, K)


@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("N,K", [(2048, 7168), (7168, 2048)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_kimi_shapes(variant, N, K, M):
    w, s, w64 = _kimi(N, K)
    run_and_check(bf16(rng_for("kimi-x", variant, N, K, M), (M, K)), w, s, w64, variant, "int4")


@pytest.mark.parametrize("M", [1, 3, 70])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_weight_read_back_with_its_own_scale(variant, M):
    """Identity rows read single weights back: every nibble value at every position of a word and of a group, each
    (row, group) with a distinct power-of-two scale, must come back exactly q·s (one product, no sum). A flipped
    nibble order, a wrong word or a wrong scale (row and group swapped, the wrong group) all fail here."""
    rng = rng_for("int4-identity", variant, M)
    N, K = 19, 72  # ragged last group: 64..71
    q = torch.from_numpy(((np.arange(N)[:, None] * 5 + np.arange(K)[None, :] * 3) % 16 - 8).astype(np.int8))
    exps = np.arange(N * 3).reshape(N, 3) % 23 - 11
    s = torch.from_numpy((2.0 ** exps).astype(np.float32)).to(torch.bfloat16)
    rows = np.arange(K) if M == 70 else rng.choice(K, M, replace=False)
    x = torch.eye(K, dtype=torch.bfloat16)[torch.from_numpy(np.resize(rows, M))]
    y = gemm(x, int4.pack(q), s, torch.full((M, N), float("nan")), kernel=variant)
    want = int4.dequantize(int4.pack(q), s, (N, K), torch.float32)[:, torch.from_numpy(np.resize(rows, M))].T
    bad = (y != want).nonzero()
    assert bad.numel() == 0, (f"{variant}: weight (n={bad[0, 1]}, k={np.resize(rows, M)[bad[0, 0]]}) read "
                              f"{y[bad[0, 0], bad[0, 1]].item()!r}, expected {want[bad[0, 0], bad[0, 1]].item()!r}; "
                              f"{seed_note()}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_operands(variant):
    """x, w, scale and y as slices of wider tensors: correct, and y's parent untouched outside the slice."""
    for M, N, K in [(1, 130, 257), (5, 200, 300), (70, 64, 128)]:
        rng = rng_for("int4-strided", variant, M, N, K)
        x = bf16(rng, (M, K + 37))[:, 5:5 + K]
        w_full, s_full, _ = int4_weights(rng, N, K + 150)
        w = w_full[:, :int4.packed_shape((N, K))[1]]
        s = torch.cat([s_full, s_full], 1)[:, 1:1 + int4.scale_shape((N, K))[1]]
        w64 = int4.dequantize(w.contiguous(), s.contiguous(), (N, K), torch.float64)
        parent = torch.zeros(M, N + 11)
        run_and_check(x, w, s, w64, variant, "int4 strided", out=parent[:, 4:4 + N])
        outside = torch.cat([parent[:, :4], parent[:, 4 + N:]], 1)
        assert (outside == 0).all(), f"{variant}: wrote outside y; {seed_note()}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_thread_count_does_not_change_results(variant):
    rng = rng_for("int4-threads", variant)
    w, s, _ = int4_weights(rng, 1000, 300)
    x = bf16(rng, (9, 300))
    before = threads()
    try:
        outs = [(set_threads(n), gemm(x, w, s, kernel=variant))[1] for n in (1, 2)]
    finally:
        set_threads(before)
    assert torch.equal(*outs), f"{variant}: results differ between 1 and 2 threads; {seed_note()}"


@pytest.mark.parametrize("scale,words", [
    (torch.ones(8, 2, dtype=torch.float32), "scale: dtype float32"),
    (torch.ones(8, 3, dtype=torch.bfloat16), "scale: shape [8, 3], expected [8, 2]"),
    (None, "need their weight_scale"),
])
def test_bad_calls_name_the_argument(scale, words):
    w = torch.zeros(8, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        gemm(torch.zeros(2, 40, dtype=torch.bfloat16), w, scale)
    with pytest.raises(ValueError, match=r"w: shape \[8, 5\], expected \[8, 4\]"):
        gemm(torch.zeros(2, 32, dtype=torch.bfloat16), w, torch.ones(8, 1, dtype=torch.bfloat16))
