"""The DeepSeek-V3 decoder: embeddings, blocks (MLA + dense MLP or MoE), final norm, lm_head.

Parameter names are the Hugging Face checkpoint's, so a checkpoint loads by name. Several sequences run at once,
each at its own position: `pos_BS` gives every token's position, `slots_B` every sequence's KV-cache slot.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from hybrid.model.args import ModelArgs
from hybrid.model.attention import MLA
from hybrid.model.kv_cache import KVCache
from hybrid.model.layers import MLP, Linear, RMSNorm
from hybrid.model.moe import MoE


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = MLA(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe_layer(layer):
            self.mlp = MoE(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.fp8_block)

    def forward(self, x_BSD, pos_BS, cache=None, slots_B=None, kv_len: int = 0, experts=None):
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), pos_BS, cache, slots_B, kv_len)
        h_BSD = self.post_attention_layernorm(x_BSD)
        return x_BSD + (self.mlp(h_BSD) if experts is None else self.mlp(h_BSD, experts))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=torch.bfloat16)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.model = Decoder(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, None)  # BF16, as the checkpoints store it

    @torch.inference_mode()
    def forward(self, tokens_BS: torch.Tensor, pos_BS: torch.Tensor, cache: Optional[KVCache] = None,
                slots_B: Optional[torch.Tensor] = None, last_only: bool = False,
                kv_len: Optional[int] = None, experts: Optional[Mapping[int, nn.Module]] = None) -> torch.Tensor:
        """Logits (fp32) for every token, or for the last one of each sequence when `last_only`.
        Without a cache, attention covers exactly the tokens given (a full recomputation). With one, `kv_len`
        (1 + the furthest position) saves reading it back from `pos_BS`, which would wait for the device.
        `experts`: layer index -> the routed experts this call uses in that MoE layer instead of its own (a
        stream-loading prefill's); the model itself is not changed, so other calls may run meanwhile."""
        if cache is not None and kv_len is None:
            kv_len = int(pos_BS.max()) + 1
        experts = experts or {}
        x_BSD = self.model.embed_tokens(tokens_BS).to(self.dtype)
        for i, block in enumerate(self.model.layers):
            x_BSD = block(x_BSD, pos_BS, cache.layers[i] if cache else None, slots_B, kv_len or 0, experts.get(i))
        if last_only:
            x_BSD = x_BSD[:, -1:]
        x_BSD = self.model.norm(x_BSD)
        return self.lm_head(x_BSD).float()

    def new_cache(self, slots: int, max_context: int, device=None, block_tokens: int = 0,
                  extra_blocks: int = 0) -> KVCache:
        a = self.args
        return KVCache(a.num_hidden_layers, slots, max_context, a.kv_lora_rank, a.qk_rope_head_dim,
                       self.dtype, device, block_tokens, extra_blocks)
