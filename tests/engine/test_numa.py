"""NUMA through the engine (docs/design/numa.md) on this one-node machine: a simulated topology (policy.cpu.
numa_simulated=2: its CPUs in two groups as nodes, 4 pool threads) serves the same greedy tokens as one pool, each
layer's experts split by bytes and run on their own group's threads; binding experts to a node (node 0, the one this
machine has) moves their pages without a copy, in place or in an arena bound before it is page-locked."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from hybrid.config.compose import compose, to_settings
from hybrid.engine.build import build
from hybrid.engine.requests import SamplingParams
from hybrid.kernels import numa as numa_calls
from hybrid.kernels import thread_pool
from hybrid.placement import numa
from hybrid.placement.passes import cpu_experts, experts_to_cpu_kernels, pin_experts
from hybrid.placement.pinned import pinned_bytes
from hybrid.plan.plan import CpuPlan
from hybrid.prefill.ring import expert_tensors
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
ONE_NODE = CpuPlan(threads=2, kernel="auto", moe_backend="native", gemm_tile_tokens=64, amx_min_tokens=4,
                   batch_invariant=False, deferred_experts=0, lm_head="bf16", amx_overlap=True, numa=True,
                   numa_nodes=((0,),), numa_threads=(2,), numa_split=(1.0,))


def _engine(*knobs):
    s = to_settings(compose(["+hw=cpu_only", "policy.cpu.threads=4", *knobs]))
    return build(s, s.hw, progress=False)


def _tokens(engine) -> list[list[int]]:
    return [o.output_ids for o in engine.generate(PROMPTS, SamplingParams(16, ignore_eos=True))]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPU groups need two CPUs")
def test_simulated_nodes_serve_the_same_greedy_tokens_each_expert_on_its_group():
    try:
        want = _tokens(_engine())
        engine = _engine("policy.cpu.numa_simulated=2")
        c = engine.plan.cpu
        assert (c.numa, c.numa_simulated, c.numa_threads) == (True, 2, (2, 2))
        assert thread_pool.groups() == [list(n) for n in c.numa_nodes]
        layers = cpu_experts(engine.model)
        n = len(layers[0].host_experts)
        assert all(layer.nodes == [0] * (n // 2) + [1] * (n - n // 2) for layer in layers)
        for layer in layers:
            layer.op.trace()
        assert _tokens(engine) == want
        for layer in layers:  # the last step's call of each layer
            tasks = layer.op.take_trace()
            assert tasks and all(group == layer.nodes[e] for e, _, _, _, group, _, _ in tasks), tasks
            assert all(cpu in c.numa_nodes[group] for *_, group, worker, cpu in tasks if worker >= 0)
            assert sum(layer.op.node_bytes) > 0
    finally:
        thread_pool.set_groups([], [])


@pytest.fixture
def model(tiny_dir):
    m = load_model(Checkpoint(tiny_dir), torch.bfloat16, progress=False)
    experts_to_cpu_kernels(m)
    return m


def _addresses(model) -> list[list[int]]:
    """Each layer's expert tensors' addresses, and the op's own view of them."""
    return [[t.data_ptr() for expert in layer.host_experts for _, t in expert_tensors(expert)]
            + [t.data_ptr() for ts in layer.op._keep for t in ts] for layer in cpu_experts(model)]


def _bound_or_skip(rc: int) -> None:
    if rc in (errno.ENOSYS, errno.EPERM):
        pytest.skip(f"NUMA calls refused here: {numa_calls.why(rc)}")
    assert rc == 0, numa_calls.why(rc)


def _rss() -> int:
    """This process's resident bytes (/proc/self/status VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_experts_bound_in_place_move_no_byte(model):
    """The checkpoint's mapped pages bound where they are: every address the same, the pages on the node, and the
    process's resident memory grown by far less than the experts' bytes (a second copy would add all of them)."""
    before = _addresses(model)
    tensors = [t for layer in cpu_experts(model) for e in layer.host_experts for _, t in expert_tensors(e)]
    expert_bytes = sum(t.nbytes for t in tensors)
    for t in tensors:  # every page resident before the count
        t.view(torch.uint8).max()
    rss = _rss()
    assert numa.split(model, ONE_NODE)
    assert all(layer.nodes == [0] * len(layer.host_experts) for layer in cpu_experts(model))
    _bound_or_skip(numa.bind_experts(model))
    assert _addresses(model) == before, "binding copied an expert"
    assert _rss() - rss < expert_bytes / 4, f"resident memory grew {(_rss() - rss) / 1e6:.2f} MB on binding"
    assert numa.on_own_node(model) == 1.0
    assert "100% of their sampled pages on their own node" in numa.describe(model, ONE_NODE)


def test_an_arena_is_bound_before_it_is_filled_and_holds_the_one_copy(model):
    numa.split(model, ONE_NODE)
    seen = []

    def prepare(layer, arena):
        seen.append(arena.data_ptr())
        _bound_or_skip(numa.bind_arena(layer, arena))
    total = pin_experts(model, pin=False, prepare=prepare)
    layers = cpu_experts(model)
    assert seen == [layer.arena.data_ptr() for layer in layers] and total == sum(a.arena.numel() for a in layers)
    for layer, addresses in zip(layers, _addresses(model)):
        lo, hi = layer.arena.data_ptr(), layer.arena.data_ptr() + layer.arena.numel()
        assert all(lo <= a < hi for a in addresses), "an expert outside its layer's arena: a second copy"
        assert layer.op.nodes == layer.nodes
    assert numa.on_own_node(model) == 1.0


class _Runtime:
    def __init__(self, order):
        self.order = order

    def cudaHostRegister(self, ptr, size, flags):
        self.order.append("locked")
        return 0

    def cudaHostUnregister(self, ptr):
        return 0


def test_pinned_arenas_are_bound_before_they_are_page_locked():
    order = []
    pinned_bytes(1 << 16, _Runtime(order), is_pinned=lambda _: True, before_lock=lambda t: order.append("bound"))
    assert order == ["bound", "locked"]


def test_expert_runs_follow_the_split():
    assert numa.expert_nodes(256, (0.5, 0.5)) == [0] * 128 + [1] * 128
    assert numa.expert_nodes(7, (0.5, 0.5)) == [0] * 4 + [1] * 3
    assert numa.expert_nodes(10, (0.75, 0.25)) == [0] * 8 + [1] * 2
    assert numa.expert_nodes(3, (1 / 3, 1 / 3, 1 / 3)) == [0, 1, 2]
    assert numa.runs([0, 0, 1, 1, 1, 0]) == [(0, 0, 2), (1, 2, 5), (0, 5, 6)]
