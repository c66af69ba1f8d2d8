"""The memory read roof, measured (csrc/membw.cpp): every kernel thread streams a buffer far larger than the
caches; the best of several passes, in GB/s."""
from hybrid import _native


def read_roof(gigabytes: float = 1.0, passes: int = 5) -> float:
    return _native.read_bandwidth(int(gigabytes * 1e9), passes)
