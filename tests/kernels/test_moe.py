"""hybrid.kernels.moe.CpuMoE (csrc/moe.cpp) against the MoE computed in float64 from the same weights, for every
kernel variant this CPU has, FP8 (128x128 block scales) and BF16 experts.

Reference: out[t] = Σ_k w[t,k] · down_e(h), h = SiLU(gate_e(x)) ⊙ up_e(x), e = ids[t,k], with x rounded to bf16
(the op's input type) and all arithmetic in float64, except one step mirrored from the op: h is rounded to bf16
before the down projection (the op stores it as the BF16 activation of the down GEMM).

Tolerance (per output element, rigorous rather than fitted):
  * fp32 accumulation: each dot product of n terms is off by at most ACC(n) = 2·n·2^-24 of its Σ|terms| (twice
    the worst-case bound γ_n), for gate, up, down and the weighted sum over k;
  * the bf16 rounding of h: where the float64 h lies within gate/up's fp32 error of a bf16 rounding midpoint,
    the op's fp32 h may round to the other neighbour. That 1-ulp "slack" per such element goes through |down|
    into the bound (the rest of h rounds as the reference does);
  * a bf16 output adds half an ulp (2^-8 relative).
Being worst-case, the bound calls ~40% of h elements ambiguous and amounts to a few 1e-4 of max|ref|; a kernel
bug (a wrong lane, a wrong scale, a missing expert) is an O(1) error and far outside. Observed (fp32 out):
max|err|/max|ref| up to ~3e-4, almost all of it from h elements that did round the other way (without them the
op agrees to ~1e-7); err/bound <= 0.87 over 40 seeds x every case. The levels are printed at the end of the run.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import time

import pytest
import torch

from hybrid import _native
from hybrid.kernels import dispatch
from hybrid.kernels.gemm import AMX_MIN_TOKENS, gemm, set_amx_min_tokens, set_batch_invariant
from hybrid.kernels.moe import CpuMoE, set_moe_lag_rounds, set_moe_longest_first
from hybrid.kernels.thread_pool import set_groups, set_threads, threads
from hybrid.kernels.view import view
from hybrid.weights.synthetic import RMS_CODE
from tests.kernels.common import bf16, block_scales, dense64, fp8_codes, record, rel_errors, rng_for, seed_note

VARIANTS = dispatch.available()
WTYPES = ["fp8", "bf16"]
E, TOPK = 16, 4
DIMS = [(200, 96), (256, 320)]  # (D hidden, I intermediate): ragged 128-blocks, 64-chunks and row tiles
TOKENS = [1, 2, 4, 16, 64]
CPUS = sorted(os.sched_getaffinity(0))
HALVES = [CPUS[:len(CPUS) // 2], CPUS[len(CPUS) // 2:]]  # two simulated NUMA nodes (docs/design/numa.md)
CONTIGUOUS = [0] * (E // 2) + [1] * (E - E // 2)  # a layer's experts over them, as placement splits it


@contextlib.contextmanager
def two_nodes(per_node=(2, 2)):
    """The pool in two simulated NUMA nodes (this machine's CPUs in two halves; more threads than cores), plain
    again after."""
    before = threads()
    set_groups(HALVES, per_node)
    try:
        yield
    finally:
        set_groups([], [])
        set_threads(before)


@pytest.fixture(params=["plain", "2 nodes"])
def pool_nodes(request):
    """Each expert's NUMA node for the op under test: None on the plain pool, or CONTIGUOUS on a pool in two
    simulated nodes (tests/kernels/test_moe_numa.py has the rest)."""
    if request.param == "plain":
        yield None
        return
    if len(CPUS) < 2:
        pytest.skip("two CPU groups need two CPUs")
    with two_nodes():
        yield CONTIGUOUS


def acc(n: int) -> float:
    return 2 * n * 2.0 ** -24


@functools.lru_cache(maxsize=None)
def experts(wtype: str, D: int, I: int):
    """E experts' (gate, up, down) weights and scales as the op takes them, plus their float64 dense forms.
    FP8 scales put each weight's RMS near 1/sqrt(fan_in) with a ±0.5 decade jitter per block."""
    rng = rng_for("experts", wtype, D, I)
    out = {"w": ([], [], []), "s": ([], [], []), "dense": ([], [], [])}
    for _ in range(E):
        for j, (n, k) in enumerate([(I, D), (I, D), (D, I)]):
            if wtype == "fp8":
                w = fp8_codes(rng, (n, k))
                s = block_scales(rng, (n, k), -0.5, 0.5) / (RMS_CODE * math.sqrt(k))
                out["s"][j].append(s)
            else:
                w, s = bf16(rng, (n, k), 1 / math.sqrt(k)), None
            out["w"][j].append(w)
            out["dense"][j].append(dense64(w, s))
    return out


@functools.lru_cache(maxsize=None)
def op_for(wtype: str, D: int, I: int, variant: str) -> CpuMoE:
    ex = experts(wtype, D, I)
    return CpuMoE(*ex["w"], *ex["s"], kernel=variant)


def routing(rng, T, dtype=torch.int64):
    """Top-k ids, distinct per token, and positive weights."""
    ids = torch.from_numpy(rng.permuted(torch.arange(E).expand(T, E).numpy(), axis=1)[:, :TOPK].copy())
    w = torch.from_numpy(rng.uniform(0.05, 1.0, size=(T, TOPK)).astype("float32"))
    return ids.to(dtype), w


def routing_with_hot(rng, T):
    """routing(), with one expert (returned) picked by every token: the prefill path for it, a few rows for the
    others."""
    ids, w = routing(rng, T)
    hot = int(rng.integers(E))
    ids[:, 0] = hot
    for t in range(T):  # keep ids distinct within each token
        row = [e for e in ids[t, 1:].tolist() if e != hot]
        rest = [e for e in range(E) if e != hot and e not in row]
        ids[t, 1:] = torch.tensor((row + rest)[:TOPK - 1])
    return ids, w, hot


def reference(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, dense, bf16_out: bool = False):
    """(float64 reference, per-element error bound, number of h elements whose bf16 rounding is ambiguous)."""
    G, U, Dn = dense
    x64 = x.to(torch.bfloat16).to(torch.float64)
    T, Dh = x64.shape
    I = G[0].shape[0]
    ref = torch.zeros(T, Dh, dtype=torch.float64)
    bound = torch.zeros(T, Dh, dtype=torch.float64)
    ids = ids.long()
    ambiguous = 0
    a_gu, a_d, a_k = acc(Dh + 2), acc(I + 2), acc(ids.shape[1] + 1)  # + the block post-scaling steps
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        xe = x64[t]
        g, u = xe @ G[e].T, xe @ U[e].T
        g_abs, u_abs = xe.abs() @ G[e].abs().T, xe.abs() @ U[e].abs().T
        sig = torch.sigmoid(g)
        silu, dsilu = g * sig, sig * (1 + g * (1 - sig))
        h = silu * u
        dh = a_gu * (dsilu.abs() * g_abs * u.abs() + silu.abs() * u_abs) + 1e-6 * h.abs()  # + fp32 SiLU itself
        hb = h.float().bfloat16().double()
        slack = (h + dh).float().bfloat16().double() - (h - dh).float().bfloat16().double()
        ambiguous += int((slack > 0).sum())
        y = hb @ Dn[e].T
        y_bound = slack @ Dn[e].abs().T + a_d * ((hb.abs() + slack) @ Dn[e].abs().T)
        w = wts[t, k].double()[:, None]
        ref.index_add_(0, t, w * y)
        bound.index_add_(0, t, w.abs() * (y_bound + a_k * (y.abs() + y_bound)))
    if bf16_out:
        bound += 2.0 ** -8 * (ref.abs() + bound)
    return ref, bound, ambiguous


def check(out, x, ids, wts, dense, variant, what):
    ref, bound, ambiguous = reference(x, ids, wts, dense, out.dtype == torch.bfloat16)
    err = (out.double() - ref).abs()
    p95, mx = rel_errors(out, ref)
    record("moe" if out.dtype == torch.float32 else "moe→bf16", variant, what.split()[0], p95, mx)
    worst = (err / bound.clamp_min(1e-300)).max().item()
    msg = (f"{variant} {what} T={x.shape[0]}: max err/bound = {worst:.3g}, max|err|/max|ref| = {mx:.3e}, "
           f"p95 |err|/|ref| = {p95:.3e}, {ambiguous} h elements with ambiguous bf16 rounding; {seed_note()}")
    assert torch.isfinite(out).all(), msg
    assert (err <= bound).all(), msg


# ------------------------------------------------------------------------------------------------ accuracy

@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("D,I", DIMS, ids=[f"D{d}-I{i}" for d, i in DIMS])
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(variant, wtype, D, I, T, pool_nodes):
    rng = rng_for("moe", variant, wtype, D, I, T)
    x = torch.from_numpy(rng.standard_normal((T, D)).astype("float32"))  # fp32: the op rounds it to bf16
    ids, w = routing(rng, T)
    out = torch.full((T, D), float("nan"))
    op = op_for(wtype, D, I, variant)
    op.nodes = pool_nodes or op.nodes
    got = op(x, ids, w, out)
    assert got is out
    check(out, x, ids, w, experts(wtype, D, I)["dense"], variant, wtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["out_f32", "out_bf16"])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["ids64", "ids32"])
@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_dtypes(variant, wtype, ids_dtype, out_dtype):
    D, I = DIMS[0]
    for T in (1, 16):
        rng = rng_for("moe-dtypes", variant, wtype, ids_dtype, out_dtype, T)
        x = bf16(rng, (T, D))
        ids, w = routing(rng, T, ids_dtype)
        out = torch.full((T, D), float("nan"), dtype=out_dtype)
        op_for(wtype, D, I, variant)(x, ids, w, out)
        check(out, x, ids, w, experts(wtype, D, I)["dense"], variant, f"{wtype} {ids_dtype} {out_dtype}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_skipped_ids_add_nothing(variant, pool_nodes):
    """id -1 marks a slot computed elsewhere (an expert resident on the GPU): the op is the reference over the other
    slots alone; a token with every slot skipped gets zeros."""
    D, I = DIMS[0]
    T = 5
    rng = rng_for("moe-skip", variant)
    x = bf16(rng, (T, D))
    ids, w = routing(rng, T)
    skipped = ids.clone()
    skipped[0, 1] = skipped[2, 0] = skipped[2, 3] = -1
    skipped[4] = -1
    out = torch.full((T, D), float("nan"))
    op = op_for("fp8", D, I, variant).twin()
    op.nodes = pool_nodes or op.nodes
    op(x, skipped, w, out)
    keep = skipped >= 0
    assert torch.equal(out[4], torch.zeros(D))
    ex = experts("fp8", D, I)
    check(out[:4], x[:4], torch.where(keep, ids, 0)[:4], torch.where(keep, w, 0.0)[:4], ex["dense"], variant, "fp8")


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_hot_expert(variant, wtype, pool_nodes):
    """One expert in every token's top-k (prefill of a skewed batch): that expert gets T = 130 rows, enough for
    the prefill (weight-tile) path; the others get a few rows each."""
    D, I = DIMS[1]
    T = 130
    rng = rng_for("moe-hot", variant, wtype)
    x = bf16(rng, (T, D))
    ids, w, hot = routing_with_hot(rng, T)
    out = torch.full((T, D), float("nan"))
    op = op_for(wtype, D, I, variant).twin()
    op.nodes = pool_nodes or op.nodes
    op(x, ids, w, out)
    check(out, x, ids, w, experts(wtype, D, I)["dense"], variant, wtype)


@pytest.mark.parametrize("variant", VARIANTS)
def test_repeated_ids_and_strided_out(variant):
    """The same expert twice for one token counts twice; out may be a slice of a wider tensor (row stride)."""
    D, I = DIMS[1]
    rng = rng_for("moe-repeat", variant)
    T = 5
    x = bf16(rng, (T, D))
    ids, w = routing(rng, T)
    ids[:, 1] = ids[:, 0]
    parent = torch.zeros(T, D + 9)
    out = parent[:, 3:3 + D].fill_(float("nan"))
    op_for("fp8", D, I, variant)(x, ids, w, out)
    check(out, x, ids, w, experts("fp8", D, I)["dense"], variant, "fp8 repeated-ids")
    assert (parent[:, :3] == 0).all() and (parent[:, 3 + D:] == 0).all(), f"{variant}: wrote outside out"


# ------------------------------------------------------------------------------------ submit / wait, threads

def _inputs(key, T, D):
    rng = rng_for("moe-async", *key)
    ids, w = routing(rng, T)
    return bf16(rng, (T, D)), ids, w


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_submit_wait_equals_call(variant, wtype, pool_nodes):
    D, I = DIMS[1]
    op = op_for(wtype, D, I, variant)
    op.nodes = pool_nodes or op.nodes
    for T in (1, 16, 64):
        x, ids, w = _inputs((variant, wtype, T), T, D)
        called = op(x, ids, w)
        assert op.global_syncs == 1, "no barrier: only the job's end"
        pending = op.submit(x, ids, w)
        # the caller works meanwhile: torch, and a native GEMM on the same thread pool
        rng = rng_for("moe-between", variant, wtype, T)
        a, b = bf16(rng, (7, 300)), bf16(rng, (65, 300))
        between = gemm(a, b, kernel=variant)
        busy = (a.double() @ b.double().T)
        got = op.wait()
        assert got is pending and op.global_syncs == 1
        assert torch.equal(got, called), f"{variant} {wtype} T={T}: submit/wait differs from the call; {seed_note()}"
        assert rel_errors(between, busy)[1] <= 1e-4, "the GEMM run between submit and wait is wrong"
        assert op.wait() is None  # nothing in flight any more


@pytest.mark.parametrize("variant", VARIANTS)
def test_task_order_changes_no_result(variant):
    """An expert's down tasks queued 0, 1 or 2 rounds of tasks behind its gate/up tasks, the experts taken by token
    count (most first) or by id: the same bits at every thread count; the threads' seconds spent waiting, idle at
    the end and in the tasks' stages lie within threads x the call."""
    D, I = DIMS[1]
    op = op_for("fp8", D, I, variant)
    before = threads()
    try:
        for n in (1, 2, 4):
            set_threads(n)
            for T in (3, 64):
                x, ids, w = _inputs(("held", variant, n, T), T, D)
                got = {}
                for rounds, longest in ((2, True), (1, True), (0, True), (2, False), (0, False)):
                    set_moe_lag_rounds(rounds)
                    set_moe_longest_first(longest)
                    t0 = time.perf_counter()
                    got[rounds, longest] = op(x, ids, w)
                    wall = time.perf_counter() - t0
                    stages = op.stage_s
                    assert set(stages) == {"prep", "gate_up", "silu", "down", "sums"} and stages["gate_up"] > 0 \
                        and stages["down"] > 0, stages
                    for what, sec in (("waiting", op.wait_s), ("idle at the end", op.tail_s), *stages.items()):
                        assert 0 <= sec <= n * wall, f"{what}: {sec} s for {n} threads over a {wall} s call"
                    assert op.wait_s + op.tail_s + sum(stages.values()) <= n * wall, (op.wait_s, op.tail_s, stages)
                for way, y in got.items():
                    assert torch.equal(y, got[2, True]), f"{variant} {n} threads T={T} {way}; {seed_note()}"
    finally:
        set_moe_lag_rounds(2)
        set_moe_longest_first(True)
        set_threads(before)


@pytest.mark.parametrize("variant", VARIANTS)
def test_submit_twice_raises(variant):
    D, I = DIMS[0]
    op = op_for("fp8", D, I, variant)
    x, ids, w = _inputs((variant, "twice"), 16, D)
    want = op(x, ids, w)
    first = op.submit(x, ids, w)
    with pytest.raises(ValueError, match="not been waited for"):
        op.submit(x, ids, w)
    with pytest.raises(ValueError, match="not been waited for"):
        op(x, ids, w)
    got = op.wait()
    assert got is first, "a refused submit() replaced the call in flight"
    assert torch.equal(got, want)
    assert torch.equal(op(x, ids, w), want)  # usable again


@pytest.mark.parametrize("variant", VARIANTS)
def test_twins_pending_at_once(variant):
    """Two ops over the same weights (two decode lanes) each with a call pending: the pool runs them in turn and each
    wait() returns its own call's result, whichever order the waits come in, from one thread or from two at once
    (the two lanes' host functions), at 1 and 2 pool threads."""
    import threading

    D, I = DIMS[1]
    op = op_for("fp8", D, I, variant)
    twin = op.twin()
    inputs = [_inputs((variant, "twin", lane, T), T, D) for lane in (0, 1) for T in (1, 3, 16)]
    want = [op(*a) for a in inputs]
    assert all(torch.equal(twin(*a), w) for a, w in zip(inputs, want)), "the twin computes what the op does"
    before = threads()
    try:
        for n in (1, 2):
            set_threads(n)
            for i in range(3):
                a, b = inputs[i], inputs[3 + i]
                pa, pb = op.submit(*a), twin.submit(*b)
                assert twin.wait() is pb and op.wait() is pa  # waits in the other order than the submits
                assert torch.equal(pa, want[i]) and torch.equal(pb, want[3 + i]), f"{variant} n={n}; {seed_note()}"
            errors, start = [], threading.Barrier(2)

            def lane(o: CpuMoE, first: int) -> None:
                try:
                    start.wait()
                    for it in range(30):
                        i = first + it % 3
                        o.submit(*inputs[i])
                        got = o.wait()
                        if not torch.equal(got, want[i]):
                            errors.append(f"lane {first // 3} call {it}: wrong result")
                except Exception as e:  # noqa: BLE001 - reported by the main thread
                    errors.append(repr(e))
            runners = [threading.Thread(target=lane, args=(o, f)) for o, f in ((op, 0), (twin, 3))]
            for t in runners:
                t.start()
            for t in runners:
                t.join(timeout=120)
            assert not any(t.is_alive() for t in runners), f"{variant} n={n}: two lanes' calls hung"
            assert not errors, f"{variant} n={n}: {errors[:3]}; {seed_note()}"
    finally:
        set_threads(before)


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_thread_counts_agree(variant, wtype):
    """1 and 2 pool threads (the call and submit paths) give the same bits; the previous count is restored."""
    D, I = DIMS[1]
    op = op_for(wtype, D, I, variant)
    before = threads()
    results = {}
    try:
        for n in (1, 2):
            set_threads(n)
            assert threads() == n
            for T in (1, 4, 64):
                x, ids, w = _inputs((variant, wtype, "threads", T), T, D)
                results[n, T, "call"] = op(x, ids, w)
                op.submit(x, ids, w)
                results[n, T, "submit"] = op.wait()
    finally:
        set_threads(before)
    assert threads() == before
    for T in (1, 4, 64):
        for how in ("call", "submit"):
            assert torch.equal(results[1, T, how], results[2, T, how]), \
                f"{variant} {wtype} T={T} {how}: 1 vs 2 threads differ; {seed_note()}"


# ------------------------------------------------------------------------------------------------ placement

def test_placement_on_tiny_model(tiny_dir):
    """experts_to_cpu_kernels on the tiny checkpoint (FP8 experts, I = 96) in a BF16 model.

    Tolerances, relative to max|float64 reference|:
      * native vs the float64 MoE of the same weights: <= 1e-2. The native op is exact up to fp32 accumulation
        except for two bf16 roundings (h before down, and the layer's bf16 output: CpuExperts returns the
        model dtype), each <= 2^-9 of an element;
      * the torch experts (BF16 model) vs native: <= 3e-2. The torch path rounds to bf16 at every step (the
        dequantised weights, gate, up, SiLU, h, each expert's output and the sum): ~6 roundings of <= 2^-9.
    Observed: ~3e-3 and ~1e-2.
    """
    from hybrid.placement.passes import CpuExperts, experts_to_cpu_kernels
    from hybrid.model.moe import MoE
    from hybrid.weights.checkpoint import Checkpoint
    from hybrid.weights.loader import load_model

    model = load_model(Checkpoint(tiny_dir), torch.bfloat16, progress=False)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == 2
    rng = rng_for("placement")
    cases = []
    for layer, moe in enumerate(moes):
        for T in (1, 16):
            x = bf16(rng, (T, moe.experts[0].gate_proj.in_features))
            weights, ids = moe.gate(x)
            torch_out = moe.experts(x, weights, ids)
            full = moe(x[None])[0]
            dense = tuple([e.__getattr__(p).dense_weight(torch.float64) for e in moe.experts]
                          for p in ("gate_proj", "up_proj", "down_proj"))
            truth = torch.zeros(T, x.shape[1], dtype=torch.float64)
            for t in range(T):
                for k, e in enumerate(ids[t].tolist()):
                    xe = x[t].double()
                    h = torch.nn.functional.silu(dense[0][e] @ xe) * (dense[1][e] @ xe)
                    truth[t] += weights[t, k].double() * (dense[2][e] @ h)
            cases.append((layer, moe, x, weights, ids, torch_out, full, truth))

    assert experts_to_cpu_kernels(model) == 2
    assert all(isinstance(m.experts, CpuExperts) for m in moes)
    assert experts_to_cpu_kernels(model) == 0  # already placed
    for layer, moe, x, weights, ids, torch_out, full, truth in cases:
        native = moe.experts(x, weights, ids)
        assert native.dtype == x.dtype == torch_out.dtype and native.shape == torch_out.shape
        top = truth.abs().max().item()
        vs_truth = (native.double() - truth).abs().max().item() / top
        vs_torch = (native.double() - torch_out.double()).abs().max().item() / top
        msg = (f"layer {layer} T={x.shape[0]}: native vs float64 {vs_truth:.2e}, native vs torch bf16 "
               f"{vs_torch:.2e} (of max|ref|); {seed_note()}")
        assert vs_truth <= 1e-2 and vs_torch <= 3e-2, msg
        full_native = moe(x[None])[0]  # router and shared experts unchanged around the native op
        full_err = (full_native.double() - full.double()).abs().max().item() / full.double().abs().max().item()
        assert full_err <= 3e-2, f"{msg}; whole MoE layer differs by {full_err:.2e}"


@pytest.mark.parametrize("n", [1, 7, 33, 1000, 4099])
def test_silu_step_within_float64(n):
    """The op's SiLU step (polynomial exp, vectorised per ISA) against float64: each output is the bf16 rounding of
    a value within 5e-7 (relative) of silu(g)·u wherever expf(-g) is finite (g > -88.7), at lengths with and
    without vector tails."""
    gen = torch.Generator().manual_seed(n)
    g = torch.cat([torch.empty(n // 2).uniform_(-88.7, 88, generator=gen),
                   torch.randn(n - n // 2, generator=gen) * 4]).float()
    u = (torch.randn(n, generator=gen) * 3).float()
    out = torch.empty(n, dtype=torch.bfloat16)
    _native.silu_mul(view(g), view(u), view(out))
    ref = torch.nn.functional.silu(g.double()) * u.double()
    eps = 5e-7 * ref.abs()
    lo = torch.minimum((ref - eps).float().bfloat16(), (ref + eps).float().bfloat16()).double()
    hi = torch.maximum((ref - eps).float().bfloat16(), (ref + eps).float().bfloat16()).double()
    got = out.double()
    bad = (got < lo) | (got > hi)
    assert not bad.any(), f"{int(bad.sum())} of {n} outside: g={g[bad][:4].tolist()} got={got[bad][:4].tolist()} " \
                          f"ref={ref[bad][:4].tolist()}"


def test_silu_step_specials_and_errors():
    inf, nan = float("inf"), float("nan")
    g = torch.tensor([nan, 0.0, -0.0, 30.0, 88.0, 200.0, -87.0, 1e-30, -88.5, -95.0, -1e30, -3e38, -inf, inf])
    u = torch.ones_like(g)
    out = torch.empty(len(g), dtype=torch.bfloat16)
    _native.silu_mul(view(g), view(u), view(out))
    o = out.float()
    assert torch.isnan(o[0]) and torch.isnan(o[12])  # NaN, and -inf · sigmoid(-inf) as expf's version gave
    assert o[1] == 0 and o[2] == 0
    assert o[3] == torch.tensor(30.0).bfloat16().float()  # sigmoid(30) rounds to 1 in float32
    assert o[4] == torch.tensor(88.0).bfloat16().float() and o[5] == torch.tensor(200.0).bfloat16().float()
    assert o[13] == inf
    assert 0 > o[6] > -1e-35  # -87 · e^-87 ≈ -1.4e-36
    assert o[7] == torch.tensor(5e-31).bfloat16().float()
    assert o[8] == torch.tensor(-88.5 * math.exp(-88.5)).bfloat16().float()  # e^88.5 is still a float
    # past expf's range the denominator overflows: -0, as with expf (not g · e^-88 from a clamped exponent)
    assert all(o[i] == 0 and torch.signbit(o[i]) for i in (9, 10, 11)), o[9:12]
    with pytest.raises(ValueError, match="u"):
        _native.silu_mul(view(g), view(u[:3].clone()), view(out))
    with pytest.raises(ValueError, match="float32"):
        _native.silu_mul(view(g.double()), view(u), view(out))


# ------------------------------------------------------------------------------------------------ batch mates

@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS + ["amx_emulated"])
def test_token_alone_equals_its_row_in_a_batch(variant, wtype):
    """A served request's numbers must not depend on its batch mates: each token's output computed alone is bitwise
    its row in a batch of 70 where one expert has every token (past gemm_tile_tokens: the converted tiles; AMX
    tiles) and the others a dozen or so, in the kernels' batch-invariant setting (policy.decode.batch_invariant):
    amx with every expert call on tiles, avx512_bf16's converted tiles in the streaming form's sums (test_amx.py,
    test_gemm.py: without it, both switch forms with the count of batch mates)."""
    D, I = DIMS[1]
    T = 70
    rng = rng_for("moe-batch-mates", variant, wtype)
    x = bf16(rng, (T, D))
    ids, w, _ = routing_with_hot(rng, T)
    op = op_for(wtype, D, I, variant)
    set_amx_min_tokens(1)  # the batch-invariant setting (build.configure_cpu under policy.decode.batch_invariant)
    set_batch_invariant(True)
    try:
        together = op(x, ids, w)
        alone = torch.cat([op(x[t:t + 1], ids[t:t + 1], w[t:t + 1]) for t in range(T)])
    finally:
        set_amx_min_tokens(AMX_MIN_TOKENS)
        set_batch_invariant(False)
    diff = (alone != together).nonzero()
    assert diff.numel() == 0, (f"{variant} {wtype}: token {diff[0, 0].item()} differs alone and in the batch "
                               f"(hidden unit {diff[0, 1].item()}); {seed_note()}")
