"""The GPU's Triton kernels run by Triton's interpreter on the CPU (tests/kernels/interpreted.py): the block-scaled
FP8 GEMM over its tiles and the dequantise pass (hybrid/kernels/fp8_linear.py), the one-pass RMSNorm, rotation and
key expansion (pointwise.py), the experts' combine (combine.py) — against float64 and the torch forms. They check
the kernels' indexing, masks and block scales, not the GPU's arithmetic (the GPU tests beside them do that)."""
from __future__ import annotations

from tests.kernels.interpreted import run


def test_fp8_gemm_and_dequantise():
    run("""
        import torch
        from hybrid.kernels import fp8_linear as fl
        from hybrid.quant import fp8

        g = torch.Generator().manual_seed(0)
        for n, k in ((256, 256), (200, 320), (130, 96)):  # rows and columns off the 128-blocks too
            q, s = fp8.quantize(torch.randn(n, k, generator=g) * 3, (128, 128))
            exact = fp8.dequantize(q, s, (128, 128), torch.float64)
            assert torch.equal(fl.dequantize(q, s, (128, 128)), fp8.dequantize(q, s, (128, 128), torch.bfloat16))
            for m in (1, 5, 17, 70):  # the decode tile (<= 16 rows) and the next one
                x = torch.randn(m, k, generator=g).bfloat16()
                want = x.double() @ exact.t()
                for backend in ("triton", "dequant"):
                    gemm = fl.Fp8Gemm(backend)
                    assert gemm.path(x, (128, 128), m) == backend
                    y = gemm.linear(x, q, s, (128, 128))
                    err = (y.double() - want).abs().max() / want.abs().max()
                    assert y.dtype == torch.bfloat16 and err <= 2 ** -7, (n, k, m, backend, float(err))
                out = torch.empty(m, n, dtype=torch.bfloat16)
                assert fl.Fp8Gemm("triton").linear(x, q, s, (128, 128), out=out) is out
                assert torch.equal(out, fl.Fp8Gemm("triton").linear(x, q, s, (128, 128)))
        print("ok")
    """)


def test_pointwise_kernels_and_combine():
    run("""
        import torch
        from hybrid.kernels import combine as cb, pointwise as pw

        g = torch.Generator().manual_seed(1)
        on = pw.Fused(min_rows=1)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(37, 100, generator=g) * 3).to(dtype)
            w = (torch.rand(100, generator=g) + 0.5).bfloat16()
            assert on.applies(x, 37)
            got, ref = pw.rms_norm(x, w, 1e-6, on), pw.rms_norm_reference(x, w, 1e-6)
            assert (got.float() - ref.float()).abs().max() <= 2 ** -6 * ref.float().abs().max()
            q = torch.randn(2, 9, 5, 16 + 12, generator=g).to(dtype)
            angles = torch.rand(1, 9, 6, generator=g) * 50
            cos, sin = angles.cos(), angles.sin()
            want = pw.rotate_reference(q[..., 16:], cos.expand(2, -1, -1), sin.expand(2, -1, -1))
            scale = q[..., 16:].abs().amax(-1, keepdim=True).float()
            pw.rotate_(q[..., 16:], cos, sin, on)
            assert ((q[..., 16:].float() - want.float()).abs() <= 2 ** -6 * scale).all()
            kv = torch.randn(2, 9, 5, 16 + 8, generator=g).to(dtype)
            pe = torch.randn(2, 9, 12, generator=g).to(dtype)
            assert torch.equal(pw.expand_keys(kv[..., :16], pe, on), pw.expand_keys_reference(kv[..., :16], pe))
        T, K, D = 11, 3, 1100  # D past one program's block
        y = torch.randn(T * K, D, generator=g).bfloat16()
        row = torch.randperm(T * K, generator=g).view(T, K)
        wts = torch.rand(T, K, generator=g)
        fused, plain = cb.combine(y, row, wts, torch.float32), cb.combine(y, row, wts, torch.float32, fused=False)
        assert (fused - plain).abs().max() <= 1e-5 * plain.abs().max()
        print("ok")
    """)
