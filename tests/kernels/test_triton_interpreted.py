"""The GPU's Triton kernels run by Triton's interpreter on the CPU (tests/kernels/interpreted.py): the block-scaled
FP8 GEMM over its tiles and the dequantise pass (hybrid/kernels/fp8_linear.py), the W4A16 GEMM and the INT4
dequantise pass (int4_linear.py), the one-pass RMSNorm, rotation and key expansion (pointwise.py), the experts'
combine (combine.py) — against float64 and the torch forms. They check the kernels' indexing, masks and block
scales, not the GPU's arithmetic (the GPU tests beside them do that)."""
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


def test_int4_gemm_and_dequantise():
    """The W4A16 GEMM (BF16 activations; FP32 ones on their IEEE tile) and the dequantise pass
    (hybrid/kernels/int4_linear.py) on weights with ragged last words and groups, the rows' padding nibbles random."""
    run("""
        import torch
        from hybrid.kernels import int4_linear as il
        from hybrid.kernels.fp8_linear import Fp8Gemm
        from hybrid.quant import int4

        g = torch.Generator().manual_seed(0)
        for n, k in ((256, 256), (200, 260), (130, 100)):
            packed = int4.pack(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8))
            if k % 8:  # the row's last word: nibbles past K are padding, which the kernels must not read
                packed[:, -1] |= torch.randint(0, 16, (n,), generator=g, dtype=torch.int32) << 28
            s = (torch.rand(int4.scale_shape((n, k)), generator=g) * 0.1 + 0.01).bfloat16()
            exact = int4.dequantize(packed, s, (n, k), torch.float64)
            assert torch.equal(il.dequantize(packed, s, k), int4.dequantize(packed, s, (n, k), torch.bfloat16))
            into = torch.empty(n, k, dtype=torch.float32)
            assert il.dequantize(packed, s, k, out=into) is into and torch.equal(into, exact.float())
            for m, dtypes in ((1, (torch.bfloat16, torch.float32)), (5, (torch.bfloat16,)), (17, (torch.bfloat16,)),
                              (70, (torch.bfloat16, torch.float32))):
                for dtype in dtypes:
                    x = torch.randn(m, k, generator=g).to(dtype)
                    want = x.double() @ exact.t()
                    bound = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
                    for backend in ("triton", "dequant"):
                        gemm = Fp8Gemm(backend)
                        assert il.path(gemm, x, m) == backend
                        y = il.linear(x, packed, s, k, gemm=gemm)
                        err = (y.double() - want).abs().max() / want.abs().max()
                        assert y.dtype == dtype and err <= bound, (n, k, m, dtype, backend, float(err))
            out = torch.full((5, n), float("nan"), dtype=torch.bfloat16)
            x = torch.randn(5, k, generator=g).bfloat16()
            assert il.linear(x, packed, s, k, gemm=Fp8Gemm("triton"), out=out) is out
            assert torch.equal(out, il.linear(x, packed, s, k, gemm=Fp8Gemm("triton")))
        print("ok")
    """)


def test_int4_gemm_reads_every_weight_back_with_its_own_scale():
    """Identity rows read single weights back exactly (q·s, one product, no sum): every nibble value at every
    position of a word and of a group, each (row, group) with a distinct power-of-two scale, a ragged last group. The
    wrong layouts (nibbles flipped within a byte, words read high nibble first, scales transposed, a scale per word
    instead of per group) each give other values, so a kernel reading any of them fails here."""
    run("""
        import torch
        from hybrid.kernels import int4_linear as il
        from hybrid.kernels.fp8_linear import Fp8Gemm
        from hybrid.quant import int4

        N, K = 19, 72
        q = ((torch.arange(N)[:, None] * 5 + torch.arange(K)[None, :] * 3) % 16 - 8).to(torch.int8)
        s = (2.0 ** (torch.arange(N * 3).view(N, 3) % 23 - 11)).bfloat16()
        packed = int4.pack(q)
        right = int4.dequantize(packed, s, (N, K), torch.float32)
        low = packed & 0x0F0F0F0F
        flipped = ((packed >> 4) & 0x0F0F0F0F) | (low << 4)
        nibbles = [(packed >> (4 * i)) & 0xF for i in range(8)]
        high_first = sum(nib << (4 * (7 - i)) for i, nib in enumerate(nibbles))
        wrong = [int4.dequantize(flipped, s, (N, K), torch.float32),
                 int4.dequantize(high_first, s, (N, K), torch.float32),
                 int4.dequantize(packed, s.t().contiguous().view(N, 3), (N, K), torch.float32),
                 int4.unpack(packed, K).float() * s.float()[:, (torch.arange(K) // 8).clamp(max=2)]]
        assert all(not torch.equal(w, right) for w in wrong)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.eye(K, dtype=dtype)
            for backend in ("triton", "dequant"):
                y = il.linear(x, packed, s, K, gemm=Fp8Gemm(backend)).float()
                assert torch.equal(y, right.t()), (dtype, backend, (y != right.t()).nonzero()[:3].tolist())
        print("ok")
    """)
