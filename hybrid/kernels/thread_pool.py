"""The native kernels' thread pool (csrc/thread_pool.cpp): pinned workers, sized from `policy.cpu.threads`."""
from hybrid import _native


def set_threads(n: int) -> None:
    """0 = every CPU this process may run on."""
    _native.set_num_threads(n)


def threads() -> int:
    return _native.num_threads()
