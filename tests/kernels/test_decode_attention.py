"""hybrid.kernels.decode_attention (MLA decode attention on the CPU) against float64, for every code this CPU runs.

Codes: each variant of dispatch.available() runs the code of its ISA (avx512_bf16, avx2 or generic); each code is
tested once, under the first variant that reaches it.

Error bound, per output (b, h, c): the kernel's weights w_t (softmax of FP32 scores) carry a relative error of at
most 2^-9 (BF16 weights in the avx512_bf16 code; FP32 elsewhere) plus twice the scores' error δ, which a sequential
FP32 sum of the n = C + R terms bounds by n 2^-24 Σ|q k| scale; so |o - ref| <= (2^-8 + 4δ) Σ_t w_t |kv[t, c]|.
Outputs are poisoned with NaN before each call, and the cache past each sequence's length and in slots nobody
reads is NaN too: a position read that should not be fails the test.
"""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.decode_attention import attention_code, decode_attention, set_schedule
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


def _cache(rng, slots, T, C, R, lengths, slots_B):
    """A BF16 cache of random rows where sequences read, NaN everywhere else."""
    kv = torch.full((slots, T, C), float("nan"), dtype=torch.bfloat16)
    pe = torch.full((slots, T, R), float("nan"), dtype=torch.bfloat16)
    for s, n in zip(slots_B.tolist(), lengths.tolist()):
        kv[s, :n], pe[s, :n] = bf16(rng, (n, C)), bf16(rng, (n, R))
    return kv, pe


def _reference(q, qpe, kv, pe, slots_B, lengths, scale):
    """(float64 outputs [B, H, C], Σ_t w_t |kv| [B, H, C], the scores' error bound δ [B, H, 1])."""
    outs, mags, deltas = [], [], []
    for b, (s, n) in enumerate(zip(slots_B.tolist(), lengths.tolist())):
        k, p = kv[s, :n].double(), pe[s, :n].double()
        qb, qp = q[b].double(), qpe[b].double()
        w = ((qb @ k.T + qp @ p.T) * scale).softmax(-1)
        terms = (qb.abs() @ k.abs().T + qp.abs() @ p.abs().T) * scale
        outs.append(w @ k)
        mags.append(w @ k.abs())
        deltas.append(terms.amax(-1, keepdim=True) * (k.shape[1] + p.shape[1]) * 2.0 ** -24)
    return torch.stack(outs), torch.stack(mags), torch.stack(deltas)


def run_and_check(variant, H, C, R, lengths, what="", slots=None, q_std=1.0, scale=SCALE, strided_pe=False):
    lengths = torch.tensor(lengths)
    B, T = len(lengths), int(lengths.max()) + 3
    rng = rng_for("attn", variant, H, C, R, tuple(lengths.tolist()), what)
    slots_B = torch.randperm(B + 2, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))[:B]
    kv, pe = _cache(rng, B + 2, T, C, R, lengths, slots_B)
    q = bf16(rng, (B, H, C), q_std)
    if strided_pe:  # as MLA passes it: the rope part of the whole query [B, H, N + R]
        qpe = bf16(rng, (B, H, 2 * R + 3), q_std)[:, :, R + 3:]
    else:
        qpe = bf16(rng, (B, H, R), q_std)
    out = torch.full((B, H, C), float("nan"))
    assert decode_attention(q, qpe, kv, pe, slots_B, lengths, scale, kernel=variant, out=out) is out
    ref, mag, delta = _reference(q, qpe, kv, pe, slots_B, lengths, scale)
    msg = (f"{attention_code(variant)} {what} B={B} H={H} C={C} R={R} lengths={lengths.tolist()[:8]}; "
           f"{seed_note()}")
    bad = (~torch.isfinite(out)).nonzero()
    assert bad.numel() == 0, f"{msg}: {bad.shape[0]} outputs not written or not finite, first at {bad[0].tolist()}"
    err = (out.double() - ref).abs()
    bound = mag * (2.0 ** -8 + 4 * delta) + 1e-30
    over = (err > bound).nonzero()
    assert over.numel() == 0, (f"{msg}: {over.shape[0]} outputs over the bound, first at {over[0].tolist()}: "
                               f"err {float(err[tuple(over[0])]):.3e} > {float(bound[tuple(over[0])]):.3e}")
    record("attn", attention_code(variant), "bf16", *rel_errors(out, ref, mag))
    return out, (q, qpe, kv, pe, slots_B, lengths)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("H,C,R", DIMS)
def test_dims_and_ragged_chunk_ends(variant, H, C, R):
    """Several sequences of different lengths in one call: 1, around a chunk's end (255-257), a few chunks."""
    run_and_check(variant, H, C, R, [1, 255, 256, 257, 7, 600][: 6 if H < 64 else 4], "ragged")


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rope_query_and_peaked_scores(variant):
    """q_pe as a view of the whole query; scores spread wide (a few positions take nearly all the weight)."""
    run_and_check(variant, 16, 512, 64, [300, 33], "strided", strided_pe=True)
    run_and_check(variant, 16, 512, 64, [513, 2], "peaked", q_std=4.0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_context_one_sequence_few_heads(variant):
    """33K positions (129 chunks, the last one ragged), DeepSeek-V3's latent and rope dims, two heads."""
    run_and_check(variant, 2, 512, 64, [33_000], "33K")


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("context", [1, 64, 511, 4096, 16_385, 33_000])
def test_deepseek_heads_at_every_context(variant, context):
    run_and_check(variant, 128, 512, 64, [context, max(1, context // 3)], "sweep")


@pytest.mark.parametrize("schedule", ["split", "heads"])
@pytest.mark.parametrize("H,C,R", [(3, 40, 8), (5, 33, 7)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_either_schedule_at_odd_dims(variant, H, C, R, schedule):
    """Both schedules whatever the pool's size picks (auto takes heads where chunks are few for the threads: a
    16-thread host ran heads here, and a group's scratch must stay aligned for the kernels' aligned loads)."""
    try:
        set_schedule(schedule)
        run_and_check(variant, H, C, R, [1, 255, 256, 257, 7, 600], schedule)
    finally:
        set_schedule("auto")


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_sequence_gets_the_same_bits_alone_in_any_batch_schedule_or_pool(variant):
    """Batch invariance: a sequence's output alone equals its row in a batch of others, under either schedule
    and with 1 or 2 threads."""
    out, (q, qpe, kv, pe, slots_B, lengths) = run_and_check(variant, 8, 512, 64, [700, 1, 300, 40], "batch")
    before = threads()
    try:
        for schedule in ("split", "heads"):
            for n in (1, 2):
                set_schedule(schedule)
                set_threads(n)
                for b in range(len(lengths)):
                    alone = decode_attention(q[b:b + 1], qpe[b:b + 1], kv, pe, slots_B[b:b + 1],
                                             lengths[b:b + 1], SCALE, kernel=variant)
                    assert torch.equal(alone[0], out[b]), (f"{attention_code(variant)}: sequence {b} (length "
                                                           f"{int(lengths[b])}) alone, {schedule}, {n} threads, "
                                                           f"differs from its row in the batch; {seed_note()}")
    finally:
        set_schedule("auto")
        set_threads(before)


@pytest.mark.parametrize("bad,match", [
    ({"lengths": [0]}, "lengths"), ({"lengths": [99]}, "lengths"), ({"slots": [5]}, "slots"),
    ({"dtype": torch.float32}, "dtype"),
])
def test_bad_calls_raise(bad, match):
    q, kv = torch.zeros(1, 2, 64, dtype=torch.bfloat16), torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    qpe, pe = torch.zeros(1, 2, 16, dtype=torch.bfloat16), torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    if "dtype" in bad:
        kv = kv.to(bad["dtype"])
    with pytest.raises(ValueError, match=match):
        decode_attention(q, qpe, kv, pe, torch.tensor(bad.get("slots", [0])), torch.tensor(bad.get("lengths", [1])),
                         SCALE)
