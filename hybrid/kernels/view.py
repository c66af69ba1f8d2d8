"""Hand a torch tensor to the native module: address, dtype, shape, strides. The C++ side checks them all."""
from __future__ import annotations

import torch

from hybrid import _native


def view(t: torch.Tensor) -> "_native.View":
    if t.device.type != "cpu":
        raise ValueError(f"CPU kernels take CPU tensors, got one on {t.device}")
    return _native.View(t.data_ptr(), str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()))
