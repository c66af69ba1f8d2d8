"""Requests as the engine serves them: what a caller asks for (`SamplingParams`), a request's state as the scheduler
moves it along (`Request`), and what each engine step hands back (`RequestOutput`)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union

from hybrid.errors import HybridError

if TYPE_CHECKING:
    import torch


MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings are matched on every token's text
MAX_TOP_LOGPROBS = 20  # as OpenAI

# (the request's generated token ids so far, its logits row [V]) -> the row to sample from: e.g. a grammar's mask.
# Called on the engine's thread before the penalties, the temperature and the filters, for greedy requests too.
LogitsProcessor = Callable[[Sequence[int], "torch.Tensor"], "torch.Tensor"]


class RequestError(HybridError, ValueError):
    """A request the engine cannot take (empty prompt, token id out of range, longer than the KV cache holds, bad
    sampling field). Other requests are unaffected."""


class FinishReason(str, enum.Enum):
    stop = "stop"  # end-of-sequence token, a stop token id or a stop string
    length = "length"  # max_tokens generated
    abort = "abort"  # aborted by the caller
    error = "error"  # the engine failed while running it (the message says why)


@dataclass(frozen=True)
class SamplingParams:
    """Per request. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 filter nothing. A seed makes sampling
    reproducible whatever the request's batch mates (each request draws from its own generator); None = a fresh
    random seed. Stop strings end the text before them; stop token ids end it after them (not shown).
    Before sampling (greedy too), in this order: the logits processors, logit_bias (added to the logits),
    repetition_penalty (> 1 lowers every token of the prompt and output: positive logits divided, negative ones
    multiplied), frequency_penalty (times each token's count in the output) and presence_penalty (once per token
    in the output), both subtracted. `logprobs`: None = none; k = the sampled token's log-probability and the k
    likeliest tokens' at each step, from the model's own distribution (before any of the above)."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one's probability
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever comes (benchmarks)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Union[Mapping[int, float], tuple[tuple[int, float], ...]] = ()  # token id -> bias
    logprobs: Optional[int] = None
    logits_processors: tuple[LogitsProcessor, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")
        if len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        for knob in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, knob) <= 2:
                raise RequestError(f"{knob} must be in [-2, 2], got {getattr(self, knob)}")
        if not 0.01 <= self.repetition_penalty <= 100:
            raise RequestError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")
        bias = tuple(sorted((dict(self.logit_bias).items())))
        if any(not -100 <= b <= 100 for _, b in bias):
            raise RequestError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        object.__setattr__(self, "stop", tuple(self.stop))  # lists accepted: kept hashable and immutable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token id the request names (logit_bias, stop_token_ids): each must be in the vocabulary."""
        return tuple(t for t, _ in self.logit_bias) + self.stop_token_ids


class State(enum.Enum):
    waiting = "waiting"  # queued for a KV slot
    prefilling = "prefilling"  # holds a slot; its prompt goes in chunk by chunk
    streaming = "streaming"  # holds a slot; its prompt is stream-loaded beside decode (on a thread of its own)
    decoding = "decoding"  # one token per engine step
    finished = "finished"


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    state: State = State.waiting
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the KV cache
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter() at each generated token
    finish_reason: Optional[FinishReason] = None
    error: str = ""
    text: str = ""  # the output decoded so far (cut before a stop string that ended it)
    shown: int = 0  # characters of `text` already handed out
    tokens_out: int = 0  # tokens of `output` already handed out
    logprobs: list["TokenLogprobs"] = field(default_factory=list)  # per token of `output`, when params.logprobs

    @property
    def position(self) -> int:
        """Where the next token goes in the KV cache (the last generated token's position + 1)."""
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.state is State.finished

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrival if self.token_times else 0.0

    @property
    def tpot_s(self) -> float:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability, and the likeliest tokens' (id, log-probability), likeliest first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """A request's progress in one engine step: the tokens and text it gained, and, when it ended, why."""
    id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: Optional[list[TokenLogprobs]] = None  # one per new token, when the request asked for them
