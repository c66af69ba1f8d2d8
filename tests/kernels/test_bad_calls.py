"""Bad calls into the native kernels raise a clear Python exception (ValueError from the C++ checks, naming the
argument) and never crash the process.

Every check runs before the kernels touch memory, so the cases run in-process. The calls that involve the thread
pool's state (a submitted call in flight, an op dropped while its call runs) run in a subprocess that must exit
normally. (NaN FP8 codes are refused when a checkpoint loads: tests/weights/test_checkpoint_errors.py.)
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.gemm import gemm
from hybrid.kernels.moe import CpuMoE
from hybrid.kernels.view import view
from tests.kernels.common import bf16, block_scales, fp8_codes, rng_for

M, N, K = 3, 300, 200  # scale grid [3, 2]
E, D, I, T, TOPK = 4, 200, 96, 5, 2


def _gemm_args():
    rng = rng_for("bad-gemm")
    return dict(x=bf16(rng, (M, K)), w=fp8_codes(rng, (N, K)), scale=block_scales(rng, (N, K)),
                out=torch.zeros(M, N))


def _bad_gemm(**change):
    a = _gemm_args()
    a.update(change)
    return a


GEMM_CASES = {
    # dtypes
    "x float32": (_bad_gemm(x=torch.randn(M, K)), "x: dtype float32, expected bfloat16"),
    "x float16": (_bad_gemm(x=torch.randn(M, K).half()), "x: dtype float16"),
    "w float32": (_bad_gemm(w=torch.randn(N, K)), "w: dtype float32, expected float8_e4m3fn or bfloat16"),
    "w int8": (_bad_gemm(w=torch.zeros(N, K, dtype=torch.int8)), "w: dtype int8"),
    "scale float64": (_bad_gemm(scale=torch.ones(3, 2, dtype=torch.float64)), "scale: dtype float64"),
    "scale bf16": (_bad_gemm(scale=torch.ones(3, 2, dtype=torch.bfloat16)), "scale: dtype bfloat16"),
    "out bf16": (_bad_gemm(out=torch.empty(M, N, dtype=torch.bfloat16)), "y: dtype bfloat16, expected float32"),
    "out float64": (_bad_gemm(out=torch.empty(M, N, dtype=torch.float64)), "y: dtype float64"),
    # shapes
    "K mismatch": (_bad_gemm(w=fp8_codes(rng_for("k"), (N, K + 1))), f"w: shape [{N}, {K + 1}], expected [{N}, {K}]"),
    "scale rows": (_bad_gemm(scale=torch.ones(4, 2)), "scale: shape [4, 2], expected [3, 2]"),
    "scale cols": (_bad_gemm(scale=torch.ones(3, 1)), "scale: shape [3, 1], expected [3, 2]"),
    "scale per tensor": (_bad_gemm(scale=torch.ones(1, 1)), "scale: shape [1, 1], expected [3, 2]"),
    "out columns": (_bad_gemm(out=torch.empty(M, N + 1)), f"y: shape [{M}, {N + 1}], expected [{M}, {N}]"),
    "out rows": (_bad_gemm(out=torch.empty(M - 1, N)), f"y: shape [{M - 1}, {N}], expected [{M}, {N}]"),
    "x 1-D": (_bad_gemm(x=bf16(rng_for("1d"), (K,))), "x: expected 2 dimensions, got 1"),
    "w 3-D": (_bad_gemm(w=fp8_codes(rng_for("3d"), (1, N, K))), "w: expected 2 dimensions, got 3"),
    # layouts
    "x transposed": (_bad_gemm(x=bf16(rng_for("xt"), (K, M)).T), "x: last dimension must be contiguous"),
    "w transposed": (_bad_gemm(w=fp8_codes(rng_for("wt"), (K, N)).T), "w: last dimension must be contiguous"),
    "scale transposed": (_bad_gemm(scale=torch.ones(2, 3).T), "scale: last dimension must be contiguous"),
    "out transposed": (_bad_gemm(out=torch.empty(N, M).T), "y: last dimension must be contiguous"),
    "out rows overlap": (_bad_gemm(out=torch.empty(1, N).expand(M, N)), "y: rows overlap"),
    # FP8 / BF16 scale rules
    "fp8 without scale": (_bad_gemm(scale=None), "scale: FP8 weights need their weight_scale_inv"),
    "bf16 with scale": (_bad_gemm(w=bf16(rng_for("b"), (N, K))), "scale: BF16 weights take no scale"),
}


@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_gemm_bad_call(case):
    args, message = GEMM_CASES[case]
    def raw(t):
        return t.contiguous().view(torch.uint8).clone()
    out_before = raw(args["out"])
    with pytest.raises(ValueError) as e:
        gemm(args["x"], args["w"], args["scale"], args["out"])
    assert message in str(e.value), f"{case}: {e.value}"
    assert torch.equal(raw(args["out"]), out_before), f"{case}: out was written"


def test_gemm_unknown_kernel():
    a = _gemm_args()
    with pytest.raises(ValueError,
                       match=r"unknown CPU kernel 'avx9000' \(auto, amx, avx512_bf16, avx512, avx2 or generic\)"):
        gemm(a["x"], a["w"], a["scale"], a["out"], kernel="avx9000")


@pytest.mark.parametrize("variant", [v for v in dispatch.VARIANTS if v not in dispatch.available()] or ["(none)"])
def test_gemm_variant_cpu_lacks(variant):
    if variant == "(none)":
        pytest.skip("this CPU has every variant: forcing a missing one cannot be tested here (unknown names are)")
    a = _gemm_args()
    with pytest.raises(ValueError, match="which this CPU lacks"):
        gemm(a["x"], a["w"], a["scale"], a["out"], kernel=variant)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("which", ["x", "w", "scale", "out"])
def test_gemm_rejects_non_cpu_tensor(device, which):
    a = _gemm_args()
    a[which] = a[which].to(device)
    with pytest.raises(ValueError, match=f"CPU kernels take CPU tensors, got one on {device}"):
        gemm(a["x"], a["w"], a["scale"], a["out"])


# ---------------------------------------------------------------------------------------------------- MoE

def _experts(wtype="fp8"):
    rng = rng_for("bad-moe", wtype)
    shapes = [(I, D), (I, D), (D, I)]
    if wtype == "fp8":
        ws = [[fp8_codes(rng, s) for _ in range(E)] for s in shapes]
        ss = [[block_scales(rng, s) for _ in range(E)] for s in shapes]
    else:
        ws = [[bf16(rng, s) for _ in range(E)] for s in shapes]
        ss = [[], [], []]
    return ws, ss


def _moe(ws, ss):
    return CpuMoE(*ws, *ss)


def _ctor_case(change):
    ws, ss = _experts()
    change(ws, ss)
    return ws, ss


def _set(lst, i, v):
    lst[i] = v


CTOR_CASES = {
    "fp8 without scales": (lambda: (_experts()[0], [[], [], []]), "FP8 experts need one scale per weight"),
    "bf16 with scales": (lambda: (_experts("bf16")[0], _experts()[1]), "BF16 experts take no scales"),
    "fewer up experts": (lambda: _ctor_case(lambda ws, ss: ws[1].pop()),
                         "gate, up and down need one weight per expert"),
    "fewer down experts": (lambda: _ctor_case(lambda ws, ss: ws[2].pop()), "gate, up and down need one weight per"),
    "no experts": (lambda: ([[], [], []], [[], [], []]), "gate, up and down need one weight per expert"),
    "fewer scales": (lambda: _ctor_case(lambda ws, ss: ss[2].pop()), "FP8 experts need one scale per weight"),
    "float32 experts": (lambda: ([[torch.randn(I, D)] * E, [torch.randn(I, D)] * E, [torch.randn(D, I)] * E],
                                 [[], [], []]), "gate[0]: dtype float32, expected float8_e4m3fn or bfloat16"),
    "1-D expert": (lambda: _ctor_case(lambda ws, ss: _set(ws[0], 0, ws[0][0].flatten())),
                   "gate[0]: expected 2 dimensions, got 1"),
    "mixed dtypes": (lambda: _ctor_case(lambda ws, ss: _set(ws[2], 1, ws[2][1].to(torch.bfloat16))),
                     "down[1]: dtype bfloat16, expected float8_e4m3fn"),
    "up shape": (lambda: _ctor_case(lambda ws, ss: _set(ws[1], 3, fp8_codes(rng_for("u"), (I + 1, D)))),
                 f"up[3]: shape [{I + 1}, {D}], expected [{I}, {D}]"),
    "gate shape": (lambda: _ctor_case(lambda ws, ss: _set(ws[0], 2, fp8_codes(rng_for("g"), (I, D + 1)))),
                   f"gate[2]: shape [{I}, {D + 1}], expected [{I}, {D}]"),
    "down shape": (lambda: _ctor_case(lambda ws, ss: _set(ws[2], 2, fp8_codes(rng_for("d"), (D, I + 1)))),
                   f"down[2]: shape [{D}, {I + 1}], expected [{D}, {I}]"),
    "scale blocks": (lambda: _ctor_case(lambda ws, ss: _set(ss[0], 1, torch.ones(2, 1))),
                     "gate_scale[1]: shape [2, 1], expected [1, 2]"),
    "down scale blocks": (lambda: _ctor_case(lambda ws, ss: _set(ss[2], 0, torch.ones(1, 2))),
                          "down_scale[0]: shape [1, 2], expected [2, 1]"),
    "scale dtype": (lambda: _ctor_case(lambda ws, ss: _set(ss[1], 0, ss[1][0].double())),
                    "up_scale[0]: dtype float64, expected float32"),
    "expert transposed": (lambda: _ctor_case(lambda ws, ss: _set(ws[2], 0, ws[2][0].T.contiguous().T)),
                          "down[0]: last dimension must be contiguous"),
    "up stride differs": (lambda: _ctor_case(lambda ws, ss: _set(
        ws[0], 1, fp8_codes(rng_for("s"), (I, D + 64))[:, :D])), "up[1]: row stride differs from gate's"),
}


@pytest.mark.parametrize("case", list(CTOR_CASES))
def test_moe_bad_experts(case):
    make, message = CTOR_CASES[case]
    ws, ss = make()
    with pytest.raises(ValueError) as e:
        _moe(ws, ss)
    assert message in str(e.value), f"{case}: {e.value}"


def test_moe_rejects_non_cpu_experts():
    ws, ss = _experts()
    ws[1][2] = ws[1][2].to("meta")
    with pytest.raises(ValueError, match="CPU kernels take CPU tensors, got one on meta"):
        _moe(ws, ss)


@pytest.fixture(scope="module")
def op():
    return _moe(*_experts())


def _call(**change):
    rng = rng_for("bad-moe-call")
    a = dict(x=bf16(rng, (T, D)), ids=torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, 3]]),
             weights=torch.rand(T, TOPK), out=torch.zeros(T, D))
    a.update(change)
    return a


CALL_CASES = {
    "ids float32": (_call(ids=torch.zeros(T, TOPK)), "ids: dtype float32, expected int64 or int32"),
    "ids int16": (_call(ids=torch.zeros(T, TOPK, dtype=torch.int16)), "ids: dtype int16"),
    "ids 1-D": (_call(ids=torch.zeros(T, dtype=torch.int64)), "ids: expected 2 dimensions, got 1"),
    "out float64": (_call(out=torch.zeros(T, D, dtype=torch.float64)), "out: dtype float64, expected float32 or "),
    "out float16": (_call(out=torch.zeros(T, D, dtype=torch.float16)), "out: dtype float16"),
    "x hidden size": (_call(x=bf16(rng_for("xd"), (T, D + 1))), f"x: shape [{T}, {D + 1}], expected [{T}, {D}]"),
    "ids tokens": (_call(ids=torch.zeros(T + 1, TOPK, dtype=torch.int64)),
                   f"ids: shape [{T + 1}, {TOPK}], expected [{T}, {TOPK}]"),
    "weights vs ids": (_call(weights=torch.rand(T, TOPK + 1)),
                       f"weights: shape [{T}, {TOPK + 1}], expected [{T}, {TOPK}]"),
    "weights tokens": (_call(weights=torch.rand(T - 1, TOPK)), f"weights: shape [{T - 1}, {TOPK}], expected"),
    "out hidden size": (_call(out=torch.zeros(T, D - 1)), f"out: shape [{T}, {D - 1}], expected [{T}, {D}]"),
    "out tokens": (_call(out=torch.zeros(T + 1, D)), f"out: shape [{T + 1}, {D}], expected [{T}, {D}]"),
    "out transposed": (_call(out=torch.zeros(D, T).T), "out: last dimension must be contiguous"),
}


@pytest.mark.parametrize("how", ["call", "submit"])
@pytest.mark.parametrize("case", list(CALL_CASES))
def test_moe_bad_call(op, case, how):
    a, message = CALL_CASES[case]
    with pytest.raises(ValueError) as e:
        if how == "call":
            op(a["x"], a["ids"], a["weights"], a["out"])
        else:
            op.submit(a["x"], a["ids"], a["weights"], a["out"])
    assert message in str(e.value), f"{case}: {e.value}"
    assert op.wait() is None  # a refused submit leaves nothing in flight
    good = _call()
    op(good["x"], good["ids"], good["weights"], good["out"])  # and the op still works
    assert torch.isfinite(good["out"]).all()


def _native_args(**change):
    a = _call()
    a.update(change)
    return a


# The wrapper converts x to bf16, weights to fp32 and makes ids contiguous: the C++ checks behind it, directly.
NATIVE_CASES = {
    "x float32": (_native_args(x=torch.randn(T, D)), "x: dtype float32, expected bfloat16"),
    "weights float64": (_native_args(weights=torch.rand(T, TOPK, dtype=torch.float64)), "weights: dtype float64"),
    "weights bf16": (_native_args(weights=torch.rand(T, TOPK).bfloat16()), "weights: dtype bfloat16, expected float32"),
    "ids transposed": (_native_args(ids=torch.zeros(TOPK, T, dtype=torch.int64).T),
                       "ids: last dimension must be contig"),
    "x transposed": (_native_args(x=bf16(rng_for("xt"), (D, T)).T), "x: last dimension must be contiguous"),
}


@pytest.mark.parametrize("method", ["forward", "submit"])
@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_moe_native_checks(op, case, method):
    a, message = NATIVE_CASES[case]
    with pytest.raises(ValueError) as e:
        getattr(op._op, method)(*(view(a[k]) for k in ("x", "ids", "weights", "out")), "auto")
    assert message in str(e.value), f"{case}: {e.value}"
    op._op.wait()


@pytest.mark.parametrize("bad_id", [-2, E, E + 7, -(2 ** 40), 2 ** 40])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_moe_expert_id_out_of_range(op, bad_id, ids_dtype):
    if ids_dtype == torch.int32 and abs(bad_id) >= 2 ** 31:
        pytest.skip("does not fit int32")
    a = _call()
    a["ids"] = a["ids"].to(ids_dtype)
    a["ids"][3, 1] = bad_id
    for run in (op, op.submit):
        with pytest.raises(ValueError) as e:
            run(a["x"], a["ids"], a["weights"], a["out"])
        msg = str(e.value)
        assert f"expert id {bad_id} out of range 0..{E - 1}" in msg and "token 3, slot 1" in msg, msg
        assert op.wait() is None


@pytest.mark.parametrize("which", ["x", "ids", "weights", "out"])
def test_moe_rejects_non_cpu_tensor(op, which):
    a = _call()
    a[which] = a[which].to("meta")
    with pytest.raises(ValueError, match="CPU kernels take CPU tensors, got one on meta"):
        op(a["x"], a["ids"], a["weights"], a["out"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_moe_rejects_gpu_tensor(op):
    a = _call()
    with pytest.raises(ValueError, match="CPU kernels take CPU tensors, got one on cuda"):
        op(a["x"].cuda(), a["ids"], a["weights"], a["out"])


def test_moe_unknown_kernel():
    op = CpuMoE(*_experts()[0], *_experts()[1], kernel="avx9000")
    a = _call()
    with pytest.raises(ValueError, match="unknown CPU kernel 'avx9000'"):
        op(a["x"], a["ids"], a["weights"], a["out"])
    with pytest.raises(ValueError, match="unknown CPU kernel 'avx9000'"):
        op.submit(a["x"], a["ids"], a["weights"], a["out"])
    assert op.wait() is None


# ---------------------------------------------------------------------------------------- in a subprocess

RISKY = textwrap.dedent("""
    import gc, torch
    from hybrid.kernels.moe import CpuMoE
    from hybrid.kernels.gemm import gemm
    from hybrid.kernels.thread_pool import set_threads
    set_threads(2)
    E, D, I, T = 8, 1024, 1024, 64

    def experts():
        return ([torch.randn(I, D).bfloat16() for _ in range(E)], [torch.randn(I, D).bfloat16() for _ in range(E)],
                [torch.randn(D, I).bfloat16() for _ in range(E)])

    x = torch.randn(T, D).bfloat16()
    ids = torch.stack([torch.randperm(E)[:4] for _ in range(T)])
    w = torch.rand(T, 4)

    # 1. An op dropped while its submitted call runs (the caller kept no reference to the weights): the wrapper
    #    must join the call before the weights go (this crashed with SIGSEGV before CpuMoE.__del__ existed).
    for _ in range(2):
        op = CpuMoE(*experts())
        out = op.submit(x, ids, w)
        del op
        gc.collect()
        assert torch.isfinite(out).all()

    # 2. Bad calls while a call is in flight: refused, and the call in flight completes untouched.
    op = CpuMoE(*experts())
    want = op(x, ids, w)
    first = op.submit(x, ids, w)
    for bad in ((x, ids.float(), w), (x, ids + 100, w), (x, ids, w)):
        try:
            op.submit(*bad)
            raise SystemExit("a second submit was accepted")
        except ValueError as e:
            assert "not been waited for" in str(e), e
    y = gemm(torch.randn(3, D).bfloat16(), torch.randn(5, D).bfloat16())  # the pool is shared: runs after it
    assert op.wait() is first and torch.equal(first, want)

    # 3. Out-of-range ids rejected mid-stream, then normal calls.
    bad = ids.clone(); bad[7, 2] = E
    try:
        op(x, bad, w)
        raise SystemExit("out-of-range id accepted")
    except ValueError as e:
        assert "expert id 8 out of range" in str(e), e
    assert torch.equal(op(x, ids, w), want)

    # 4. Resizing the pool while a call is in flight.
    op.submit(x, ids, w)
    set_threads(1)
    got = op.wait()
    assert torch.equal(got, want)
    print("subprocess ok")
""")


def test_risky_calls_in_subprocess():
    r = subprocess.run([sys.executable, "-c", RISKY], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "subprocess ok" in r.stdout, \
        f"exit code {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
