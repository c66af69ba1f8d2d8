"""The memory read roof, measured (csrc/membw.cpp): every kernel thread streams its share of a buffer far larger
than the caches, as one or several sequential streams; the best of several passes, in GB/s. CPUs differ in how
many streams per core it takes to saturate memory, so `calibrate` picks the count once per run. Under NUMA,
`read_roof_node` measures one node's threads reading memory on one node (its own: local; another: remote)."""
from __future__ import annotations

from hybrid import _native

STREAM_COUNTS = (1, 2, 4, 8, 16)


def read_roof(gigabytes: float = 1.0, passes: int = 5, streams: int = 4) -> float:
    return _native.read_bandwidth(int(gigabytes * 1e9), passes, streams)


def calibrate(gigabytes: float = 1.0) -> tuple[int, dict[int, float]]:
    """The stream count with the highest reading, and every reading."""
    readings = {s: read_roof(gigabytes, 3, s) for s in STREAM_COUNTS}
    return max(readings, key=readings.get), readings


def read_roof_node(group: int, node: int, gigabytes: float = 1.0, passes: int = 5, streams: int = 4,
                   bind: bool = True) -> tuple[float, float]:
    """The workers of pool group `group` (thread_pool.set_groups) reading a buffer on `node`: bound there when
    `bind`, else first touched by that node's group (a simulated node: the memory stays where it lands). Returns
    (GB/s, the share of the buffer's sampled pages on `node`; -1 where that cannot be read)."""
    return _native.read_bandwidth_node(int(gigabytes * 1e9), passes, streams, group, node, bind)
