"""The memory read roof, measured (csrc/membw.cpp): every kernel thread streams its share of a buffer far larger
than the caches, as one or several sequential streams; the best of several passes, in GB/s. CPUs differ in how
many streams per core it takes to saturate memory, so `calibrate` picks the count once per run."""
from hybrid import _native

STREAM_COUNTS = (1, 2, 4, 8, 16)


def read_roof(gigabytes: float = 1.0, passes: int = 5, streams: int = 4) -> float:
    return _native.read_bandwidth(int(gigabytes * 1e9), passes, streams)


def calibrate(gigabytes: float = 1.0) -> tuple[int, dict[int, float]]:
    """The stream count with the highest reading, and every reading."""
    readings = {s: read_roof(gigabytes, 3, s) for s in STREAM_COUNTS}
    return max(readings, key=readings.get), readings
