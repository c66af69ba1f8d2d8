"""Mixture of experts: the noaux_tc router (fp32), the routed experts, the shared experts.

Legend: T tokens, D hidden, E routed experts, G expert groups, K experts per token.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hybrid.kernels.fp8_linear import DEFAULT_GEMM, Fp8Gemm
from hybrid.model.args import ModelArgs
from hybrid.model.layers import MLP


class Router(nn.Module):
    """sigmoid scores; selection by score + bias within the best groups; weights are the unbiased scores."""

    def __init__(self, args: ModelArgs, gemm: Fp8Gemm = DEFAULT_GEMM):
        super().__init__()
        self.args, self.gemm = args, gemm  # the scores' FP32 GEMM: placement's choice for the device
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size, dtype=torch.bfloat16),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        scores_TE = self.gemm.fp32_linear(x_TD, self.weight).sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias.float()
        if a.n_group > 1:
            group_TG = choice_TE.view(-1, a.n_group, a.n_routed_experts // a.n_group).topk(2, dim=-1)[0].sum(-1)
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
            keep_TG.scatter_(1, group_TG.topk(a.topk_group, dim=-1)[1], True)
            keep_TE = keep_TG.repeat_interleave(a.n_routed_experts // a.n_group, dim=1)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        ids_TK = choice_TE.topk(a.num_experts_per_tok, dim=-1)[1]
        weights_TK = scores_TE.gather(1, ids_TK)
        if a.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return weights_TK * a.routed_scaling_factor, ids_TK


class Done:
    """A result already computed: what `start` returns when the experts run synchronously."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value


class RoutedExperts(nn.ModuleList):
    """Σ_k w_k · expert_k(x) in plain torch; a placement pass may swap in the native CPU op.
    A list of experts, so that the weights keep the checkpoint's names (`mlp.experts.<e>.gate_proj.weight`).

    `start(...)` begins the computation and returns a handle whose `result()` gives it: an implementation that runs
    elsewhere (the CPU kernels beside a GPU) returns at once, and the shared experts run meanwhile."""

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> Done:
        return Done(self(x_TD, weights_TK, ids_TK))

    def __init__(self, args: ModelArgs):
        super().__init__(
            MLP(args.hidden_size, args.moe_intermediate_size, args.fp8_block, args.expert_group)
            for _ in range(args.n_routed_experts)
        )

    def forward(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        out_TD = torch.zeros_like(x_TD, dtype=torch.float32)
        for e in ids_TK.unique().tolist():
            tok, k = (ids_TK == e).nonzero(as_tuple=True)
            y = self[e](x_TD[tok]).float() * weights_TK[tok, k, None]
            out_TD.index_add_(0, tok, y)
        return out_TD.to(x_TD.dtype)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args)
        self.experts = RoutedExperts(args)
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts,
                                  args.fp8_block)

    def forward(self, x_BSD: torch.Tensor, experts: Optional[nn.Module] = None) -> torch.Tensor:
        """experts: the routed experts for this call instead of the layer's own (RoutedExperts' `start`), e.g. a
        prefill's experts streamed through the device while other calls go on using the layer's own."""
        x_TD = x_BSD.flatten(0, 1)
        weights_TK, ids_TK = self.gate(x_TD)
        routed = (self.experts if experts is None else experts).start(x_TD, weights_TK, ids_TK)
        shared_TD = self.shared_experts(x_TD)
        return (routed.result() + shared_TD).view_as(x_BSD)
