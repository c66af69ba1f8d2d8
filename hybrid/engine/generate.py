"""Generation: prefill each prompt into its KV-cache slot, then decode all sequences together, one token per step,
each at its own position. Times every phase for the SLO report (TTFT, TPOT, tokens/s)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch

from hybrid.engine.sampler import Sampler, Sampling
from hybrid.model.transformer import Transformer


@dataclass
class Timings:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # start to first generated token
    decode_s: float = 0.0  # first to last generated token

    @property
    def tpot_s(self) -> float:
        return self.decode_s / max(self.new_tokens - 1, 1)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s else 0.0


@dataclass
class Result:
    prompt_ids: list[list[int]]
    output_ids: list[list[int]] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)


class Generator:
    def __init__(self, model: Transformer, max_batch: int, max_context: int, eos_id: Optional[int] = None,
                 device: torch.device | str = "cpu", long_prefill: Optional[Callable[[int], ContextManager]] = None,
                 cutoff: int = 0, chunk: int = 0):
        """long_prefill(tokens): a context in which prompts over `cutoff` tokens are prefilled (stream-loading),
        `chunk` tokens at a time (0 = the whole prompt), the weights streamed once per chunk."""
        self.model, self.eos_id, self.device = model, eos_id, torch.device(device)
        self.long_prefill, self.cutoff, self.chunk = long_prefill, cutoff, chunk
        self.max_context = max_context
        self.cache = model.new_cache(max_batch, max_context, self.device)
        self.decode_step: Optional[Callable] = None  # (tokens, pos, slots, kv_len) -> logits, e.g. CUDA graphs
        self.after_prefill: Optional[Callable[[], None]] = None  # e.g. move the hottest experts onto the GPU

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                 on_token: Optional[Callable[[int, int], None]] = None) -> Result:
        """on_token(sequence index, token id) is called as each token is chosen (for streaming)."""
        self._check(prompts, max_new_tokens)
        sampler, res = Sampler(sampling), Result([list(p) for p in prompts])
        res.output_ids = [[] for _ in prompts]
        t0 = time.perf_counter()
        last = torch.stack([self._prefill(i, p) for i, p in enumerate(prompts)])
        if self.after_prefill is not None:
            self.after_prefill()
        live = list(range(len(prompts)))
        for step in range(max_new_tokens):
            tokens = sampler(last)
            if step == 0:
                res.timings.ttft_s = time.perf_counter() - t0
            live = self._append(res, live, tokens, on_token)
            if not live or step == max_new_tokens - 1:
                break
            last = self._decode(res, live)
        res.timings.decode_s = time.perf_counter() - t0 - res.timings.ttft_s
        res.timings.prompt_tokens = sum(map(len, prompts))
        res.timings.new_tokens = max(map(len, res.output_ids))
        return res

    def _check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not prompts or len(prompts) > self.cache.slots:
            raise ValueError(f"{len(prompts)} prompts for {self.cache.slots} KV-cache slots (policy.max_batch)")
        vocab = self.model.args.vocab_size
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            if len(p) + max_new_tokens > self.max_context:
                raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens {max_new_tokens} exceeds the KV "
                                 f"cache's {self.max_context} tokens (policy.max_context)")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"token id out of range 0..{vocab - 1} in prompt")

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, device=self.device)

    def _prefill(self, slot: int, prompt: list[int]) -> torch.Tensor:
        streamed = self.long_prefill is not None and len(prompt) > self.cutoff
        step = self.chunk if streamed and self.chunk else len(prompt)
        for start in range(0, len(prompt), step):
            end = min(len(prompt), start + step)
            tokens = self._tensor([prompt[start:end]])
            pos = torch.arange(start, end, device=self.device)[None]
            with self.long_prefill(end - start) if streamed else contextlib.nullcontext():
                logits = self.model(tokens, pos, self.cache, self._tensor([slot]), last_only=True, kv_len=end)
        return logits[0, -1]

    def _append(self, res: Result, live: list[int], tokens: torch.Tensor, on_token) -> list[int]:
        still = []
        for i, t in zip(live, tokens.tolist()):
            res.output_ids[i].append(t)
            if on_token:
                on_token(i, t)
            if t != self.eos_id:
                still.append(i)
        return still

    def _decode(self, res: Result, live: list[int]) -> torch.Tensor:
        tokens = self._tensor([[res.output_ids[i][-1]] for i in live])
        positions = [len(res.prompt_ids[i]) + len(res.output_ids[i]) - 1 for i in live]
        pos, slots, kv_len = self._tensor([[p] for p in positions]), self._tensor(live), max(positions) + 1
        if self.decode_step is not None:
            return self.decode_step(tokens, pos, slots, kv_len)
        return self.model(tokens, pos, self.cache, slots, kv_len=kv_len)[:, -1]
