"""The AMX variant (csrc/gemm_amx*.cpp, gemm_amx_tiling.h) against float64, with the bounds of test_gemm.py
(GEMM) and test_moe.py (MoE layer).

On every CPU: kernel `amx_emulated` runs the AMX path's own tiling loop, activation packing and post-scaling with
the tile operations emulated in plain C++ (tdpbf16ps as the instruction reference defines it), so the layouts,
the M / N / K remainders and the per-expert choice of path are checked wherever the tests run. The weights'
conversion there is a table; on AMX CPUs the real path converts with the AVX-512 kernel's (tested in test_gemm.py).
Where the CPU has AMX (Sapphire Rapids and later), the real tiles run the same cases, and against the AVX-512 path;
elsewhere those tests skip, saying so.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.config.schema import CpuPolicy, DecodePolicy, PolicyConfig
from hybrid.errors import ConfigError
from hybrid.kernels import dispatch
from hybrid.kernels.gemm import AMX_MIN_TOKENS, gemm, set_amx_min_tokens, set_amx_overlap, set_amx_prefetch
from hybrid.kernels.moe import CpuMoE
from hybrid.plan.resolve import amx_min_tokens, check as check_policy
from tests.kernels.common import FP8, VALID_CODES, bf16, dense64, rel_errors, rng_for
from tests.kernels.test_gemm import MAX_BOUND, P95_BOUND, run_and_check, same_on_1_and_2_threads, weights
from tests.kernels.test_moe import DIMS, check, experts, routing, routing_with_hot

HAS_AMX = "amx" in dispatch.available()
NO_AMX = "this CPU (or this build) has no AMX: the real tiles run on Sapphire Rapids or later; amx_emulated covers " \
         "their tiling here"
needs_amx = pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)
# The tiled variants: the emulation everywhere, the real tiles where present.
TILED = ["amx_emulated"] + (["amx"] if HAS_AMX else [])

M_SWEEP = [1, 15, 16, 17, 31, 32, 33, 64, 130]
# (N, K): multiples of 16 / 32 / 128 and not; N past one 32-row pass and one 128-row scale block, K past a 512 slab.
SHAPES = [(16, 128), (17, 64), (65, 63), (130, 257), (257, 300), (300, 1100), (576, 130)]


@pytest.fixture
def amx_from():
    """Sets the token count from which the tiles run; the default is back after the test."""
    yield set_amx_min_tokens
    set_amx_min_tokens(AMX_MIN_TOKENS)


# ------------------------------------------------------------------------------------------------ GEMM

@pytest.mark.parametrize("N,K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("variant", TILED)
def test_tiles_match_float64(variant, N, K, amx_from):
    amx_from(1)
    rng = rng_for("amx-shapes", variant, N, K)
    w, s = weights(rng, N, K, "fp8")
    w64 = dense64(w, s)
    for M in M_SWEEP:
        run_and_check(bf16(rng, (M, K)), w, s, variant, "fp8 tiles", w64)


@pytest.mark.parametrize("variant", TILED)
def test_every_m_on_tiles(variant, amx_from):
    """M = 1..48 with fresh inputs: every token-tile remainder, one and two token tiles per pass."""
    amx_from(1)
    for M in range(1, 49):
        rng = rng_for("amx-every-m", variant, M)
        w, s = weights(rng, 130, 200, "fp8")
        run_and_check(bf16(rng, (M, 200)), w, s, variant, "fp8 tiles")


@pytest.mark.parametrize("variant", TILED)
def test_fp8_every_code_exact_on_tiles(variant, amx_from):
    """Identity activations read single weights back: every valid code at every lane of a 64-chunk decodes exactly
    through the tiles' layouts (scale 1)."""
    amx_from(1)
    N, K = len(VALID_CODES), 130
    codes = np.array(VALID_CODES, dtype=np.uint8)
    grid = codes[(np.arange(N)[:, None] + np.arange(K)[None, :] * 7) % N]
    w = torch.from_numpy(grid).view(FP8)
    y = gemm(torch.eye(K, dtype=torch.bfloat16), w, torch.ones(2, 2), kernel=variant)
    want = w.to(torch.float32).T
    diff = (y != want).nonzero()
    assert diff.numel() == 0, (f"{variant}: code 0x{grid[diff[0, 1], diff[0, 0]]:02x} at k={diff[0, 0].item()} "
                               f"decoded as {y[diff[0, 0], diff[0, 1]].item()!r}")


@pytest.mark.parametrize("variant", TILED)
def test_strided_operands_on_tiles(variant, amx_from):
    amx_from(1)
    for M, N, K in [(5, 200, 300), (20, 64, 640)]:
        rng = rng_for("amx-strided", variant, M, N, K)
        x = bf16(rng, (M, K + 37))[:, 5:5 + K]
        w_full, s_full = weights(rng, N, K + 150, "fp8")
        w, s = w_full[:, :K], torch.cat([s_full, s_full], 1)[:, :-(-K // 128)]
        parent = torch.zeros(M, N + 11)
        run_and_check(x, w, s, variant, "fp8 strided tiles", dense64(w.contiguous(), s), out=parent[:, 4:4 + N])
        assert (parent[:, :4] == 0).all() and (parent[:, 4 + N:] == 0).all(), f"{variant}: wrote outside y"


@pytest.mark.parametrize("variant", TILED)
def test_thread_count_does_not_change_tiles(variant, amx_from):
    amx_from(1)
    rng = rng_for("amx-threads", variant)
    same_on_1_and_2_threads(rng, variant, tokens=20)


def test_threshold_picks_the_path(amx_from):
    """Below amx_min_tokens the emulated variant is the generic kernel, bit for bit (the real one is the AVX-512
    kernel); from it on, the tiles, which sum in another order; BF16 weights never take the tiles."""
    rng = rng_for("amx-threshold")
    w, s = weights(rng, 130, 1000, "fp8")
    wb, _ = weights(rng, 130, 1000, "bf16")
    x = bf16(rng, (12, 1000))
    generic = gemm(x, w, s, kernel="generic")
    amx_from(13)
    assert torch.equal(gemm(x, w, s, kernel="amx_emulated"), generic)
    amx_from(12)
    tiled = gemm(x, w, s, kernel="amx_emulated")
    assert not torch.equal(tiled, generic), "the tiles did not run at M = amx_min_tokens"
    assert torch.equal(gemm(x, wb, kernel="amx_emulated"), gemm(x, wb, kernel="generic"))
    if HAS_AMX:
        amx_from(13)
        assert torch.equal(gemm(x, w, s, kernel="amx"), gemm(x, w, s, kernel="avx512_bf16"))


@pytest.mark.parametrize("variant", TILED)
def test_batch_mates_change_nothing_with_every_call_on_tiles(variant, amx_from):
    """With every call on tiles (amx_min_tokens 1, as policy.decode.batch_invariant resolves it) a token's row is
    bitwise the same alone and in a batch of any size; under the default threshold it is not: alone it runs on the
    small-M kernel (the AVX-512 one; the generic one in the emulation), which sums the products in another order."""
    rng = rng_for("amx-batch-mates", variant)
    w, s = weights(rng, 300, 1000, "fp8")
    x = bf16(rng, (40, 1000))
    amx_from(1)
    alone = torch.cat([gemm(x[t:t + 1], w, s, kernel=variant) for t in range(x.shape[0])])
    for M in [2, 3, 4, 5, 15, 16, 17, 33, 40]:
        diff = (gemm(x[:M], w, s, kernel=variant) != alone[:M]).nonzero()
        assert diff.numel() == 0, (f"{variant} M={M}: token {diff[0, 0].item()} row {diff[0, 1].item()} differs "
                                   f"from the token alone")
    amx_from(AMX_MIN_TOKENS)
    assert not torch.equal(gemm(x[:1], w, s, kernel=variant), gemm(x[:16], w, s, kernel=variant)[:1])


@needs_amx
@pytest.mark.parametrize("M", [8, 16, 64, 512])
def test_deepseek_shape_real_tiles(M, amx_from):
    """2048 x 7168 (an expert's gate/up at hidden 7168) and 7168 x 2048 (down): real tiles vs float64 and vs the
    AVX-512 path (both within the bound of the reference, so within twice of each other)."""
    amx_from(1)
    for N, K in ((2048, 7168), (7168, 2048)):
        rng = rng_for("amx-deepseek", M, N, K)
        w, s = weights(rng, N, K, "fp8")
        x = bf16(rng, (M, K))
        tiles = run_and_check(x, w, s, "amx", "fp8 deepseek", dense64(w, s))
        p95, mx = rel_errors(tiles, gemm(x, w, s, kernel="avx512_bf16").double())
        assert p95 <= 2 * P95_BOUND and mx <= 2 * MAX_BOUND, f"amx vs avx512_bf16 M={M}: {p95:.2e} / {mx:.2e}"


# ------------------------------------------------------------------------------------------------ MoE layer

@pytest.mark.parametrize("amx_min", [1, 8])
@pytest.mark.parametrize("T", [1, 16, 64])
@pytest.mark.parametrize("D,I", DIMS, ids=[f"D{d}-I{i}" for d, i in DIMS])
@pytest.mark.parametrize("wtype", ["fp8", "bf16"])
@pytest.mark.parametrize("variant", TILED)
def test_moe_on_tiles(variant, wtype, D, I, T, amx_min, amx_from):
    """The MoE layer with experts on tiles and (amx_min 8) others on the small-M kernel in one call: the AMX
    layout of x and of h (written by gate/up for down), padded per expert."""
    amx_from(amx_min)
    rng = rng_for("amx-moe", variant, wtype, D, I, T, amx_min)
    ex = experts(wtype, D, I)
    op = CpuMoE(*ex["w"], *ex["s"], kernel=variant)
    x = bf16(rng, (T, D))
    ids, w = routing(rng, T)
    out = torch.full((T, D), float("nan"))
    op(x, ids, w, out)
    check(out, x, ids, w, ex["dense"], variant, f"{wtype} amx_min={amx_min}")


@pytest.mark.parametrize("variant", TILED)
def test_moe_hot_expert_on_tiles(variant, amx_from):
    """One expert with 130 tokens (nine token tiles), the others with a few: tiles and small path side by side."""
    amx_from(8)
    D, I = DIMS[1]
    T = 130
    rng = rng_for("amx-moe-hot", variant)
    x = bf16(rng, (T, D))
    ids, w, hot = routing_with_hot(rng, T)
    ex = experts("fp8", D, I)
    out = CpuMoE(*ex["w"], *ex["s"], kernel=variant)(x, ids, w)
    check(out, x, ids, w, ex["dense"], variant, "fp8 hot expert")


# ------------------------------------------------------------------------------------------------ choice, knob

def test_amx_missing_names_why():
    if HAS_AMX:
        pytest.skip("this CPU has AMX: the error for CPUs without it cannot be raised here")
    with pytest.raises(ValueError, match=r"CPU kernel 'amx' (needs .*amx_tile, amx_bf16, which this CPU lacks|"
                                         r"was not built|the OS refused AMX)") as e:
        dispatch.selected("amx")
    rng = rng_for("amx-missing")
    w, s = weights(rng, 16, 128, "fp8")
    with pytest.raises(ValueError, match="CPU kernel 'amx'"):
        gemm(bf16(rng, (16, 128)), w, s, kernel="amx")
    assert "amx" not in dispatch.available() and dispatch.selected() != "amx", str(e.value)


def test_auto_prefers_amx(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert (dispatch.selected() == "amx") == HAS_AMX
    assert dispatch.selected("amx_emulated") == "amx_emulated"  # any CPU: a test path, not a variant to choose
    assert "amx_emulated" not in dispatch.VARIANTS


@needs_amx
def test_prefetch_distance_changes_no_result(amx_from):
    """The prefetch (a hint) at each distance moe_quick compares: the same bits, the default put back after."""
    amx_from(1)
    rng = rng_for("amx-prefetch")
    w, s = weights(rng, 300, 1100, "fp8")
    x = bf16(rng, (33, 1100))
    try:
        got = []
        for ahead in (-1, 0, 512):
            set_amx_prefetch(ahead)
            got.append(gemm(x, w, s, kernel="amx"))
    finally:
        set_amx_prefetch(-1)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


@pytest.mark.parametrize("N,K", [(300, 1100), (65, 63), (576, 130)], ids=["300x1100", "65x63", "576x130"])
@pytest.mark.parametrize("variant", TILED)
def test_overlap_changes_no_result(variant, N, K, amx_from):
    """The next slab converted during the tiles or after them: the same products in the same order, the same bits
    (over short last row groups, 64-lane K tails and two token tiles); the default put back after."""
    amx_from(1)
    rng = rng_for("amx-overlap", variant, N, K)
    w, s = weights(rng, N, K, "fp8")
    x = bf16(rng, (33, K))
    try:
        set_amx_overlap(False)
        before = gemm(x, w, s, kernel=variant)
    finally:
        set_amx_overlap(True)
    assert torch.equal(gemm(x, w, s, kernel=variant), before)


def test_amx_prefetch_checked():
    with pytest.raises(ValueError, match="amx_prefetch must be -1"):
        set_amx_prefetch(-2)


def test_amx_min_tokens_checked():
    with pytest.raises(ValueError, match="amx_min_tokens must be >= 1"):
        set_amx_min_tokens(0)
    with pytest.raises(ValueError, match=r"policy.cpu.amx_min_tokens must be >= 1 or null, got 0"):
        CpuPolicy(amx_min_tokens=0)


def test_amx_min_tokens_resolved():
    """null: AMX_MIN_TOKENS, or 1 under decode.batch_invariant (every expert call on tiles); a set value as set,
    except one above 1 beside batch_invariant, which would let an expert's path follow its batch mates."""
    invariant = DecodePolicy(batch_invariant=True)
    assert amx_min_tokens(PolicyConfig()) == AMX_MIN_TOKENS > 1
    assert amx_min_tokens(PolicyConfig(decode=invariant)) == 1
    assert amx_min_tokens(PolicyConfig(cpu=CpuPolicy(amx_min_tokens=2))) == 2
    assert amx_min_tokens(PolicyConfig(cpu=CpuPolicy(amx_min_tokens=1), decode=invariant)) == 1
    with pytest.raises(ConfigError, match=r"policy.cpu.amx_min_tokens=4 contradicts policy.decode.batch_invariant"):
        check_policy(PolicyConfig(cpu=CpuPolicy(amx_min_tokens=4), decode=invariant))


def test_bench_times_amx_beside_avx512():
    from hybrid.bench.kernels import kernels_timed
    from hybrid.config.bench import KernelsBench

    here = dispatch.available()  # the variants this CPU runs (AMX, AVX-512 BF16 and AVX2 come and go between machines)
    assert kernels_timed(["generic", here[0]], "amx" if HAS_AMX else None) == ["generic", here[0]]
    if "avx512_bf16" not in here:
        with pytest.raises(ValueError, match="'avx512_bf16' needs .*avx512_bf16.*which this CPU lacks"):
            kernels_timed(["avx512_bf16"], None)
    assert kernels_timed([], "generic") == ["generic"]
    if HAS_AMX:
        assert kernels_timed([], "amx") == ["amx", "avx512_bf16"] == kernels_timed([], None)
    with pytest.raises(ValueError, match="bench.cpu_kernels takes amx, avx512_bf16, avx512, avx2, generic"):
        KernelsBench(cpu_kernels=["amx_emulated"])
