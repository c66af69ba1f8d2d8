"""Stream-loading prefill of INT4 routed experts (tiny_kimi_int4) on the CPU stand-in device: the pinned arena holds
the packed words and group scales in the ring's slot layout (half the bytes of FP8 + scales), one copy per expert;
the logits equal the plain forward's at the FP8 tests' tolerance, expert by expert and in groups (over ring lengths
and group sizes: tests/prefill/test_slp.py, on this checkpoint too); under Triton's interpreter the same prefill
runs the W4A16 GEMM and the dequantise pass (hybrid/kernels/int4_linear.py)."""
from __future__ import annotations

import torch

from hybrid.bench.bounds import mlp_bytes
from hybrid.placement.passes import cpu_experts, experts_to_cpu_kernels, pin_experts
from hybrid.prefill.ring import expert_tensors, layout
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from tests.kernels.interpreted import run
from tests.prefill.test_slp import BIG, CPU, streaming

N_MOE, N_EXPERTS = 1, 24  # tiny_kimi_int4


def _models(ck, dtype=torch.float32):
    plain = load_model(Checkpoint(ck), dtype, progress=False)  # torch experts: dequantised per call
    hybrid = load_model(Checkpoint(ck), dtype, progress=False)
    experts_to_cpu_kernels(hybrid)
    return plain, hybrid


def test_the_slot_holds_packed_words_and_group_scales_gate_and_up_back_to_back(kimi_int4_dir):
    _, hybrid = _models(kimi_int4_dir)
    expert = cpu_experts(hybrid)[0].host_experts[0]
    names = [name for name, _ in expert_tensors(expert)]
    assert names == ["gate_proj.weight_packed", "up_proj.weight_packed", "gate_proj.weight_scale",
                     "up_proj.weight_scale", "down_proj.weight_packed", "down_proj.weight_scale"]
    fields, slot = layout(expert_tensors(expert))
    d, i = hybrid.args.hidden_size, hybrid.args.moe_intermediate_size
    packed, scales = 3 * d * i // 2, 3 * d * i // 32 * 2  # half a byte per weight; a BF16 scale per 32
    assert packed + scales <= slot < packed + scales + 2 * 256
    gs, us = fields["gate_proj.weight_scale"], fields["up_proj.weight_scale"]
    assert us.offset == gs.offset + i * (d // 32) * 2 and fields["up_proj.weight_packed"].offset == i * d // 2


def test_pinned_int4_experts_stream_in_one_copy_each_at_half_the_fp8_bytes(kimi_int4_dir, monkeypatch):
    plain, hybrid = _models(kimi_int4_dir)
    before = [p.clone() for layer in cpu_experts(hybrid) for p in layer.host_experts.parameters()]
    arena_bytes = pin_experts(hybrid, pin=False)
    layers = cpu_experts(hybrid)
    assert arena_bytes == N_MOE * N_EXPERTS * layers[0].slot_bytes
    after = [p for layer in layers for p in layer.host_experts.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert layers[0].host_experts[0].gate_proj.weight_packed.data_ptr() == layers[0].arena.data_ptr()
    fp8 = mlp_bytes(hybrid.args.hidden_size, hybrid.args.moe_intermediate_size, (128, 128))  # FP8 + block scales
    assert 0.5 * fp8 < layers[0].slot_bytes < 0.6 * fp8
    tokens, pos = torch.randint(2, 380, (1, 24), generator=torch.Generator().manual_seed(5)), torch.arange(24)[None]
    want = plain(tokens, pos)[0]
    assert (hybrid(tokens, pos)[0] - want).abs().max() <= 0.05 * want.abs().max(), "the CPU op reads the arena"
    copies = []
    real = torch.Tensor.copy_

    def counting(self, src, non_blocking=False):
        copies.append(src.numel())
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    with streaming(hybrid, CPU, 3, BIG) as pipe:
        got = hybrid(tokens, pos, experts=pipe.experts)[0]
    monkeypatch.undo()
    assert pipe.fused, "gate and up read as one [2I, D] packed matrix"
    assert (got - want).abs().max() <= 1e-5
    assert copies.count(layers[0].slot_bytes) == N_MOE * N_EXPERTS, "one copy per expert"
    with streaming(hybrid, CPU, N_EXPERTS, BIG, group=8) as pipe:
        got = hybrid(tokens, pos, experts=pipe.experts)[0]
    assert (got - want).abs().max() <= 1e-5 and max(pipe.group_sizes) > 1, "in groups"


def test_interpreted_kernels_stream_the_int4_experts(kimi_int4_dir):
    """Under Triton's interpreter the streamed experts go through the W4A16 GEMM one at a time (float32, on its
    IEEE tile; the BF16 form: tests/kernels/test_triton_interpreted.py), and in groups (BF16) through the dequantise
    pass into the grouped GEMM's buffer; the logits against the plain forward: float32 as above, BF16 within the
    BF16 parity tests' relative bound."""
    run("""
        import sys
        import torch
        from hybrid.kernels import int4_linear as il
        from hybrid.placement.passes import experts_to_cpu_kernels, pin_experts
        from hybrid.prefill.slp import StreamLoader
        from hybrid.weights.checkpoint import Checkpoint
        from hybrid.weights.loader import load_model

        launched = {"mm": 0, "dequant": 0}

        class Counted:
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                launched[self.name] += 1
                return self.kernel[grid]

        il._int4_mm, il._int4_dequant = Counted("mm", il._int4_mm), Counted("dequant", il._int4_dequant)
        tokens = torch.randint(2, 380, (1, 40), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(40)[None]
        for dtype, group in ((torch.float32, 1), (torch.bfloat16, 24)):
            plain, hybrid = (load_model(Checkpoint(sys.argv[1]), dtype, progress=False) for _ in range(2))
            experts_to_cpu_kernels(hybrid)
            pin_experts(hybrid, pin=False)
            want = plain(tokens, pos)[0].float()
            before = dict(launched)
            with StreamLoader().streaming(hybrid, torch.device("cpu"), 24, 1e12, group) as pipe:
                got = hybrid(tokens, pos, experts=pipe.experts)[0].float()
            way = "dequant" if group > 1 else "mm"
            # groups hold the experts loaded by then (up to `group`; fewer while the loader lags on a busy machine)
            biggest = max(pipe.group_sizes)
            assert launched[way] > before[way] and biggest <= group and (group == 1 or biggest > 1), \
                (dtype, group, biggest, launched)
            if dtype == torch.float32:
                assert (got - want).abs().max() <= 1e-5, float((got - want).abs().max())
            else:
                assert (got - want).norm() <= 0.03 * want.norm(), float((got - want).norm() / want.norm())
        print("ok")
    """, str(kimi_int4_dir))
