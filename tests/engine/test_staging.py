"""The hand-off buffers between the GPU and the CPU experts (hybrid/engine/staging.py): the CPU experts' output
read in place from pinned memory (policy.decode.mapped_outputs) against the copy back."""
from __future__ import annotations

import pytest
import torch

from hybrid.placement.staging import Staging, mapped, read_in_place

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
