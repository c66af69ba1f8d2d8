"""The batch-invariant MLA decode attention (hybrid/kernels/mla_decode.py) run by Triton's interpreter on the CPU:
against float64 over paged caches (blocks of CHUNK and 2 CHUNK positions with shuffled, shared block ids; the
unpaged layout, T not a multiple of CHUNK), and a sequence's output bit for bit the same whatever its batch mates,
its place in the batch, its slot and physical blocks, and the KV length the grid reaches (a CUDA graph's bucket). The interpreter runs the kernels' logic (masks, chunk
skipping, the combine's order), not the GPU's arithmetic; the GPU test in tests/engine/test_beside_decode.py holds
the tokens there."""
from __future__ import annotations

import textwrap

from tests.kernels.interpreted import run

CHECK = textwrap.dedent("""
    import torch
    from hybrid.kernels.mla_decode import CHUNK, mla_decode

    g = torch.Generator().manual_seed(0)
    C, R, H = 64, 16, 20  # a full head block and a part-filled one
    scale = 0.07

    def layout(lengths, slots, S, P, shared):
        # (table [S, M], N): shuffled block ids, a few spare; -1 where nobody reads; P None: unpaged (P = T)
        if P is None:
            return torch.arange(S)[:, None], S
        need = [-(-n // P) for n in lengths]
        ids = torch.randperm(sum(need) + 3, generator=g).tolist()
        table = torch.full((S, max(need) + 1), -1)
        for i, (s, k) in enumerate(zip(slots, need)):
            if shared and i == 1:  # the second sequence's first block is the first one's
                table[s, 0] = table[slots[0], 0]
                table[s, 1:k] = torch.tensor(ids[:k - 1])
                del ids[:k - 1]
            else:
                table[s, :k] = torch.tensor(ids[:k])
                del ids[:k]
        return table, sum(need) + 3

    def where(table, s, n, P):
        t = torch.arange(n)
        return table[s, t // P], t % P

    def cache(lengths, slots, S, P, shared, dtype):
        # NaN wherever no sequence reads: a position read that should not be poisons the output
        table, N = layout(lengths, slots, S, P, shared)
        P = P or max(lengths) + 10
        kv = torch.full((N, P, C), float("nan"), dtype=dtype)
        pe = torch.full((N, P, R), float("nan"), dtype=dtype)
        for s, n in zip(slots, lengths):
            blk, off = where(table, s, n, P)
            kv[blk, off] = torch.randn(n, C, generator=g).to(dtype)
            pe[blk, off] = torch.randn(n, R, generator=g).to(dtype)
        return kv, pe, table

    def rows(kv, pe, table, s, n):
        blk, off = where(table, s, n, kv.shape[1])
        return kv[blk, off], pe[blk, off]

    def alone_in(kv_rows, pe_rows, P):
        # one sequence's rows in a pool of its own: other physical blocks, another slot; P None: one block
        n = kv_rows.shape[0]
        P = P or -(-n // CHUNK) * CHUNK + 10
        k = -(-n // P)
        table = torch.full((2, k + 1 if P % CHUNK == 0 else k), -1)  # the grid's reach stays in one block
        table[1, :k] = torch.randperm(k + 3, generator=g)[:k]
        kv = torch.full((k + 3, P) + kv_rows.shape[1:], float("nan"), dtype=kv_rows.dtype)
        pe = torch.full((k + 3, P) + pe_rows.shape[1:], float("nan"), dtype=pe_rows.dtype)
        blk, off = where(table, 1, n, P)
        kv[blk, off], pe[blk, off] = kv_rows, pe_rows
        return kv, pe, table, torch.tensor([1]), torch.tensor([n])

    CASES = [  # (P, lengths): one past a chunk, short, several, exactly one; past blocks; unpaged, T not of CHUNK
        (CHUNK, [CHUNK + 1, 7, 3 * CHUNK + 90, CHUNK]),
        (2 * CHUNK, [2 * CHUNK + 1, 4 * CHUNK + 20, 300]),
        (None, [CHUNK + 1, 7, 2 * CHUNK + 90, CHUNK]),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for P, lengths in CASES:
            B = len(lengths)
            slots = torch.randperm(B + 2, generator=g)[:B].tolist()
            kv, pe, table = cache(lengths, slots, B + 2, P, P is not None, dtype)
            q = torch.randn(B, H, C, generator=g).to(dtype)
            qp = torch.randn(B, H, R, generator=g).to(dtype)
            seq_slots, lens = torch.tensor(slots), torch.tensor(lengths)
            reach = table.shape[1] * kv.shape[1]
            out = mla_decode(q, qp, kv, pe, table, seq_slots, lens, reach, scale)
            assert out.shape == (B, H, C) and out.dtype == torch.float32
            assert torch.isfinite(out).all(), (dtype, P)
            for i in range(B):  # against float64 (the inputs as the kernel reads them)
                k, p = (x.double() for x in rows(kv, pe, table, slots[i], lengths[i]))
                want = torch.softmax((q[i].double() @ k.T + qp[i].double() @ p.T) * scale, -1) @ k
                err = (out[i].double() - want).abs().max().item() / want.abs().max().item()
                bound = 1e-6 if dtype == torch.float32 else 2e-2  # BF16: the probabilities are rounded to BF16
                assert err < bound, (dtype, P, i, err)
            for i in range(B):  # alone, in other blocks (of CHUNK, 2 CHUNK, one), at reaches from its own up
                n = lengths[i]
                for other in (CHUNK, 2 * CHUNK, None):
                    kv1, pe1, table1, slot1, len1 = alone_in(*rows(kv, pe, table, slots[i], n), other)
                    for r in {n, -(-n // CHUNK) * CHUNK, table1.shape[1] * kv1.shape[1]}:
                        alone = mla_decode(q[i:i + 1], qp[i:i + 1], kv1, pe1, table1, slot1, len1, r, scale)
                        assert torch.equal(alone[0], out[i]), (dtype, P, i, other, r)
            swapped = mla_decode(q.flip(0), qp.flip(0), kv, pe, table, seq_slots.flip(0), lens.flip(0), reach,
                                 scale)
            assert torch.equal(swapped.flip(0), out), "the batch's order changes nothing"
            few = mla_decode(q[:, :5], qp[:, :5], kv, pe, table, seq_slots, lens, reach, scale)
            assert torch.equal(few, out[:, :5]), "heads in a part-filled block"

    def refused(what, **over):
        args = dict(q=q, qp=qp, kv=kv, pe=pe, table=table, slots=seq_slots, lens=lens, kv_len=reach, scale=scale)
        args.update(over)
        try:
            mla_decode(*args.values())
        except ValueError as e:
            assert what in str(e), (what, str(e))
        else:
            raise AssertionError(what)

    # the last case's cache: unpaged, P = T not a multiple of CHUNK
    T = kv.shape[1]
    refused("kv_len", kv_len=0)
    refused("kv_len", kv_len=T + 1)
    refused("2-D int64", table=table.to(torch.int32))
    refused("2-D int64", table=table[:, 0])
    refused("share N and P", pe=pe[:, :-1])
    refused("multiple of 64", q=q[..., :32], kv=kv[..., :32])
    two = torch.cat([table, table], 1)  # two blocks a slot of T positions: past the first one refused
    refused(f"multiple of {CHUNK}", table=two, kv_len=T + 1)
    print("ok")
""")


def test_mla_decode_under_the_interpreter():
    run(CHECK)


ENGINE = textwrap.dedent("""
    import sys, torch
    from hybrid.engine.engine import Engine
    from hybrid.engine.probe import local_plan
    from hybrid.engine.requests import SamplingParams
    from hybrid.kernels.fp8_linear import Fp8Gemm
    from hybrid.model.layers import Linear
    from hybrid.model.moe import Router
    from hybrid.models import Checkpoint, load_model

    def model(invariant):
        m = load_model(Checkpoint(sys.argv[1]), torch.float32, progress=False)
        gemm = Fp8Gemm(pad_rows=16 if invariant else 0)
        for mod in m.modules():  # as placement hands the GPU's gemm object to every Linear and router
            if isinstance(mod, Linear) or isinstance(mod, Router):
                mod.gemm = gemm
        return m

    plan = local_plan({"kv.max_batch": 3, "kv.max_context": 300, "decode.batch_cap": 3, "prefill.chunk_tokens": 8})
    m = model(True)
    assert all(mla.kv_b_proj.gemm.attends_from_cache(torch.empty(1)) for mla in
               [x for x in m.modules() if type(x).__name__ == "MLA"])
    v = m.args.vocab_size
    prompts = [torch.randint(2, v, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 17, 5)]
    greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)
    engine = Engine(m, plan)
    arrivals = {0: [(prompts[0], 18)], 3: [(prompts[1], 8)], 6: [(prompts[2], 12)]}
    got, step = {}, 0
    while step < 200 and (step <= max(arrivals) or engine.has_work()):
        for p, n in arrivals.get(step, []):
            got[engine.add_request(p, greedy(n))] = (p, n, [])
        for out in engine.step():
            got[out.id][2].extend(out.new_token_ids)
        step += 1
    for p, n, tokens in got.values():
        alone = Engine(m, plan).generate([p], greedy(n))[0].output_ids
        assert tokens == alone, (tokens, alone)
    # the same numbers as the einsum path, within float32's rounding
    ref = model(False)
    x = torch.tensor([prompts[1]])
    cache_a, cache_b = m.new_cache(1, 64, torch.device("cpu")), ref.new_cache(1, 64, torch.device("cpu"))
    slots = torch.tensor([0])
    n = len(prompts[1])
    m(x, torch.arange(n)[None], cache_a, slots, kv_len=n)
    ref(x, torch.arange(n)[None], cache_b, slots, kv_len=n)
    t = torch.tensor([[prompts[0][0]]])
    la = m(t, torch.tensor([[n]]), cache_a, slots, kv_len=n + 1)
    lb = ref(t, torch.tensor([[n]]), cache_b, slots, kv_len=n + 1)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    print("ok")
""")


def test_an_engine_on_the_invariant_path_keeps_solo_tokens(tiny_dir):
    """The tiny model with the GPU's batch-invariant gemm object (padded rows, attention read from the cache in
    chunks) run by the interpreter on the CPU: requests arriving mid-decode keep their solo tokens, and a decode
    step gives the einsum path's logits."""
    run(ENGINE, str(tiny_dir))
