"""How a decode step runs: the `Decoder` protocol, chosen once by the plan, and eager decode.

A decoder runs one step for a batch, `decoder(tokens_B1, pos_B1, slots_B, kv_len, capture)` -> logits_BV, and two
micro-batches' steps (`dual`): one after the other here, overlapped where a strategy can (graphed decode,
hybrid/engine/cuda_graphs.py). A strategy that `staggers` can also launch one micro-batch's step and collect it
later, so that the two run half a step apart (hybrid/engine/staggered.py). `capture`: a graph not made yet may be
captured now (False while another thread uses the GPU).

Legend: B batch (sequences), V vocabulary.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hybrid.model.kv_cache import KVCache
from hybrid.model.transformer import Transformer

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # a step's (tokens_B1, pos_B1, slots_B, kv_len)
DecodeFn = Callable[..., torch.Tensor]  # (tokens_B1, pos_B1, slots_B, kv_len, capture=True) -> logits_BV


class Decoder:
    """A decode strategy. `staggers`: `prepare`, `launch` and `collect` run a micro-batch's step on a lane of its own
    (0 or 1), left running while the caller goes on."""
    staggers: bool = False

    def __call__(self, tokens_B1: torch.Tensor, pos_B1: torch.Tensor, slots_B: torch.Tensor, kv_len: int,
                 capture: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def dual(self, parts: Sequence[Part], capture: bool = True) -> list[torch.Tensor]:
        """Two micro-batches' steps, each with the logits its own step gives: here one after the other."""
        return [self(*part, capture=capture) for part in parts]

    def prepare(self, i: int, part: Part, capture: bool) -> bool:
        """Whether lane i can `launch` this part's step (with `capture`, made ready now if it can be)."""
        raise NotImplementedError

    def launch(self, i: int, part: Part) -> Optional[object]:
        """Lane i's step started and left running: a handle for `collect`, or None with nothing started."""
        raise NotImplementedError

    def collect(self, handle: object) -> torch.Tensor:
        """A launched step's logits, once it has ended."""
        raise NotImplementedError


class Eager(Decoder):
    """The model's forward over the KV cache, as is."""

    def __init__(self, model: Transformer, cache: KVCache):
        self.model, self.cache = model, cache

    def __call__(self, tokens_B1, pos_B1, slots_B, kv_len: int, capture: bool = True) -> torch.Tensor:
        return self.model(tokens_B1, pos_B1, self.cache, slots_B, kv_len=kv_len)[:, -1]


class Stepwise(Decoder):
    """A decode step function as a decoder."""

    def __init__(self, step: DecodeFn):
        self.step = step

    def __call__(self, tokens_B1, pos_B1, slots_B, kv_len: int, capture: bool = True) -> torch.Tensor:
        return self.step(tokens_B1, pos_B1, slots_B, kv_len, capture=capture)


def as_decoder(decode: Decoder | DecodeFn) -> Decoder:
    return decode if isinstance(decode, Decoder) else Stepwise(decode)
