"""The MoE op on a pool in NUMA node groups (docs/design/numa.md), on a simulated topology: this machine's CPUs split
into two groups treated as nodes, more pool threads than cores. The same bits as on a plain pool whatever the
node of each expert, the pool's width and the call path; each expert's tasks run on its own group's threads (the
op's task trace), a group without threads in a call hands its experts to one with; the bytes each group read are
its experts' bytes; the weights are read where they lie (no copy). Also: the pool's seats, memory binding through
mbind, and one group's read roof from one node's memory."""
from __future__ import annotations

import errno

import pytest
import torch

from hybrid.kernels import membw, numa, thread_pool
from hybrid.kernels.moe import CpuMoE
from tests.kernels.common import seed_note
from tests.kernels.test_int4_moe import experts as int4_experts
from tests.kernels.test_moe import (CONTIGUOUS, CPUS, DIMS, HALVES, E, VARIANTS, WTYPES, _inputs, experts, op_for,
                                    two_nodes as on_two_nodes)

pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="two CPU groups need two CPUs")
INTERLEAVED = [e % 2 for e in range(E)]


@pytest.fixture
def two_nodes():
    """The pool as two simulated nodes of 2 threads each (4 threads on this machine's CPUs); plain again after."""
    with on_two_nodes():
        yield


def _plain(op: CpuMoE, x, ids, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The call and the submit path on a plain pool of 4 threads."""
    before = thread_pool.threads()
    thread_pool.set_threads(4)
    try:
        called = op(x, ids, w).clone()
        op.submit(x, ids, w)
        return called, op.wait().clone()
    finally:
        thread_pool.set_threads(before)


def test_seats_interleave_the_groups_and_narrowing_keeps_their_shares(two_nodes):
    assert thread_pool.groups() == HALVES
    seats = thread_pool.seats()
    assert [g for g, _ in seats] == [0, 1, 0, 1]
    assert all(cpu in HALVES[g] for g, cpu in seats)
    thread_pool.set_threads(3)
    assert [g for g, _ in thread_pool.seats()] == [0, 1, 0]
    thread_pool.set_threads(4)
    thread_pool.set_groups(HALVES, [3, 1])
    assert [g for g, _ in thread_pool.seats()] == [0, 1, 0, 0]


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_node_groups_give_the_same_bits(variant, wtype, two_nodes):
    """Per-node queues change who computes an expert, never its numbers: the sums over a token's experts are taken
    in k order whichever group finished last."""
    D, I = DIMS[1]
    op = op_for(wtype, D, I, variant)
    for T in (1, 4, 64):
        x, ids, w = _inputs((variant, wtype, "numa", T), T, D)
        want = _plain(op, x, ids, w)
        for nodes in (CONTIGUOUS, INTERLEAVED, [1] * E):
            op.nodes = nodes
            for width in (4, 3, 2, 1):
                thread_pool.set_threads(width)
                got = op(x, ids, w)
                assert torch.equal(got, want[0]), f"{variant} {wtype} T={T} width {width}: call; {seed_note()}"
                op.submit(x, ids, w)
                got = op.wait()
                assert torch.equal(got, want[1]), f"{variant} {wtype} T={T} width {width}: submit; {seed_note()}"
            thread_pool.set_threads(4)
        op.nodes = [0] * E


def test_each_expert_runs_on_its_own_groups_threads(two_nodes):
    D, I = DIMS[1]
    op = CpuMoE(*experts("fp8", D, I)["w"], *experts("fp8", D, I)["s"], nodes=CONTIGUOUS)
    op.trace()
    x, ids, w = _inputs(("numa-trace",), 64, D)
    for how in ("call", "submit"):
        if how == "call":
            op(x, ids, w)
        else:
            op.submit(x, ids, w)
            op.wait()
        tasks = op.take_trace()
        assert {e for e, *_ in tasks} == set(ids.unique().tolist())
        assert {(e, st) for e, st, *_ in tasks} == {(e, st) for e in ids.unique().tolist() for st in (0, 1)}
        assert all(group == CONTIGUOUS[e] for e, _, _, _, group, _, _ in tasks), tasks
        workers = [(group, cpu) for *_, group, worker, cpu in tasks if worker >= 0]
        assert workers and all(cpu in HALVES[group] for group, cpu in workers), workers  # pinned to their node
        # a call's caller may take its node's tasks before that node's workers wake: both groups' workers only when
        # the workers do everything (submit)
        assert how == "call" or {group for group, _ in workers} == {0, 1}
        assert how == "call" or all(worker >= 0 for *_, worker, _ in tasks), "submit: the workers alone"


def test_a_group_without_threads_in_a_call_hands_its_experts_on(two_nodes):
    """Narrowed to 2 (the caller and one worker of group 1), submit's workers are group 1's alone: every expert's
    tasks go to it, the result unchanged."""
    D, I = DIMS[1]
    op = op_for("fp8", D, I, VARIANTS[0]).twin()
    op.nodes = CONTIGUOUS
    op.trace()
    x, ids, w = _inputs(("numa-handoff",), 16, D)
    want = _plain(op, x, ids, w)
    thread_pool.set_threads(2)
    op.submit(x, ids, w)
    assert torch.equal(op.wait(), want[1])
    assert {group for *_, group, _, _ in op.take_trace()} == {1}
    assert op.node_bytes[0] == 0 and op.node_bytes[1] > 0


@pytest.mark.parametrize("wtype", WTYPES + ["int4"])
def test_each_group_reads_its_experts_bytes(wtype, two_nodes):
    """node_bytes: each group's expert bytes read in the call: every used expert's gate, up and down weights once
    (and their scales: INT4's group scales, FP8's block scales of the rows read), on its node's group."""
    D, I = DIMS[1]
    ex = int4_experts(200, 96) if wtype == "int4" else experts(wtype, D, I)
    D = 200 if wtype == "int4" else D
    op = CpuMoE(*ex["w"], *ex["s"], nodes=INTERLEAVED)
    x, ids, w = _inputs(("numa-bytes", wtype), 16, D)
    op(x, ids, w)
    want = [0, 0]
    for e in ids.unique().tolist():
        tensors = [ex["w"][j][e] for j in range(3)] + ([ex["s"][j][e] for j in range(3)] if wtype != "bf16" else [])
        want[INTERLEAVED[e]] += sum(t.numel() * t.element_size() for t in tensors)
    got = op.node_bytes
    if wtype == "fp8":  # a scale row shared by two tasks' rows counts in each: a little more, never less
        assert all(w <= g <= 1.05 * w for g, w in zip(got, want)), (got, want)
    else:
        assert got == want


def test_the_op_reads_the_weights_where_they_lie():
    """No second copy: the op's weights are the tensors given (their addresses), whatever the nodes say."""
    D, I = DIMS[0]
    ex = experts("fp8", D, I)
    op = CpuMoE(*ex["w"], *ex["s"], nodes=INTERLEAVED)
    assert all(a is b for a, b in zip(op._keep[0], ex["w"][0]))
    with pytest.raises(ValueError, match="one per expert"):
        op.nodes = [0]
    with pytest.raises(ValueError, match=">= 0"):
        op.nodes = [-1] * E


def test_memory_binds_to_this_machines_node_and_not_to_a_missing_one():
    """mbind through the syscall: node 0 holds a buffer's pages after binding (where the calls are allowed here), a
    node this machine lacks is refused with EINVAL."""
    t = torch.ones(1 << 20, dtype=torch.uint8)
    rc = numa.bind_tensor(t, 0)
    if rc in (errno.ENOSYS, errno.EPERM):
        pytest.skip(f"NUMA calls refused here: {numa.why(rc)}")
    assert rc == 0
    assert numa.where(t.data_ptr(), t.numel(), 16) == {0: 1.0}
    assert numa.bind_tensor(t, 1000) == errno.EINVAL
    assert torch.equal(t, torch.ones_like(t)), "binding changed the contents"


def test_one_groups_read_roof_from_one_nodes_memory(two_nodes):
    for group in (0, 1):
        gbs, share = membw.read_roof_node(group, 0, gigabytes=0.064, passes=2, bind=group == 0)
        assert gbs > 0 and (share == -1 or share == 1.0), (group, gbs, share)
    with pytest.raises(ValueError, match="group 2"):
        membw.read_roof_node(2, 0, gigabytes=0.064)
