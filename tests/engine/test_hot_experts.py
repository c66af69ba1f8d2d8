"""Hot experts resident on the compute device (policy.gpu.experts_per_layer): the device-side logic runs here on the
CPU stand-in, with the staged hand-off forced on; the engine's refusal without a GPU."""
from __future__ import annotations


import pytest
import torch

from hybrid.config.compose import compose, to_settings
from hybrid.engine.build import build
from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import SamplingParams
from hybrid.placement.hot_experts import HotExperts
from hybrid.placement.passes import cpu_experts, experts_to_cpu_kernels, hot_experts_to_device
from hybrid.engine.profile import TimedExperts
from hybrid.placement.staging import Staging
from hybrid.errors import ConfigError
from hybrid.model.moe import MoE
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model

CPU = torch.device("cpu")
ATOL, RTOL = 0.03, 0.02  # BF16 activations into the CPU kernels vs the resident experts' FP32 path


def _model(tiny_dir, n_hot: int = 0):
    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(m, staging=Staging(256, 4, stage_on_cpu=True))
    hot = hot_experts_to_device(m, n_hot, CPU) if n_hot else []
    assert [layer.hot for layer in cpu_experts(m)] == (hot or [None, None])
    for layer, h in zip(cpu_experts(m), hot):  # out of the module tree: no checkpoint weights, not moved with it
        assert h.host_experts is layer.host_experts and not list(layer.children()) and not list(h.children())
        assert not set(map(id, h.buffers())) & set(map(id, m.buffers()))
    return m, hot


def test_routing_counts_pick_the_hottest_and_slots_stay_put(tiny_dir):
    _, hot = _model(tiny_dir, n_hot=3)
    h = hot[0]
    assert h.refresh() == [-1, -1, -1], "no routing seen yet: no expert is hot"
    h.observe(torch.tensor([[5, 7, 2, 9], [5, 7, 2, 0], [5, 3, 4, 6]]))  # 5: 3 picks, 7 and 2: 2, the rest 1
    first = h.refresh()
    assert sorted(first) == [2, 5, 7]
    for j, e in enumerate(first):
        assert h.slot_of[e] == j
        assert torch.equal(h.gate_proj_w[j], h.host_experts[e].gate_proj.weight)
        assert torch.equal(h.down_proj_s[j], h.host_experts[e].down_proj.weight_scale_inv)
    assert int((h.slot_of >= 0).sum()) == 3
    # the traffic moves: decayed counts (5: 1.5, 7 and 2: 1) let 11 and 12 in; 5 keeps its slot
    h.observe(torch.tensor([[11, 12, 5, 13]] * 4 + [[11, 12, 0, 1]]))
    after = h.refresh()
    assert sorted(after) == [5, 11, 12] and after.index(5) == first.index(5)
    assert int((h.slot_of >= 0).sum()) == 3 and all(h.slot_of[e] == j for j, e in enumerate(after))
    buffers = h.gate_proj_w.data_ptr()
    h.reset()  # a rebuilt engine's start: cold, the slot buffers where they were
    assert h.resident == [-1, -1, -1] and int((h.slot_of >= 0).sum()) == 0 and not h.counts.any()
    assert h.gate_proj_w.data_ptr() == buffers and h.refresh() == [-1, -1, -1]


def test_resident_experts_take_their_share_off_the_cpu_and_the_sum_is_unchanged(tiny_dir):
    m, hot = _model(tiny_dir, n_hot=4)
    moe = next(x for x in m.modules() if isinstance(x, MoE))
    layer = moe.experts
    x = torch.randn(6, 256)
    w, ids = moe.gate(x)
    want = layer(x, w, ids)  # nothing resident yet: all on the CPU
    layer.hot.observe(ids)
    resident = layer.hot.refresh()
    picked = int(torch.isin(ids, torch.tensor(resident)).sum())
    assert picked > 0
    timed = TimedExperts(layer)
    got = timed(x, w, ids)
    cpu_ids = layer.hot.route(w, ids)[1]
    assert int((cpu_ids == -1).sum()) == picked, "resident picks reach the CPU op as -1 (skip)"
    assert timed.experts_read == len(set(ids.flatten().tolist()) - set(resident))
    assert torch.allclose(got, want, atol=ATOL, rtol=RTOL)


def test_greedy_decode_with_resident_experts_follows_the_all_cpu_engine(tiny_dir):
    prompt = torch.randint(2, 320, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    plain, _ = _model(tiny_dir)
    plan = local_plan({"kv.max_batch": 1, "kv.max_context": 64, "decode.batch_cap": 1})
    params = SamplingParams(12, ignore_eos=True)
    want = Engine(plain, plan).generate([prompt], params)[0].output_ids
    m, hot = _model(tiny_dir, n_hot=4)
    engine = Engine(m, plan, after_prefill=lambda: [h.refresh() for h in hot])
    got = engine.generate([prompt], params)[0].output_ids
    assert all(-1 not in h.resident for h in hot), "filled after the prefill"
    assert got[:4] == want[:4]  # the first tokens agree (numerics differ slightly)
    logits_a = plain(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0]
    logits_b = m(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0]
    assert torch.allclose(logits_a, logits_b, atol=ATOL, rtol=RTOL)


def test_engine_refuses_resident_experts_without_a_gpu():
    s = to_settings(compose(["+hw=cpu_only", "policy.gpu.experts_per_layer=2"]))
    with pytest.raises(ConfigError, match=r"policy\.gpu\.experts_per_layer.*without one"):
        build(s, s.hw, progress=False)
    with pytest.raises(ValueError, match="between 1 and the 16"):
        HotExperts(cpu_experts(_model_from_settings())[0].host_experts, 17, CPU)


def _model_from_settings():
    s = to_settings(compose(["+hw=cpu_only"]))
    return build(s, s.hw, progress=False).model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_with_resident_experts_matches_without():
    outputs = []
    for n in (0, 4):
        s = to_settings(compose(["+hw=h200_xeon16", "policy=default",
                                 "policy.adapt_to_hardware=true", "model.dtype=float32",
                                 f"policy.gpu.experts_per_layer={n}"]))
        engine = build(s, s.hw, progress=False)
        outputs.append([engine.generate([list(range(2, 40))], SamplingParams(16))[0].output_ids])
        if n:
            assert all(-1 not in layer.hot.resident for layer in cpu_experts(engine.model))
    assert outputs[0][0][:4] == outputs[1][0][:4]
