"""Next-token choice: greedy at temperature 0, else temperature, top-k and top-p (nucleus) sampling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


class Sampler:
    def __init__(self, params: Sampling):
        self.p = params
        self._gen: Optional[torch.Generator] = None
        if params.temperature > 0:
            self._gen = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits_BV: torch.Tensor) -> torch.Tensor:
        if self._gen is None:
            return logits_BV.argmax(-1)
        logits_BV = logits_BV.float() / self.p.temperature
        if self.p.top_k:
            kth = logits_BV.topk(min(self.p.top_k, logits_BV.shape[-1]), dim=-1)[0][:, -1:]
            logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
        probs_BV = logits_BV.softmax(-1)
        if self.p.top_p < 1.0:
            sorted_p, order = probs_BV.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.p.top_p  # keep the smallest set reaching top_p
            probs_BV = probs_BV.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs_BV.cpu(), 1, generator=self._gen)[:, 0].to(logits_BV.device)
