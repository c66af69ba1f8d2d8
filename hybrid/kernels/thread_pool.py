"""The native kernels' thread pool (csrc/thread_pool.cpp): pinned workers, sized from `policy.cpu.threads`; in
node groups under NUMA (`policy.cpu.numa`): each node's threads pinned to its CPUs (docs/design/numa.md)."""
from __future__ import annotations

from typing import Sequence

from hybrid import _native


def set_threads(n: int) -> None:
    """0 = every CPU this process may run on. On a pool in node groups, narrows or widens it keeping each group's
    share (up to the threads it has; past them, a plain pool)."""
    _native.set_num_threads(n)


def threads() -> int:
    return _native.num_threads()


def set_groups(cpus: Sequence[Sequence[int]], threads_per_group: Sequence[int]) -> None:
    """The pool in node groups: threads_per_group[g] threads pinned to the CPUs cpus[g] (the caller counted in the
    group it runs on); no groups: a plain pool of as many threads as it had."""
    _native.set_thread_groups([list(c) for c in cpus], list(threads_per_group))


def groups() -> list[list[int]]:
    """Each node group's CPUs; [] for a plain pool."""
    return _native.thread_groups()


def seats() -> list[tuple[int, int]]:
    """(group, cpu) of each active participant: the caller's seat first, then each worker's."""
    return _native.thread_seats()
