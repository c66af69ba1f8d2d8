"""hybrid.kernels.decode_attention (MLA decode attention on the CPU) against float64, for every code this CPU runs.

Codes: each variant of dispatch.available() runs the code of its ISA (avx512_bf16, avx2 or generic); each code is
tested once, under the first variant that reaches it.

The cache is paged (pools of N blocks of P positions, a block table [S, M]): the unpaged layout (P = T, one block
per slot, T not a multiple of the chunk) and paged ones (P = 256, 512) whose tables hold shuffled, non-contiguous
block ids, two slots sharing their first block, and -1 where nobody reads.

Error bound, per output (b, h, c): the kernel's weights w_t (softmax of FP32 scores) carry a relative error of at
most 2^-9 (BF16 weights in the avx512_bf16 code; FP32 elsewhere) plus twice the scores' error δ, which a sequential
FP32 sum of the n = C + R terms bounds by n 2^-24 Σ|q k| scale; so |o - ref| <= (2^-8 + 4δ) Σ_t w_t |kv[t, c]|.
Outputs are poisoned with NaN before each call, and the pools are NaN wherever no sequence reads: a position read
that should not be fails the test.
"""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.decode_attention import CHUNK, attention_code, decode_attention, set_schedule
from hybrid.kernels.thread_pool import set_threads, threads
from tests.kernels.common import bf16, record, rel_errors, rng_for, seed_note


def _codes() -> dict[str, str]:
    out: dict[str, str] = {}
    for v in dispatch.available():
        out.setdefault(attention_code(v), v)
    return out


CODES = _codes()
VARIANTS = list(CODES.values())
# (H, C, R): the tiny models', Kimi-K2's, DeepSeek-V3's; and dims off every vector width
DIMS = [(4, 64, 16), (64, 512, 64), (128, 512, 64), (3, 40, 8), (5, 33, 7), (1, 96, 24)]
SCALE = 0.1


def _generator(rng) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(1 << 30)))


def _table(rng, lengths, slots_B, S, P, shared):
    """(block table [S, M] int64, N): each sequence's blocks at shuffled ids out of N (a few spare ones nobody
    reads), -1 past them and in slots nobody reads. `shared`: the second sequence's slot starts with the first's
    first block (a shared prefix block)."""
    need = [-(-n // P) for n in lengths.tolist()]
    M = max(need) + 1
    N = sum(need) + 3
    ids = torch.randperm(N, generator=_generator(rng)).tolist()
    table = torch.full((S, M), -1, dtype=torch.int64)
    for i, (s, k) in enumerate(zip(slots_B.tolist(), need)):
        if shared and i == 1:
            table[s, 0] = table[int(slots_B[0]), 0]
            table[s, 1:k] = torch.tensor(ids[:k - 1], dtype=torch.int64)
            del ids[:k - 1]
        else:
            table[s, :k] = torch.tensor(ids[:k], dtype=torch.int64)
            del ids[:k]
    return table, N


def _where(table, slot, n, P):
    """(block ids, offsets) of a sequence's positions [0, n)."""
    t = torch.arange(n)
    return table[slot, t // P], t % P


def _cache(rng, C, R, lengths, slots_B, S, P=None, shared=False):
    """(kv [N, P, C], pe [N, P, R], table [S, M]): random BF16 rows where sequences read, NaN everywhere else.
    P None: the unpaged layout (P = T, the longest length + 3; table arange(S))."""
    if P is None:
        P, N = int(lengths.max()) + 3, S
        table = torch.arange(S, dtype=torch.int64)[:, None]
    else:
        table, N = _table(rng, lengths, slots_B, S, P, shared)
    kv = torch.full((N, P, C), float("nan"), dtype=torch.bfloat16)
    pe = torch.full((N, P, R), float("nan"), dtype=torch.bfloat16)
    for s, n in zip(slots_B.tolist(), lengths.tolist()):
        blk, off = _where(table, s, n, P)
        kv[blk, off], pe[blk, off] = bf16(rng, (n, C)), bf16(rng, (n, R))
    return kv, pe, table


def _rows(kv, pe, table, slot, n):
    """A sequence's cached rows [n, C], [n, R], gathered through the table."""
    blk, off = _where(table, slot, n, kv.shape[1])
    return kv[blk, off], pe[blk, off]


def _reference(q, qpe, kv, pe, table, slots_B, lengths, scale):
    """(float64 outputs [B, H, C], Σ_t w_t |kv| [B, H, C], the scores' error bound δ [B, H, 1])."""
    outs, mags, deltas = [], [], []
    for b, (s, n) in enumerate(zip(slots_B.tolist(), lengths.tolist())):
        k, p = (x.double() for x in _rows(kv, pe, table, s, n))
        qb, qp = q[b].double(), qpe[b].double()
        w = ((qb @ k.T + qp @ p.T) * scale).softmax(-1)
        terms = (qb.abs() @ k.abs().T + qp.abs() @ p.abs().T) * scale
        outs.append(w @ k)
        mags.append(w @ k.abs())
        deltas.append(terms.amax(-1, keepdim=True) * (k.shape[1] + p.shape[1]) * 2.0 ** -24)
    return torch.stack(outs), torch.stack(mags), torch.stack(deltas)


def run_and_check(variant, H, C, R, lengths, what="", P=None, shared=False, q_std=1.0, scale=SCALE,
                  strided_pe=False):
    lengths = torch.tensor(lengths)
    B = len(lengths)
    rng = rng_for("attn", variant, H, C, R, tuple(lengths.tolist()), what, P, shared)
    slots_B = torch.randperm(B + 2, generator=_generator(rng))[:B]
    kv, pe, table = _cache(rng, C, R, lengths, slots_B, B + 2, P, shared)
    q = bf16(rng, (B, H, C), q_std)
    if strided_pe:  # as MLA passes it: the rope part of the whole query [B, H, N + R]
        qpe = bf16(rng, (B, H, 2 * R + 3), q_std)[:, :, R + 3:]
    else:
        qpe = bf16(rng, (B, H, R), q_std)
    out = torch.full((B, H, C), float("nan"))
    assert decode_attention(q, qpe, kv, pe, table, slots_B, lengths, scale, kernel=variant, out=out) is out
    ref, mag, delta = _reference(q, qpe, kv, pe, table, slots_B, lengths, scale)
    msg = (f"{attention_code(variant)} {what} B={B} H={H} C={C} R={R} P={kv.shape[1]} lengths="
           f"{lengths.tolist()[:8]}; {seed_note()}")
    bad = (~torch.isfinite(out)).nonzero()
    assert bad.numel() == 0, f"{msg}: {bad.shape[0]} outputs not written or not finite, first at {bad[0].tolist()}"
    err = (out.double() - ref).abs()
    bound = mag * (2.0 ** -8 + 4 * delta) + 1e-30
    over = (err > bound).nonzero()
    assert over.numel() == 0, (f"{msg}: {over.shape[0]} outputs over the bound, first at {over[0].tolist()}: "
                               f"err {float(err[tuple(over[0])]):.3e} > {float(bound[tuple(over[0])]):.3e}")
    record("attn", attention_code(variant), "bf16", *rel_errors(out, ref, mag))
    return out, (q, qpe, kv, pe, table, slots_B, lengths)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("H,C,R", DIMS)
def test_dims_and_ragged_chunk_ends(variant, H, C, R):
    """Several sequences of different lengths in one call: 1, around a chunk's end (255-257), a few chunks."""
    run_and_check(variant, H, C, R, [1, 255, 256, 257, 7, 600][: 6 if H < 64 else 4], "ragged")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("P", [256, 512])
@pytest.mark.parametrize("H,C,R", [(4, 64, 16), (16, 512, 64), (3, 40, 8)])
def test_paged_blocks_shuffled_and_shared(variant, H, C, R, P):
    """A paged cache: lengths within one block, at a block's end, one past it, over several blocks; shuffled
    non-contiguous block ids, the first two sequences sharing their first block."""
    run_and_check(variant, H, C, R, [P + 1, 2 * P + 90, 1, P, 255, 3 * P + 257], "paged", P=P, shared=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rope_query_and_peaked_scores(variant):
    """q_pe as a view of the whole query; scores spread wide (a few positions take nearly all the weight)."""
    run_and_check(variant, 16, 512, 64, [300, 33], "strided", strided_pe=True)
    run_and_check(variant, 16, 512, 64, [513, 2], "peaked", q_std=4.0)
    run_and_check(variant, 16, 512, 64, [513, 300], "paged strided", P=256, shared=True, strided_pe=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("P", [None, 512])
def test_long_context_one_sequence_few_heads(variant, P):
    """33K positions (129 chunks, the last one ragged), DeepSeek-V3's latent and rope dims, two heads; in one
    block and in 65 blocks."""
    run_and_check(variant, 2, 512, 64, [33_000], "33K", P=P)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("context", [1, 64, 511, 4096, 16_385, 33_000])
def test_deepseek_heads_at_every_context(variant, context):
    run_and_check(variant, 128, 512, 64, [context, max(1, context // 3)], "sweep", P=256, shared=True)


@pytest.mark.parametrize("schedule", ["split", "heads"])
@pytest.mark.parametrize("H,C,R", [(3, 40, 8), (5, 33, 7)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_either_schedule_at_odd_dims(variant, H, C, R, schedule):
    """Both schedules whatever the pool's size picks (auto takes heads where chunks are few for the threads: a
    16-thread host ran heads here, and a group's scratch must stay aligned for the kernels' aligned loads)."""
    try:
        set_schedule(schedule)
        run_and_check(variant, H, C, R, [1, 255, 256, 257, 7, 600], schedule)
        run_and_check(variant, H, C, R, [1, 255, 256, 257, 7, 600], schedule + " paged", P=256, shared=True)
    finally:
        set_schedule("auto")


def _elsewhere(rng, rows_kv, rows_pe, P):
    """One sequence's rows put in a pool of its own: other physical blocks (shuffled, among spare ones), another
    slot of another table; P None: one block of its own size. Returns the call's arguments after the queries."""
    n = rows_kv.shape[0]
    if P is None:
        P = n + 7
    k = -(-n // P)
    N, S = k + 4, 3
    slot = int(rng.integers(S))
    table = torch.full((S, k + 2), -1, dtype=torch.int64)
    table[slot, :k] = torch.randperm(N, generator=_generator(rng))[:k]
    kv = torch.full((N, P, rows_kv.shape[1]), float("nan"), dtype=torch.bfloat16)
    pe = torch.full((N, P, rows_pe.shape[1]), float("nan"), dtype=torch.bfloat16)
    blk, off = _where(table, slot, n, P)
    kv[blk, off], pe[blk, off] = rows_kv, rows_pe
    return kv, pe, table, torch.tensor([slot]), torch.tensor([n])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("P", [None, 256])
def test_a_sequence_gets_the_same_bits_alone_in_any_batch_layout_schedule_or_pool(variant, P):
    """Batch invariance: a sequence's output alone, its rows in other physical blocks (blocks of 256 or 512, or
    one block), equals its row in a batch of others, under either schedule and with 1 or 2 threads."""
    out, (q, qpe, kv, pe, table, slots_B, lengths) = run_and_check(variant, 8, 512, 64, [700, 1, 300, 40, 256],
                                                                   "batch", P=P, shared=P is not None)
    rng = rng_for("attn alone", variant, P)
    alone_in = []
    for b in range(len(lengths)):
        rows = _rows(kv, pe, table, int(slots_B[b]), int(lengths[b]))
        alone_in.append([_elsewhere(rng, *rows, layout) for layout in (None, 256, 512)])
    before = threads()
    try:
        for schedule in ("split", "heads"):
            for n in (1, 2):
                set_schedule(schedule)
                set_threads(n)
                for b in range(len(lengths)):
                    for kv_, pe_, table_, slot, length in alone_in[b]:
                        alone = decode_attention(q[b:b + 1], qpe[b:b + 1], kv_, pe_, table_, slot, length, SCALE,
                                                 kernel=variant)
                        assert torch.equal(alone[0], out[b]), (
                            f"{attention_code(variant)}: sequence {b} (length {int(lengths[b])}) alone in blocks of "
                            f"{kv_.shape[1]}, {schedule}, {n} threads, differs from its row in the batch; "
                            f"{seed_note()}")
    finally:
        set_schedule("auto")
        set_threads(before)


def _call(P=8, N=4, table=None, slots=(0,), lengths=(1,), kv_dtype=torch.bfloat16, pe_P=None):
    q, qpe = torch.zeros(1, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    kv = torch.zeros(N, P, 64, dtype=kv_dtype)
    pe = torch.zeros(N, pe_P or P, 16, dtype=torch.bfloat16)
    table = torch.tensor([[1, 3], [0, 2]]) if table is None else table
    return decode_attention(q, qpe, kv, pe, table, torch.tensor(slots), torch.tensor(lengths), SCALE)


@pytest.mark.parametrize("bad,match", [
    ({"lengths": [0]}, "lengths"),
    ({"lengths": [17]}, r"lengths\[0\] = 17 outside 1..16"),
    ({"slots": [2]}, r"slots\[0\] = 2 outside 0..1"),
    ({"slots": [-1]}, "slots"),
    ({"kv_dtype": torch.float32}, "kv: dtype"),
    ({"pe_P": 9}, "pe: shape"),
    ({"table": torch.tensor([[1, 3], [0, 2]], dtype=torch.int32)}, "table: dtype int32, expected int64"),
    ({"table": torch.tensor([1, 3])}, "table .* 2-D"),
    ({"P": 256, "table": torch.tensor([[1, 4]]), "lengths": [300]}, r"table\[0, 1\] = 4 .*outside 0..3"),
    ({"table": torch.tensor([[-1, 0]])}, r"table\[0, 0\] = -1"),
    ({"lengths": [9]}, "multiple of 256"),  # P = 8: a sequence past its first block
    ({"P": 300, "lengths": [301]}, "multiple of 256"),
])
def test_bad_calls_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        _call(**bad)


def test_what_a_sequence_does_not_read_is_not_checked():
    """Block ids past a sequence's own blocks and in other slots may be anything (-1: unallocated); P need not be
    a multiple of the chunk while every sequence fits its first block."""
    out = _call(P=300, table=torch.tensor([[2, -1, 99], [-7, -7, -7]]), lengths=(300,))
    assert torch.isfinite(out).all()
    out = _call(P=2 * CHUNK, table=torch.tensor([[2, 0, 99]]), lengths=(4 * CHUNK,))
    assert torch.isfinite(out).all()
