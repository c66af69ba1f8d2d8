"""Memory on NUMA nodes (csrc/numa.cpp: mbind and move_pages called directly, no libnuma): bind a range's pages to a
node, and read back where a range's pages lie."""
from __future__ import annotations

import errno
import os
from collections import Counter

import torch

from hybrid import _native


def bind(addr: int, nbytes: int, node: int) -> int:
    """The whole pages inside [addr, addr + nbytes) bound to `node`, those already touched moved there; 0, or the
    errno of the refusal (ENOSYS/EPERM: the calls are not allowed here; EINVAL: no such node)."""
    return _native.bind_memory(addr, nbytes, node)


def bind_tensor(t: torch.Tensor, node: int) -> int:
    return bind(t.data_ptr(), t.numel() * t.element_size(), node)


def page_nodes(addr: int, nbytes: int, samples: int = 64) -> list[int]:
    """The node of `samples` pages spread over the range: a node, or -errno (-ENOENT: not touched yet)."""
    return _native.page_nodes(addr, nbytes, samples)


def where(addr: int, nbytes: int, samples: int = 64) -> dict[int, float]:
    """The share of the range's sampled pages on each node ({} where the pages' nodes cannot be read here)."""
    nodes = [n for n in page_nodes(addr, nbytes, samples) if n >= 0]
    return {n: c / len(nodes) for n, c in sorted(Counter(nodes).items())} if nodes else {}


def why(code: int) -> str:
    """An errno of bind as words."""
    return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
