"""Next-token choice per request: the request's logits processors, logit bias and penalties, then greedy at
temperature 0, else temperature, top-k, top-p (nucleus) and min-p sampling from the request's own generator — so a
seeded request draws the same tokens whatever its batch mates, and a greedy one picks the same. With
`SamplingParams.logprobs`, each token's log-probability and the likeliest tokens' (the model's own distribution).
"""
from __future__ import annotations

import random
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

from hybrid.engine.requests import SamplingParams, TokenLogprobs


@runtime_checkable
class Prefetching(Protocol):
    """A logits processor whose next call can be prepared ahead (a grammar's next mask): `prefetch(output ids)` is
    called as soon as a token is chosen, so the work overlaps the next step's forward instead of delaying it."""

    def prefetch(self, output_ids: Sequence[int]) -> None: ...


MIN_TEMPERATURE = 1e-5  # below this, greedy (logits / a tinier temperature overflow to inf, probabilities to NaN)


class Sampler:
    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()):
        self.p = params
        self.prompt = list(prompt)
        self.output: list[int] = []  # the tokens chosen so far
        self.last: Optional[TokenLogprobs] = None  # the last token's, when params.logprobs is set
        self.gen: Optional[torch.Generator] = None
        if params.temperature >= MIN_TEMPERATURE:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            self.gen = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.gen is None

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before the choice (processors, bias, penalties)."""
        p = self.p
        return bool(p.logits_processors or p.logit_bias or p.presence_penalty or p.frequency_penalty or
                    p.repetition_penalty != 1.0)

    def sample(self, logits_V: torch.Tensor) -> int:
        """One token from one row of logits (on any device; sampled on the host)."""
        row_V = self.adjust(logits_V) if self.adjusts else logits_V
        if self.gen is None:
            return self.accept(int(row_V.argmax(-1)), logits_V)
        row_V = row_V.float().cpu() / self.p.temperature
        if self.p.top_k:
            kth = row_V.topk(min(self.p.top_k, row_V.shape[-1]))[0][-1]
            row_V = row_V.masked_fill(row_V < kth, float("-inf"))
        probs_V = row_V.softmax(-1)
        if self.p.top_p < 1.0:
            sorted_p, order = probs_V.sort(descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.p.top_p  # keep the smallest set reaching top_p
            probs_V = probs_V.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        if self.p.min_p > 0.0:
            probs_V = probs_V.masked_fill(probs_V < self.p.min_p * probs_V.max(), 0.0)
        return self.accept(int(torch.multinomial(probs_V, 1, generator=self.gen)), logits_V)

    def adjust(self, logits_V: torch.Tensor) -> torch.Tensor:
        """The row the choice is made from: processors, logit bias, repetition, frequency and presence penalties."""
        p, row_V = self.p, logits_V.float().clone()
        for process in p.logits_processors:
            row_V = process(self.output, row_V)
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            row_V[list(ids)] += torch.tensor(bias, device=row_V.device)
        if p.repetition_penalty != 1.0 and (self.prompt or self.output):
            seen = torch.tensor(self.prompt + self.output, device=row_V.device).unique()
            v = row_V[seen]
            row_V[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.output:
            counts_V = torch.bincount(torch.tensor(self.output, device=row_V.device), minlength=row_V.shape[-1])
            row_V -= p.frequency_penalty * counts_V + p.presence_penalty * (counts_V > 0)
        return row_V

    def accept(self, token: int, logits_V: torch.Tensor) -> int:
        """Records the chosen token (and its log-probabilities), starts the processors' next work; returns it."""
        self.output.append(token)
        for process in self.p.logits_processors:
            if isinstance(process, Prefetching):
                process.prefetch(self.output)
        if self.p.logprobs is not None:
            logp_V = logits_V.float().log_softmax(-1)
            top = logp_V.topk(self.p.logprobs) if self.p.logprobs else None
            pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
            self.last = TokenLogprobs(token, float(logp_V[token]), pairs)
        return token


def choose(logits_BV: torch.Tensor, samplers: Sequence[Sampler]) -> list[int | Exception]:
    """A token per row: the plain greedy rows' argmax in one device op and one read back, the others row by row;
    a row whose sampling fails gets its exception instead (that request alone fails)."""
    tokens: list[int | Exception] = logits_BV.argmax(-1).tolist()
    for i, s in enumerate(samplers):
        try:
            if s.greedy and not s.adjusts:
                s.accept(tokens[i], logits_BV[i])
            else:
                tokens[i] = s.sample(logits_BV[i])
        except Exception as e:  # e.g. probabilities with inf or NaN, a logits processor's failure
            tokens[i] = e
    return tokens
