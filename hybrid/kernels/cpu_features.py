"""What the CPU can run, read once through cpuid/xgetbv in the native module."""
from __future__ import annotations

from functools import lru_cache

from hybrid import _native


@lru_cache(maxsize=None)
def _features() -> tuple[tuple[str, bool], ...]:
    return tuple(sorted(_native.cpu_features().items()))


def cpu_features() -> dict[str, bool]:
    """Each ISA feature the native module knows (cpuid names) and whether the CPU and OS support it."""
    return dict(_features())


@lru_cache(maxsize=None)
def cpu_brand() -> str:
    """The processor brand string from cpuid, or "" where the CPU has none."""
    return _native.cpu_brand()
