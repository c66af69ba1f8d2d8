"""The batch-invariant MLA decode attention (hybrid/kernels/mla_decode.py) run by Triton's interpreter on the CPU:
against float64, and a sequence's output bit for bit the same whatever its batch mates, its place in the batch and
the KV length the grid reaches (a CUDA graph's bucket). The interpreter runs the kernels' logic (masks, chunk
skipping, the combine's order), not the GPU's arithmetic; the GPU test in tests/engine/test_beside_decode.py holds
the tokens there."""
from __future__ import annotations

import textwrap

from tests.kernels.interpreted import run

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
    few = mla_decode(q[:, :20], qp[:, :20], kv, pe, seq_slots, lengths, T, scale)  # a part-filled head block
    assert torch.equal(few, out[:, :20])
    try:
        mla_decode(q[..., :96], qp, kv[..., :96], pe, seq_slots, lengths, T, scale)
    except ValueError as e:
        assert "multiple of 64" in str(e)
    else:
        raise AssertionError("latent 96")
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
