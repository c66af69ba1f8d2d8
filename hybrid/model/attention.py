"""Multi-head Latent Attention (MLA) in the absorbed form: queries are projected into the latent space, so the
cache holds only the compressed latent (C) and the shared rotary key (R) per token.

Legend: B batch, S new tokens, T key positions, H heads, D hidden, N no-rope head dim, V value head dim.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.kernels.attention import causal_in_chunks
from hybrid.kernels.pointwise import FUSED, Fused, expand_keys
from hybrid.model.args import ModelArgs
from hybrid.model.kv_cache import LatentCache
from hybrid.model.layers import Linear, RMSNorm
from hybrid.model.rope import Rope


class MLA(nn.Module):
    def __init__(self, args: ModelArgs, fused: Fused = FUSED):
        super().__init__()
        self.args, self.fused = args, fused  # RoPE on the query and the key expansion (its norms hold their own)
        self.rope = Rope(args.rope, args.qk_rope_head_dim)
        a, blk = args, args.fp8_block
        h = a.num_attention_heads
        if a.q_lora_rank:
            self.q_a_proj = Linear(a.hidden_size, a.q_lora_rank, blk)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, a.rms_norm_eps)
            self.q_b_proj = Linear(a.q_lora_rank, h * a.qk_head_dim, blk)
        else:
            self.q_proj = Linear(a.hidden_size, h * a.qk_head_dim, blk)
        self.kv_a_proj_with_mqa = Linear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, blk)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, a.rms_norm_eps)
        self.kv_b_proj = Linear(a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), blk)
        self.o_proj = Linear(h * a.v_head_dim, a.hidden_size, blk)
        # kv_b as its per-head key and value matrices, dequantised once (`keep_kv_b`); None: at each call
        self.register_buffer("w_uk_HNC", None, persistent=False)
        self.register_buffer("w_uv_HVC", None, persistent=False)
        # prefill of more tokens than this in query chunks of this many (hybrid/kernels/attention.py); 0: one call
        self.query_chunk = 0

    def keep_kv_b(self, dtype: torch.dtype) -> int:
        """kv_b dequantised to `dtype` once and kept as its two halves, each contiguous (a product reads one whole;
        a split view of the stored matrix would be copied per call); returns their bytes."""
        self.w_uk_HNC = self.w_uv_HVC = None
        w_uk_HNC, w_uv_HVC = self._halves(self._kv_b(dtype))
        self.w_uk_HNC, self.w_uv_HVC = w_uk_HNC.contiguous(), w_uv_HVC.contiguous()
        return self.w_uk_HNC.nbytes + self.w_uv_HVC.nbytes

    def _kv_b(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """kv_b [H, N + V, C] in `dtype`, dequantised now; None when its halves are kept in that dtype."""
        if self.w_uk_HNC is not None and self.w_uk_HNC.dtype == dtype:
            return None
        a = self.args
        return self.kv_b_proj.dense_weight(dtype).view(a.num_attention_heads, -1, a.kv_lora_rank)

    def _halves(self, w_HXC: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The key [H, N, C] and value [H, V, C] halves of kv_b: views of w_HXC, or the kept ones."""
        if w_HXC is None:
            return self.w_uk_HNC, self.w_uv_HVC
        return w_HXC.split([self.args.qk_nope_head_dim, self.args.v_head_dim], dim=1)

    def _query(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.args.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        return self.q_proj(x_BSD)

    def forward(self, x_BSD: torch.Tensor, pos_BS: torch.Tensor, cache: Optional[LatentCache] = None,
                slots_B: Optional[torch.Tensor] = None, kv_len: int = 0) -> torch.Tensor:
        a = self.args
        B, S, _ = x_BSD.shape
        q_BSHK = self._query(x_BSD).view(B, S, a.num_attention_heads, a.qk_head_dim)
        q_nope_BSHN, q_pe_BSHR = q_BSHK.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        self.rope.apply_(q_pe_BSHR, pos_BS, self.fused)  # rotated in place: q_BSHK is the whole query

        kv_c_BSC, k_pe_BSR = self.kv_a_proj_with_mqa(x_BSD).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        kv_c_BSC = self.kv_a_layernorm(kv_c_BSC)
        k_pe_BSR = self.rope.apply(k_pe_BSR[:, :, None, :], pos_BS)[:, :, 0, :]

        if cache is None:
            kv_BTC, pe_BTR, key_pos_BT = kv_c_BSC, k_pe_BSR, pos_BS
        else:
            if S == 1 and self.kv_b_proj.gemm.attends_from_cache(x_BSD):  # per-sequence decode kernel (placement)
                cache.write(slots_B, pos_BS, kv_c_BSC, k_pe_BSR)
                o_BSHV = self._from_cache(q_nope_BSHN, q_pe_BSHR, cache, slots_B, pos_BS, kv_len)
                return self.o_proj(o_BSHV.flatten(2))
            kv_BTC, pe_BTR = cache.write_and_read(slots_B, pos_BS, kv_c_BSC, k_pe_BSR, kv_len)
            key_pos_BT = torch.arange(kv_BTC.shape[1], device=pos_BS.device).expand(B, -1)
        kv_BTC, pe_BTR = kv_BTC.to(x_BSD.dtype), pe_BTR.to(x_BSD.dtype)

        w_HXC = self._kv_b(x_BSD.dtype)
        # a chunk covering every key from position 0 (a whole prompt) is plain causal: no mask needed
        causal = S > 1 and S == kv_BTC.shape[1] and (cache is None or kv_len == S)
        # one sequence's prompt, or a later chunk of it (its S new tokens are the last S of its kv_len positions),
        # longer than a query chunk: in query chunks, each without a mask
        chunked = B == 1 and 0 < self.query_chunk < S and (causal or cache is not None)
        visible_BST = None if causal or chunked else key_pos_BT[:, None, :] <= pos_BS[:, :, None]
        if S > 1:
            o_BSHV = self._expanded(q_BSHK, kv_BTC, pe_BTR, w_HXC, visible_BST, self.query_chunk if chunked else 0)
        else:
            o_BSHV = self._absorbed(q_nope_BSHN, q_pe_BSHR, kv_BTC, pe_BTR, w_HXC, visible_BST)
        return self.o_proj(o_BSHV.flatten(2))

    def _absorbed(self, q_nope_BSHN, q_pe_BSHR, kv_BTC, pe_BTR, w_HXC, visible_BST):
        """Decode: queries projected into the latent space; nothing per head is expanded over T. The two per-head
        products with kv_b's halves go through kv_b_proj's gemm (placement's choice, as for every Linear: on the
        CPU path a native batched-head kernel, elsewhere torch's einsum)."""
        a = self.args
        w_uk_HNC, w_uv_HVC = self._halves(w_HXC)
        heads = self.kv_b_proj.gemm
        q_lat_BSHC = heads.per_head(q_nope_BSHN, w_uk_HNC, by_rows=True)
        scores_BSHT = (
            torch.einsum("bshc,btc->bsht", q_lat_BSHC, kv_BTC) + torch.einsum("bshr,btr->bsht", q_pe_BSHR, pe_BTR)
        ).float() * a.softmax_scale
        scores_BSHT = scores_BSHT.masked_fill(~visible_BST[:, :, None, :], float("-inf"))
        probs_BSHT = scores_BSHT.softmax(dim=-1).to(q_nope_BSHN.dtype)
        o_BSHC = torch.einsum("bsht,btc->bshc", probs_BSHT, kv_BTC)
        return heads.per_head(o_BSHC, w_uv_HVC, by_rows=False)

    def _from_cache(self, q_nope_BSHN, q_pe_BSHR, cache: LatentCache, slots_B, pos_BS, kv_len: int):
        """Decode (one new token per sequence) with the attention read from the cache per sequence, each over its
        own positions (kv_b_proj's gemm: placement's batch-invariant kernel); the same products with kv_b's
        halves as `_absorbed`."""
        a, dtype = self.args, q_nope_BSHN.dtype
        w_uk_HNC, w_uv_HVC = self._halves(self._kv_b(dtype))
        heads = self.kv_b_proj.gemm
        q_lat_BSHC = heads.per_head(q_nope_BSHN, w_uk_HNC, by_rows=True)
        o_BHC = heads.attend_from_cache(q_lat_BSHC[:, 0], q_pe_BSHR[:, 0], cache.kv, cache.pe, cache.table,
                                        slots_B, pos_BS[:, 0] + 1, kv_len, a.softmax_scale)
        return heads.per_head(o_BHC[:, None].to(dtype), w_uv_HVC, by_rows=False)

    def _expanded(self, q_BSHK, kv_BTC, pe_BTR, w_HXC, visible_BST, chunk: int = 0):
        """Prefill: keys and values expanded per head, then a fused attention kernel, whose memory grows with
        S·T only through the mask (visible_BST None: causal, the queries the last S of the T positions, no mask;
        `chunk` > 0: in query chunks of that many, two mask-free calls each)."""
        a = self.args
        if w_HXC is None:  # the kept halves
            k_nope_BTHN = torch.einsum("btc,hnc->bthn", kv_BTC, self.w_uk_HNC)
            v_BTHV = torch.einsum("btc,hvc->bthv", kv_BTC, self.w_uv_HVC)
        else:
            kv_BTHX = torch.einsum("btc,hxc->bthx", kv_BTC, w_HXC)
            k_nope_BTHN, v_BTHV = kv_BTHX.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        k_BTHK = expand_keys(k_nope_BTHN, pe_BTR, self.fused)
        q_BHSK, k_BHTK, v_BHTV = q_BSHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHV.transpose(1, 2)
        if chunk:  # the values packed (a view of kv_b's product otherwise): the fused kernels' calls take them
            o_BHSV = causal_in_chunks(q_BHSK, k_BHTK, v_BTHV.contiguous().transpose(1, 2), a.softmax_scale, chunk)
        else:
            causal = visible_BST is None
            o_BHSV = F.scaled_dot_product_attention(q_BHSK, k_BHTK, v_BHTV, attn_mask=None if causal else
                                                    visible_BST[:, None], is_causal=causal, scale=a.softmax_scale)
        return o_BHSV.transpose(1, 2)
