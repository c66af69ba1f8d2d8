"""Prefill attention in query chunks (two mask-free calls per chunk merged by log-sum-exp) against one masked call in
float64, and the model's prefill with it against one call per layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid.kernels.attention import attention_lse, causal_in_chunks


def _qkv(S: int, T: int, dtype: torch.dtype, seed: int = 0, K: int = 24, V: int = 16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, S, K, generator=g, dtype=dtype), torch.randn(2, 3, T, K, generator=g, dtype=dtype),
            torch.randn(2, 3, T, V, generator=g, dtype=dtype))


def _reference(q, k, v, scale):
    S, T = q.shape[2], k.shape[2]
    visible = torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None]  # the queries are the last S positions
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible, scale=scale)


@pytest.mark.parametrize("S,T,chunk", [(40, 40, 7), (40, 40, 16), (40, 40, 40), (40, 40, 64), (40, 53, 16),
                                       (1, 9, 4), (33, 33, 1)])
def test_chunks_equal_one_masked_call_in_float64(S, T, chunk):
    q, k, v = _qkv(S, T, torch.float64)
    out = causal_in_chunks(q, k, v, 0.2, chunk)
    assert out.shape == (2, 3, S, 16) and out.dtype == torch.float64
    err = (out - _reference(q, k, v, 0.2)).abs().max().item()
    assert err <= 1e-12, f"query chunks of {chunk} differ from one call by {err:.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_chunks_within_the_activation_dtype_rounding(dtype, tol):
    q, k, v = _qkv(64, 80, dtype, seed=1)
    out = causal_in_chunks(q, k, v, 24 ** -0.5, 16)
    assert out.dtype == dtype
    assert (out.double() - _reference(q, k, v, 24 ** -0.5)).abs().max().item() <= tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN / mem-efficient attention with lse)")
@pytest.mark.parametrize("K,V", [(24, 16), (192, 128)])
@pytest.mark.parametrize("batch", [1, 2])
def test_chunks_on_cuda_within_bf16_rounding(K, V, batch):
    """On the GPU (a batch of one: its batch stride rewritten, the model's [B, S, H, K] layout transposed)."""
    q, k, v = (t[:batch].transpose(1, 2).contiguous().transpose(1, 2).cuda()
               for t in _qkv(300, 340, torch.bfloat16, seed=4, K=K, V=V))
    out = causal_in_chunks(q, k, v, K ** -0.5, 64)
    whole = _reference(q.cpu(), k.cpu(), v.cpu(), K ** -0.5)
    assert out.dtype == torch.bfloat16 and (out.double().cpu() - whole).abs().max().item() <= 2e-2


def test_log_sum_exp_is_the_scores_own():
    q, k, v = _qkv(5, 11, torch.float64, seed=2)
    o, lse = attention_lse(q, k, v, False, 0.3)
    scores = (q @ k.transpose(-1, -2)) * 0.3
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-12)
    assert torch.allclose(o, scores.softmax(-1) @ v, atol=1e-12)
    o_c, lse_c = attention_lse(q[:, :, :5], k[:, :, :5], v[:, :, :5], True, 0.3)
    causal = scores[..., :5].masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(lse_c, causal.logsumexp(-1), atol=1e-12)
    assert torch.allclose(o_c, causal.softmax(-1) @ v[:, :, :5], atol=1e-12)


def test_more_queries_than_keys_is_refused():
    q, k, v = _qkv(9, 8, torch.float32)
    with pytest.raises(ValueError, match="9 queries but 8 keys"):
        causal_in_chunks(q, k, v, 0.2, 4)


def _set_chunk(m, tokens: int) -> None:
    from hybrid.placement.passes import chunk_prefill_attention

    chunk_prefill_attention(m, tokens)


def test_model_prefill_in_query_chunks_equals_one_call(tiny_model, monkeypatch):
    """Whole prompt without a cache, a prompt into the cache, and a later chunk after cached positions: with query
    chunks of 5 the logits equal one call per layer's (float32), and decode after it is unchanged."""
    import hybrid.model.attention as attention

    m, calls = tiny_model, []
    monkeypatch.setattr(attention, "causal_in_chunks",
                        lambda q, k, *rest: calls.append((q.shape[2], k.shape[2])) or causal_in_chunks(q, k, *rest))
    seq = torch.randint(2, m.args.vocab_size, (1, 23), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(23)[None]
    try:
        _set_chunk(m, 0)
        whole = m(seq, pos)[0]
        cache0, slot = m.new_cache(1, 32), torch.tensor([0])
        m(seq[:, :9], pos[:, :9], cache0, slot)
        later0 = m(seq[:, 9:], pos[:, 9:], cache0, slot)[0]
        assert not calls
        _set_chunk(m, 5)
        assert all(mla.query_chunk == 5 for mla in (b.self_attn for b in m.model.layers))
        chunked = m(seq, pos)[0]
        cache, slot = m.new_cache(1, 32), torch.tensor([0])
        m(seq[:, :9], pos[:, :9], cache, slot)
        later = m(seq[:, 9:], pos[:, 9:], cache, slot)[0]
        step = m(seq[:, :1], torch.tensor([[23]]), cache, slot)[0, -1]
        step0 = m(seq[:, :1], torch.tensor([[23]]), cache0, slot)[0, -1]
    finally:
        _set_chunk(m, 0)
    layers = len(m.model.layers)
    assert calls == [(23, 23)] * layers + [(9, 9)] * layers + [(14, 23)] * layers  # queries, keys per layer
    assert (chunked - whole).abs().max().item() <= 1e-4
    assert (later - later0).abs().max().item() <= 1e-4
    assert (later - whole[9:]).abs().max().item() <= 1e-4
    assert (step - step0).abs().max().item() <= 1e-4
