"""The batch-invariant MLA decode attention (hybrid/kernels/mla_decode.py) run by Triton's interpreter on the CPU:
against float64, and a sequence's output bit for bit the same whatever its batch mates, its place in the batch and
the KV length the grid reaches (a CUDA graph's bucket). The interpreter runs the kernels' logic (masks, chunk
skipping, the combine's order), not the GPU's arithmetic; the GPU test in tests/engine/test_beside_decode.py holds
the tokens there."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="needs Triton (its interpreter runs the kernels on the CPU)")

CHECK = textwrap.dedent("""
    import torch
    from hybrid.kernels.mla_decode import CHUNK, mla_decode

    g = torch.Generator().manual_seed(0)
    slots, T, C, R, H = 5, 2 * CHUNK + 90, 128, 64, 32
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(slots, T, C, generator=g).to(dtype)
        pe = torch.randn(slots, T, R, generator=g).to(dtype)
        q = torch.randn(4, H, C, generator=g).to(dtype)
        qp = torch.randn(4, H, R, generator=g).to(dtype)
        seq_slots = torch.tensor([3, 0, 4, 1])
        lengths = torch.tensor([CHUNK + 1, 7, 2 * CHUNK + 90, CHUNK])  # one past a chunk, short, full, exactly one
        scale = 0.07
        out = mla_decode(q, qp, kv, pe, seq_slots, lengths, T, scale)
        assert out.shape == (4, H, C) and out.dtype == torch.float32
        for i in range(4):  # against float64 (the inputs as the kernel reads them)
            n, s = int(lengths[i]), int(seq_slots[i])
            k, p = kv[s, :n].double(), pe[s, :n].double()
            scores = (q[i].to(dtype).double() @ k.T + qp[i].double() @ p.T) * scale
            want = torch.softmax(scores, -1) @ k
            err = (out[i].double() - want).abs().max().item() / want.abs().max().item()
            bound = 1e-6 if dtype == torch.float32 else 2e-2  # BF16: the probabilities are rounded to BF16
            assert err < bound, (dtype, i, err)
        for i in range(4):  # alone, at its own reach (the smallest bucket that holds it) and at the cache's whole
            n = int(lengths[i])
            for reach in (n, -(-n // CHUNK) * CHUNK, T):
                alone = mla_decode(q[i:i + 1], qp[i:i + 1], kv, pe, seq_slots[i:i + 1], lengths[i:i + 1],
                                   min(reach, T), scale)
                assert torch.equal(alone[0], out[i]), (dtype, i, reach)
        swapped = mla_decode(q.flip(0), qp.flip(0), kv, pe, seq_slots.flip(0), lengths.flip(0), T, scale)
        assert torch.equal(swapped.flip(0), out), "the batch's order changes nothing"
    # positions past a sequence's length are never read: NaN there changes nothing
    kv[0, 7:] = float("nan")
    again = mla_decode(q[1:2], qp[1:2], kv, pe, seq_slots[1:2], lengths[1:2], T, scale)
    assert torch.isfinite(again).all()
    for bad in (dict(kv_len=0), dict(kv_len=T + 1)):
        try:
            mla_decode(q, qp, kv, pe, seq_slots, lengths, bad["kv_len"], scale)
        except ValueError as e:
            assert "kv_len" in str(e)
        else:
            raise AssertionError(bad)
    try:
        mla_decode(q[:, :20], qp[:, :20], kv, pe, seq_slots, lengths, T, scale)
    except ValueError as e:
        assert "multiple of 16" in str(e)
    else:
        raise AssertionError("20 heads")
    print("ok")
""")


def test_mla_decode_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are defined: a process of its own
    p = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr
