"""What the engine's loop makes of the model's logits: each request's token (sampled from its own Sampler), the
text (detokenised), its endings (stop strings, stop token ids and eos, max_tokens) and what each step hands back
(`RequestOutput`: the tokens and text that are new)."""
from __future__ import annotations

import time
import traceback
from typing import Optional

import torch

from hybrid.engine.requests import FinishReason, Request, RequestOutput
from hybrid.engine.sampler import Sampler, choose
from hybrid.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Optional[Tokenizer], eos_token_id: Optional[int]):
        self.tokenizer = tokenizer
        # the ids that end a request (unless it asks to ignore them): the model's eos, the tokenizer's
        self.eos_ids = frozenset({eos_token_id} - {None}) | (tokenizer.eos_ids if tokenizer is not None else set())
        self.samplers: dict[int, Sampler] = {}  # by request id, while the request runs

    def add(self, req: Request) -> None:
        self.samplers[req.id] = Sampler(req.params, req.prompt)

    def drop(self, req: Request) -> None:
        self.samplers.pop(req.id, None)

    def first(self, req: Request, logits_V: torch.Tensor) -> int:
        """The token after the prompt."""
        return self.samplers[req.id].sample(logits_V)

    def sample(self, reqs: list[Request], logits_BV: torch.Tensor | Exception) -> list[int | Exception]:
        """Each request's token from its row of a decode step's logits, or the error that fails it (the step's own,
        when it failed)."""
        if isinstance(logits_BV, Exception):
            return [logits_BV] * len(reqs)
        try:
            return choose(logits_BV, [self.samplers[r.id] for r in reqs])
        except Exception as e:
            return [e] * len(reqs)

    def append(self, req: Request, token: int) -> Optional[FinishReason]:
        """The request's new token: why the request ends with it, or None. A stop string ends the text before it;
        a stop token is not decoded."""
        req.output.append(token)
        if req.params.logprobs is not None:
            req.logprobs.append(self.samplers[req.id].last)
        req.token_times.append(time.perf_counter())
        p = req.params
        stop_token = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.output[:-1] if stop_token else req.output)
            cut = _first_stop(req.text, p.stop, max(0, req.shown - max(map(len, p.stop), default=0)))
            if cut is not None:
                req.text = req.text[:cut]
                return FinishReason.stop
        if stop_token:
            return FinishReason.stop
        if len(req.output) >= p.max_tokens:
            return FinishReason.length
        return None

    @staticmethod
    def output(req: Request) -> RequestOutput:
        """What is new since the last output: tokens, and text that can no longer change (no partial UTF-8
        character, nothing that may be the start of a stop string) unless the request ended."""
        new_tokens = req.output[req.tokens_out:]
        req.tokens_out = len(req.output)
        text = req.text
        if not req.finished:
            text = text.rstrip("\ufffd")
            hold = _stop_prefix(text, req.params.stop)
            text = text[:len(text) - hold]
        delta = text[req.shown:] if len(text) > req.shown else ""
        req.shown = max(req.shown, len(text))
        logprobs = req.logprobs[len(req.output) - len(new_tokens):] if req.params.logprobs is not None else None
        return RequestOutput(req.id, new_tokens, delta, req.finished, req.finish_reason, req.error,
                             len(req.prompt), len(req.output), logprobs)


def error_text(e: BaseException) -> str:
    """A failed request's error: the exception and where it was raised."""
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    return f"{type(e).__name__}: {e}" + (f" ({where.filename}:{where.lineno})" if where else "")


def _first_stop(text: str, stops: tuple[str, ...], since: int) -> Optional[int]:
    """Where the earliest stop string starts in text (searching from `since`), or None."""
    found = [i for i in (text.find(s, since) for s in stops) if i >= 0]
    return min(found) if found else None


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of text that may begin a stop string (held back while streaming)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
