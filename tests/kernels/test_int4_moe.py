"""hybrid.kernels.moe.CpuMoE over packed INT4 experts (int32 words, bf16 group scales) against the MoE computed in
float64 from the same weights, for every kernel variant this CPU has: the reference and the rigorous per-element
bound of tests/kernels/test_moe.py (fp32 accumulation, the bf16 rounding of the down projection's input)."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.moe import CpuMoE
from tests.kernels.common import bf16, rng_for, seed_note
from tests.kernels.test_int4_gemm import int4_weights
from tests.kernels.test_moe import E, TOKENS, check, pool_nodes, routing, routing_with_hot  # noqa: F401 (fixture)

VARIANTS = dispatch.available()
DIMS = [(200, 96), (196, 100), (256, 72)]  # (D, I): ragged groups (D % 32, I % 32), ragged words (196, 100)


@functools.lru_cache(maxsize=None)
def experts(D: int, I: int):
    """E experts' (gate, up, down) packed weights and scales as the op takes them, and their float64 dense forms."""
    rng = rng_for("int4-experts", D, I)
    out = {"w": ([], [], []), "s": ([], [], []), "dense": ([], [], [])}
    for _ in range(E):
        for j, (n, k) in enumerate([(I, D), (I, D), (D, I)]):
            w, s, w64 = int4_weights(rng, n, k, 1 / math.sqrt(k))
            out["w"][j].append(w), out["s"][j].append(s), out["dense"][j].append(w64)
    return out


@functools.lru_cache(maxsize=None)
def op_for(D: int, I: int, variant: str) -> CpuMoE:
    ex = experts(D, I)
    return CpuMoE(*ex["w"], *ex["s"], kernel=variant)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("D,I", DIMS, ids=[f"D{d}-I{i}" for d, i in DIMS])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(variant, D, I, T, pool_nodes):
    rng = rng_for("int4-moe", variant, D, I, T)
    x = torch.from_numpy(rng.standard_normal((T, D)).astype("float32"))
    ids, w = routing(rng, T)
    out = torch.full((T, D), float("nan"))
    op = op_for(D, I, variant).twin() if pool_nodes else op_for(D, I, variant)
    op.nodes = pool_nodes or op.nodes
    assert op(x, ids, w, out) is out
    check(out, x, ids, w, experts(D, I)["dense"], variant, "int4")


@pytest.mark.parametrize("variant", VARIANTS)
def test_hot_expert_and_bf16_out(variant, pool_nodes):
    """One expert in every token's top-k (130 rows), the others a few each; the output in bf16; on a plain pool and
    on two simulated NUMA nodes."""
    D, I = DIMS[0]
    rng = rng_for("int4-moe-hot", variant)
    x = bf16(rng, (130, D))
    ids, w, _ = routing_with_hot(rng, 130)
    out = torch.full((130, D), float("nan"), dtype=torch.bfloat16)
    op = op_for(D, I, variant).twin()
    op.nodes = pool_nodes or op.nodes
    op(x, ids, w, out)
    check(out, x, ids, w, experts(D, I)["dense"], variant, "int4 hot")


@pytest.mark.parametrize("variant", VARIANTS)
def test_submit_wait_equals_call(variant, pool_nodes):
    D, I = DIMS[1]
    op = op_for(D, I, variant).twin() if pool_nodes else op_for(D, I, variant)
    op.nodes = pool_nodes or op.nodes
    for T in (1, 16):
        rng = rng_for("int4-moe-async", variant, T)
        x, (ids, w) = bf16(rng, (T, D)), routing(rng, T)
        called = op(x, ids, w)
        pending = op.submit(x, ids, w)
        assert op.wait() is pending and torch.equal(pending, called), f"{variant} T={T}; {seed_note()}"


def test_int4_experts_need_bf16_group_scales():
    ex = experts(*DIMS[0])
    with pytest.raises(ValueError, match=r"gate_scale\[0\]: dtype float32"):
        CpuMoE(*ex["w"], [s.float() for s in ex["s"][0]], *ex["s"][1:])
    with pytest.raises(ValueError, match="one scale per weight"):
        CpuMoE(*ex["w"])
