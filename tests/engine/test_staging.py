"""The hand-off buffers between the GPU and the CPU experts (hybrid/engine/staging.py): the CPU experts' output
read in place from pinned memory (policy.decode.mapped_outputs) against the copy back."""
from __future__ import annotations

import pytest
import torch

from hybrid.engine.staging import Staging, mapped, read_in_place

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory the GPU reads in place)")


def test_unpinned_memory_is_refused_and_the_cpu_path_needs_no_mapping():
    with pytest.raises(ValueError, match="pinned"):
        mapped(torch.zeros(4), torch.device("cpu"))
    s = Staging(8, 2, pin=False, mapped=True)
    assert not s.mapped, "nothing to read in place without pinned buffers"
    out = torch.randn(3, 8)
    assert torch.equal(s.to_device(out, torch.zeros(1, dtype=torch.bfloat16)), out.to(torch.bfloat16))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_outputs_read_in_place_equal_the_copy_back(dtype):
    dev = torch.device("cuda")
    like = torch.zeros(1, dtype=dtype, device=dev)
    ways = {m: Staging(64, 4, pin=True, mapped=m) for m in (False, True)}
    got = {}
    for m, s in ways.items():
        s.reserve(5)
        out_h = s.out(5, fixed=True)
        out_h.copy_(torch.randn(5, 64, generator=torch.Generator().manual_seed(3)))
        got[m] = s.to_device(out_h, like)
    torch.cuda.synchronize()
    assert got[True].device.type == "cuda" and got[True].dtype == dtype and torch.equal(got[True], got[False])


@cuda
def test_a_read_in_place_sees_the_host_write_before_it_and_strides():
    dev = torch.device("cuda")
    host = torch.arange(24, dtype=torch.int64).reshape(4, 6).pin_memory()
    assert torch.equal(read_in_place(host[:, 1:3], dev, torch.int64).cpu(), host[:, 1:3])
    host.fill_(7)
    assert torch.equal(read_in_place(host, dev, torch.float32).cpu(), torch.full((4, 6), 7.0))


class _Event:
    """A stand-in CUDA event: its waits are logged."""

    log: list = []

    def __init__(self):
        self.recorded = False

    def record(self):
        self.recorded = True

    def synchronize(self):
        _Event.log.append(self)


def test_step_inputs_go_through_a_ring_of_slots_reused_only_after_their_read():
    from hybrid.engine.staging import _RowRing

    reads = []

    def reader(host, device, dtype):  # the GPU's read of the slot: a copy at the time it is queued
        reads.append(host.data_ptr())
        return host.to(dtype).clone()

    _Event.log = []
    ring = _RowRing(torch.device("cpu"), slot_elems=12, reader=reader, event=_Event, pin=False)
    tables = [[[i, 10 + i, 2]] if i % 2 else [[i, 20 + i, 0], [i + 1, 30 + i, 1]] for i in range(2 * ring.SLOTS + 3)]
    outs = [ring(t) for t in tables]
    for t, out in zip(tables, outs):
        assert out.dtype == torch.long and out.tolist() == t
    # one slot after another, round the ring: a slot's second write waits for the read after its first one
    assert len(set(reads)) == ring.SLOTS and reads[:ring.SLOTS] == reads[ring.SLOTS:2 * ring.SLOTS]
    assert len(_Event.log) == len(tables) - ring.SLOTS and all(e.recorded for e in _Event.log)
    big = [[1, 2, 3]] * 5  # more than a slot: copied, no slot taken
    assert ring(big).tolist() == big and len(reads) == len(tables)


def test_step_inputs_are_copied_where_nothing_is_read_in_place():
    s = Staging(8, 2, pin=False, mapped=True)
    got = s.rows([[5, 6, 0], [7, 8, 1]], torch.device("cpu"))
    assert got.dtype == torch.long and got.tolist() == [[5, 6, 0], [7, 8, 1]] and s._rows is None


@cuda
def test_step_inputs_read_in_place_equal_the_copy():
    dev = torch.device("cuda")
    s = Staging(64, 4, pin=True, mapped=True)
    tables = [[[i, 100 + i, i % 3]] * (1 + i % 4) for i in range(20)]
    outs = [s.rows(t, dev) for t in tables]
    torch.cuda.synchronize()
    assert s._rows is not None, "a GPU with pinned buffers reads the inputs in place"
    for t, out in zip(tables, outs):
        assert out.device.type == "cuda" and out.dtype == torch.long and out.cpu().tolist() == t
