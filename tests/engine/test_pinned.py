"""pinned_bytes: exactly the bytes asked for, page-locked in place (torch's pinned allocator would round the block up
to a power of two), unregistered when freed, and torch's allocator where registration is refused. The CUDA runtime
is a stand-in here; on a GPU the test at the end uses the real one."""
from __future__ import annotations

import gc

import pytest
import torch

from hybrid.placement.pinned import PAGE, pinned_bytes


class FakeRuntime:
    def __init__(self, rc=0):
        self.rc, self.registered, self.unregistered = rc, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_exact_page_aligned_registration_ended_when_the_memory_goes():
    rt = FakeRuntime()
    n = 3 * PAGE + 123
    t = pinned_bytes(n, rt, is_pinned=lambda _: True)
    assert t.dtype == torch.uint8 and t.numel() == n and t.data_ptr() % PAGE == 0
    assert rt.registered == [(t.data_ptr(), n, 0)], "exactly n bytes registered, not a power of two"
    t[:] = 7  # writable, all of it
    view = t[PAGE:2 * PAGE]  # views (the experts' weights) keep it registered
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert rt.unregistered == []
    del view
    gc.collect()
    assert rt.unregistered == [ptr]


@pytest.fixture
def asked(monkeypatch) -> list:
    """torch's pinned allocator (it needs CUDA) stood in for: the pin_memory flags it was called with."""
    asked, real_empty = [], torch.empty

    def empty(*shape, pin_memory=False, **kw):
        asked.append(pin_memory)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    return asked


@pytest.mark.parametrize("rc, seen_pinned", [(2, True), (0, False)])
def test_refused_registration_falls_back_to_the_pinned_allocator_with_a_warning(asked, rc, seen_pinned):
    rt = FakeRuntime(rc)
    with pytest.warns(UserWarning, match=r"page-locking 0\.00 GB in place failed.*rounds the block up"):
        t = pinned_bytes(5000, rt, is_pinned=lambda _: seen_pinned)
    assert t.numel() == 5000 and asked == [True]
    assert rt.unregistered == ([] if rc else [rt.registered[0][0]]), "a registration not kept is ended at once"


def test_a_binding_that_raises_is_a_refusal(asked):
    class Broken(FakeRuntime):
        def cudaHostRegister(self, ptr, size, flags):
            raise RuntimeError("no driver")

    with pytest.warns(UserWarning, match="RuntimeError: no driver"):
        assert pinned_bytes(100, Broken()).numel() == 100
    assert asked == [True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_bytes_are_pinned_and_copy_asynchronously():
    n = (1 << 20) + 4096 * 3  # not a power of two
    t = pinned_bytes(n)
    assert t.is_pinned() and t.numel() == n
    t.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
