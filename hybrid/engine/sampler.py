"""Next-token choice per request: greedy at temperature 0, else temperature, top-k and top-p (nucleus) sampling from
the request's own generator — so a seeded request draws the same tokens whatever its batch mates."""
from __future__ import annotations

import random
from typing import Optional, Sequence

import torch

from hybrid.engine.requests import SamplingParams


MIN_TEMPERATURE = 1e-5  # below this, greedy (logits / a tinier temperature overflow to inf, probabilities to NaN)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen: Optional[torch.Generator] = None
        if params.temperature >= MIN_TEMPERATURE:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            self.gen = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.gen is None

    def sample(self, logits_V: torch.Tensor) -> int:
        """One token from one row of logits (on any device; sampled on the host)."""
        if self.gen is None:
            return int(logits_V.argmax(-1))
        logits_V = logits_V.float().cpu() / self.p.temperature
        if self.p.top_k:
            kth = logits_V.topk(min(self.p.top_k, logits_V.shape[-1]))[0][-1]
            logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
        probs_V = logits_V.softmax(-1)
        if self.p.top_p < 1.0:
            sorted_p, order = probs_V.sort(descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.p.top_p  # keep the smallest set reaching top_p
            probs_V = probs_V.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs_V, 1, generator=self.gen))


def choose(logits_BV: torch.Tensor, samplers: Sequence[Sampler]) -> list[int | Exception]:
    """A token per row: the greedy rows' argmax in one device op and one read back, the others row by row; a row
    whose sampling fails gets its exception instead (that request alone fails)."""
    tokens: list[int | Exception] = logits_BV.argmax(-1).tolist()
    for i, s in enumerate(samplers):
        if not s.greedy:
            try:
                tokens[i] = s.sample(logits_BV[i])
            except RuntimeError as e:  # e.g. probabilities with inf or NaN
                tokens[i] = e
    return tokens
