"""Where the Triton kernels run: on tensors on a GPU — or, under Triton's interpreter (TRITON_INTERPRET=1 in the
environment when the process starts), on tensors anywhere: the tests run the kernels' logic on the CPU that way."""
from __future__ import annotations

import os
from typing import Union

import torch

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None

INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def runs(where: Union[torch.Tensor, torch.device, str]) -> bool:
    """Whether the Triton kernels run on this tensor (or device)."""
    device = torch.device(getattr(where, "device", where))
    return triton is not None and (device.type == "cuda" or INTERPRETED)
