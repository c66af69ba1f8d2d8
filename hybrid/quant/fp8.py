"""FP8 E4M3 block tensors: W = q * s for each block of the weight (128x128 in DeepSeek-V3), ragged at the edges."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """The per-block scale broadcast to one value per weight element."""
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[: shape[0], : shape[1]]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype=torch.bfloat16) -> torch.Tensor:
    """q·s with the product formed in FP32, then cast to `dtype`. Whole blocks broadcast the scales (no full-size
    scale tensor); ragged edges expand them."""
    n, k = q.shape
    w = q.to(torch.float32)
    if n % block[0] == 0 and k % block[1] == 0:
        sn, sk = scale_shape((n, k), block)
        return (w.view(sn, block[0], sk, block[1]) * scale.to(torch.float32)[:, None, :, None]).view(n, k).to(dtype)
    return (w * expand_scale(scale.to(torch.float32), (n, k), block)).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int], rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 quantisation as the releases do it: scale = amax / 448 per block. `rows` (a multiple of
    block[0]; 0 = all): quantised that many rows at a time, so the FP32 temporaries stay that small."""
    n, k = w.shape
    if 0 < rows < n:
        if rows % block[0]:
            raise ValueError(f"quantize: rows={rows} must be a multiple of the block's {block[0]}")
        q = torch.empty(n, k, dtype=FP8)
        scale = torch.empty(scale_shape((n, k), block), dtype=torch.float32)
        for i in range(0, n, rows):
            q_part, s_part = quantize(w[i:i + rows], block)
            q[i:i + rows], scale[i // block[0]:i // block[0] + s_part.shape[0]] = q_part, s_part
        return q, scale
    sn, sk = scale_shape((n, k), block)
    padded = torch.zeros(sn * block[0], sk * block[1], dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(sn, block[0], sk, block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:n, :k].to(FP8)
    return q.contiguous(), scale
