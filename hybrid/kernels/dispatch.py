"""Which CPU kernel variant runs: `policy.cpu.kernel`, else the HYBRID_CPU_KERNEL environment variable, else the
best the CPU has (amx > avx512_bf16 > avx512 > avx2 > generic; avx512: the avx512_bf16 kernel for AVX-512
F/BW/VL/VBMI CPUs without BF16 instructions, its dot products on FP32 FMAs). Variant amx runs an FP8 GEMM with at least
`policy.cpu.amx_min_tokens` tokens on AMX tiles, smaller ones on the AVX-512 kernel; `amx_emulated` (not a
variant to choose: tests) runs the same tiling with emulated tile operations on any CPU."""
from __future__ import annotations

import os
from typing import Optional

from hybrid import _native

VARIANTS = ("amx", "avx512_bf16", "avx512", "avx2", "generic")
ENV = "HYBRID_CPU_KERNEL"


def kernel_name(requested: Optional[str] = "auto") -> str:
    """The variant to ask for: an explicit request wins, then the environment, then auto (None: as auto)."""
    return requested if requested not in (None, "auto") else os.environ.get(ENV, "auto")


def selected(requested: Optional[str] = "auto") -> str:
    """The variant that runs; a variant this CPU lacks raises ValueError naming the missing features."""
    return _native.selected_isa(kernel_name(requested))


def available() -> list[str]:
    out = []
    for v in VARIANTS:
        try:
            _native.selected_isa(v)
            out.append(v)
        except ValueError:
            pass
    return out
