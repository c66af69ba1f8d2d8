"""fp8.dequantize: the broadcast path (whole blocks: the first three shapes) and the expanding path (ragged edges)
form the same FP32 products as the definition q·s."""
from __future__ import annotations

import pytest
import torch

from hybrid.quant import fp8


@pytest.mark.parametrize("shape", [(256, 384), (128, 128), (4096, 7168 // 4), (200, 300), (128, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_dequantize_is_the_blockwise_product(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    q, s = fp8.quantize(torch.randn(*shape, generator=g), (128, 128))
    definition = (q.float() * fp8.expand_scale(s.float(), shape, (128, 128))).to(dtype)
    got = fp8.dequantize(q, s, (128, 128), dtype)
    assert got.dtype == dtype and torch.equal(got, definition)
