"""Page-locked host memory of exactly the size asked for.

torch's pinned allocator (`pin_memory=True`, the CUDA caching host allocator) rounds every block up to the next
power of two, and page-locked memory is committed in full: a DeepSeek-V3 layer's routed-expert arena of 11.3 GB
takes a 16 GiB (17.2 GB) block — the full model's 58 layers 996 GB of RAM for 654 GB of experts, Kimi-K2's 16.9 GB
layers 32 GiB each (2x). Large arenas are therefore allocated as ordinary memory and page-locked in place
(cudaHostRegister); the registration ends (cudaHostUnregister) when the memory is freed. Where registration is
refused, the caching allocator's block is used after all, with a warning.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import warnings
import weakref
from typing import Callable, Optional

import numpy as np
import torch

PAGE = 4096
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def trim_heap() -> bool:
    """Freed heap memory handed back to the OS now (glibc's malloc_trim). Tensors of a few MB are carved from the
    heap, whose free pages glibc keeps; a model whose weights are copied into arenas layer by layer (pin_experts)
    would otherwise hold its old copies' pages beside the arenas: twice the experts' bytes at the peak (a model
    generated in memory). Returns whether anything was handed back; False where the C library has no malloc_trim."""
    trim = getattr(_LIBC, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def _code(rc) -> int:
    """cudaError_t as an int, whichever way this torch's cudart binding returns it."""
    rc = rc[0] if isinstance(rc, tuple) else rc
    return int(getattr(rc, "value", rc))


def pinned_bytes(nbytes: int, cudart=None, is_pinned=torch.Tensor.is_pinned,
                 before_lock: Optional[Callable[[torch.Tensor], object]] = None) -> torch.Tensor:
    """A uint8 tensor of `nbytes` page-locked host bytes (uninitialised), page-aligned. `cudart`: the CUDA runtime
    binding (default torch.cuda.cudart()) and `is_pinned`, torch's view of it: tests pass stand-ins.
    `before_lock(t)`: called on the memory before it is page-locked (and its pages committed): NUMA binding."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    cudart = cudart or torch.cuda.cudart()
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)  # committed page by page as it is registered
    skip = -raw.ctypes.data % PAGE
    t = torch.from_numpy(raw[skip:skip + nbytes])  # holds `raw` (through the view) as long as its storage lives
    ptr = t.data_ptr()
    if before_lock is not None:
        before_lock(t)
    try:
        rc = page_lock(t, cudart)
    except Exception as e:  # noqa: BLE001 - a binding that fails is a refusal like any other
        rc, why = -1, f"{type(e).__name__}: {e}"
    else:
        why = f"cudaError {rc}"
    if rc == 0 and is_pinned(t):
        weakref.finalize(raw, _unregister, cudart, ptr)
        return t
    if rc == 0:  # registered, but torch would not copy from it asynchronously: not worth keeping
        _unregister(cudart, ptr)
        why = "registered memory not seen as pinned by torch"
    del t, raw
    warnings.warn(f"page-locking {nbytes / 1e9:.2f} GB in place failed ({why}): using torch's pinned allocator, "
                  f"which rounds the block up to {_pow2(nbytes) / 1e9:.2f} GB")
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def page_lock(t: torch.Tensor, cudart=None) -> int:
    """t's memory page-locked in place (cudaHostRegister, no copy): the cudaError code, 0 when locked. It stays
    locked until cudaHostUnregister (which freeing the memory does not do)."""
    cudart = cudart or torch.cuda.cudart()
    return _code(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))


def _unregister(cudart, ptr: int) -> None:
    try:
        cudart.cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at exit the runtime may be gone already
        pass


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
