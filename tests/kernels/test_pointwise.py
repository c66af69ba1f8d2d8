"""RMSNorm, in-place RoPE and the per-head key expansion (hybrid/kernels/pointwise.py): the torch forms against
float64 on the CPU; the one-pass Triton kernels against the torch forms on a GPU."""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import combine, pointwise as pw
from hybrid.kernels.fallback import compiled
from hybrid.model.args import ModelArgs
from hybrid.weights.presets import DEEPSEEK_V3

GPU = pytest.mark.skipif(not torch.cuda.is_available() or pw.triton is None, reason="needs CUDA and Triton")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's magnitude (BF16: 8 significant bits)."""
    ulp = torch.exp2(torch.floor(torch.log2(b.double().abs().clamp_min(1e-30))) - 7)
    return (a.double() - b.double()).abs() / ulp


def test_rms_norm_matches_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 7, 96, generator=g).bfloat16(), torch.rand(96, generator=g).bfloat16() + 0.5
    ref = x.double() / x.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w.double()
    out = pw.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert _ulps_apart(out, ref).max() <= 1.5  # two BF16 roundings (normalised, then weighted)


def test_rotation_in_place_on_a_view_matches_float64():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 4, 12, generator=g).bfloat16()  # per head: 8 plain dims, then 4 rotary ones
    before = q.clone()
    angles = torch.rand(2, 6, 2, generator=g, dtype=torch.float64) * 6
    cos, sin = angles.cos().float(), angles.sin().float()
    pw.rotate_(q[..., 8:], cos, sin)
    assert torch.equal(q[..., :8], before[..., :8]), "the plain dims stay as they were"
    x = before[..., 8:].double().unflatten(-1, (-1, 2))
    c, s = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    ref = torch.stack((x[..., 0] * c - x[..., 1] * s, x[..., 0] * s + x[..., 1] * c), -1).flatten(-2)
    assert (q[..., 8:].double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


def test_keys_expanded_per_head():
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(1, 5, 3, 8 + 6, generator=g)
    pe = torch.randn(1, 5, 4, generator=g)
    k = pw.expand_keys(kv[..., :8], pe)
    assert k.shape == (1, 5, 3, 12)
    for h in range(3):
        assert torch.equal(k[:, :, h, :8], kv[:, :, h, :8]) and torch.equal(k[:, :, h, 8:], pe)


def test_each_asks_the_gate_it_is_given_with_its_row_count_and_takes_the_torch_form_when_refused():
    asked = []

    class Refusing:
        def applies(self, x, rows):
            asked.append(rows)
            return False

    gate = Refusing()
    x, w = torch.randn(3, 4, 16), torch.ones(16)
    assert torch.equal(pw.rms_norm(x, w, 1e-6, gate), pw.rms_norm_reference(x, w, 1e-6))
    q, cos, sin = torch.randn(3, 4, 2, 6), torch.rand(3, 4, 3), torch.rand(3, 4, 3)
    want = pw.rotate_reference(q, cos, sin)
    pw.rotate_(q, cos, sin, gate)
    assert torch.equal(q, want)
    pw.expand_keys(torch.randn(3, 4, 2, 5), torch.randn(3, 4, 2), gate)
    assert asked == [12, 12, 12]  # rows = tokens, whatever the heads


def test_the_gate_needs_a_gpu_enough_rows_and_the_kernels_on(monkeypatch):
    x = torch.randn(2048, 8)
    assert not pw.FUSED.applies(x, 2048)  # on the CPU the torch forms run, whatever the size

    class Cuda:  # what the gate reads of a CUDA activation
        device, dtype = torch.device("cuda"), torch.bfloat16

    monkeypatch.setattr(pw.triton_device, "triton", pw.triton or object())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert pw.FUSED.applies(Cuda, pw.MIN_ROWS) and not pw.FUSED.applies(Cuda, pw.MIN_ROWS - 1)
    assert not pw.Fused(enabled=False).applies(Cuda, 10 * pw.MIN_ROWS)
    assert pw.Fused(min_rows=8).applies(Cuda, 8)


def test_kernels_that_fail_to_compile_leave_the_torch_forms_with_a_warning():
    def broken():
        raise RuntimeError("PTX assembly failed")

    with pytest.warns(UserWarning, match="RoPE.*PTX assembly failed.*torch forms run instead"):
        assert compiled("RMSNorm, RoPE and key expansion", broken) is False
    assert compiled("x", lambda: None) is True


def test_warm_up_off_a_gpu_compiles_nothing_and_says_so():
    a = ModelArgs.from_hf_config(DEEPSEEK_V3)
    assert pw.warm_up(a, "cpu") is False and combine.warm_up(8, 7168, "cpu") is False


def test_warm_up_that_fails_says_so(monkeypatch):
    def broken(*args):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(pw, "triton", pw.triton or object())
    monkeypatch.setattr(pw, "_warm_up", broken)
    with pytest.warns(UserWarning, match="torch forms run instead"):
        assert pw.warm_up(ModelArgs.from_hf_config(DEEPSEEK_V3), "cuda") is False


@GPU
def test_warm_up_compiles_for_the_model_and_says_the_kernels_can_run():
    assert pw.warm_up(ModelArgs.from_hf_config(DEEPSEEK_V3), "cuda") is True
    assert combine.warm_up(8, 7168, "cuda") is True


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_rotation_and_keys_with_a_batch_and_odd_head_counts(dtype):
    g = torch.Generator().manual_seed(5)
    B, S, H = 2, pw.MIN_ROWS // 2 + 3, 5
    q = torch.randn(B, S, H, 16 + 12, generator=g).to(dtype).cuda()
    angles = torch.rand(1, S, 6, generator=g).cuda() * 50  # one set of positions for the batch, broadcast
    cos, sin = angles.cos(), angles.sin()
    want = pw.rotate_reference(q[..., 16:], cos.expand(B, -1, -1), sin.expand(B, -1, -1))
    scale = q[..., 16:].abs().amax(-1, keepdim=True).float()
    pw.rotate_(q[..., 16:], cos, sin)
    assert ((q[..., 16:].float() - want.float()).abs() <= 2 ** -6 * scale).all()
    kv = torch.randn(B, S, H, 16 + 8, generator=g).to(dtype).cuda()
    pe = torch.randn(B, S, 12, generator=g).to(dtype).cuda()
    assert torch.equal(pw.expand_keys(kv[..., :16], pe), pw.expand_keys_reference(kv[..., :16], pe))


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [7168, 1536, 512, 100])
def test_triton_rms_norm_matches_the_torch_form(d, dtype):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(pw.MIN_ROWS + 3, d, generator=g) * 3).to(dtype).cuda()
    w = (torch.rand(d, generator=g) + 0.5).bfloat16().cuda()
    out, ref = pw.rms_norm(x, w, 1e-6), pw.rms_norm_reference(x, w, 1e-6)
    if dtype == torch.bfloat16:  # a last-bit FP32 difference may round the normalised value the other way, and
        apart = _ulps_apart(out, ref)  # the weight (up to 1.5) carries that into a second unit
        assert apart.max() <= 2 and (apart == 0).float().mean() > 0.99
    else:
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@GPU
def test_triton_rotation_in_place_matches_the_torch_form():
    g = torch.Generator().manual_seed(3)
    B, S, H = 1, pw.MIN_ROWS + 5, 128
    q = torch.randn(B, S, H, 192, generator=g).bfloat16().cuda()
    angles = torch.rand(B, S, 32, generator=g).cuda() * 100
    cos, sin = angles.cos(), angles.sin()
    want = torch.cat([q[..., :128], pw.rotate_reference(q[..., 128:], cos, sin)], -1)
    scale = q[..., 128:].abs().amax(-1, keepdim=True).float()  # each head's rotary part, before
    pw.rotate_(q[..., 128:], cos, sin)
    assert torch.equal(q[..., :128], want[..., :128])
    # a·cos − b·sin may cancel: a last-bit FP32 difference (fused multiply-add) is judged against the inputs' size
    diff = (q[..., 128:].float() - want[..., 128:].float()).abs()
    assert (diff <= 2 ** -6 * scale).all() and (diff == 0).float().mean() > 0.98  # 1 BF16 unit of |out| <= 1.42 scale


@GPU
def test_triton_key_expansion_is_exact():
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(1, pw.MIN_ROWS + 7, 128, 256, generator=g).bfloat16().cuda()
    pe = torch.randn(1, pw.MIN_ROWS + 7, 64, generator=g).bfloat16().cuda()
    assert torch.equal(pw.expand_keys(kv[..., :128], pe), pw.expand_keys_reference(kv[..., :128], pe))
