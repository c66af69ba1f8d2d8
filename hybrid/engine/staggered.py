"""Dual-batch decode (policy.decode.dual_batch): a step's decoding requests as two micro-batches, and, with
policy.decode.dual_stagger, the two run half a step apart: the step of the micro-batch launched ahead (in the last
engine step) is already running; the other's is launched now; the first is collected and sampled and its next step
launched at once, so that its GPU work (the layers before its first CPU experts and after its last) runs while the
CPU computes the other's routed experts: the CPU does not wait for a step to start or end. Then the other is
collected. The step launched ahead is collected early (`drain`) whenever something else needs the model's ops: a
prefill, requests that come or go, a change of the thread pool.

Each micro-batch's logits, or its failure, go to the loop's `Take` as soon as they are there: the loop samples and
appends the tokens, and only the requests still running go on to the next launch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hybrid.engine.decoder import Decoder, Part
from hybrid.engine.requests import Request

# what the loop does with a batch's decode result: its logits (sampled, appended) or the error that fails it
Take = Callable[[list[Request], "torch.Tensor | Exception"], None]


@dataclass
class Ahead:
    """A micro-batch's decode step launched and not yet collected: its requests, its lane (0 or 1) and the
    decoder's handle."""
    reqs: list[Request]
    lane: int
    handle: object

    @property
    def ids(self) -> list[int]:
        return [r.id for r in self.reqs]


def micro_batches(live: list[Request]) -> list[list[Request]]:
    """Dual-batch decode's two micro-batches of a step's decoding requests, in admission order (the first the
    larger by one when odd), so that the concatenated halves are `live` again; one request stays one batch."""
    if len(live) < 2:
        return [live]
    half = (len(live) + 1) // 2
    return [live[:half], live[half:]]


class Stagger:
    def __init__(self, decoder: Decoder, inputs: Callable[[list[Request]], Part]):
        """inputs(reqs): a decode step's inputs for these requests."""
        self.decoder, self.inputs = decoder, inputs
        self.ahead: Optional[Ahead] = None  # the micro-batch step launched ahead, if any

    def step(self, groups: list[list[Request]], take: Take, capture: bool, busy: Callable[[], bool]) -> list[Request]:
        """This step of the two micro-batches; returns the requests still to decode the usual way (where a shape's
        graph is not there yet): none, or the micro-batch not launched. busy(): requests come or go, so nothing is
        launched ahead."""
        first, self.ahead = self.ahead, None
        if first is None:  # both launched now: the first micro-batch's step first
            try:
                parts = [self.inputs(g) for g in groups]
                if not all(self.decoder.prepare(i, part, capture) for i, part in enumerate(parts)):
                    return [r for g in groups for r in g]
            except Exception as e:  # nothing runs yet: the step's requests fail together
                take([r for g in groups for r in g], e)
                return []
            first = self._launch(0, groups[0], parts[0], take)
            if first is None:
                return groups[1]
        other = groups[1] if first.ids == [r.id for r in groups[0]] else groups[0]
        second = self._launch(1 - first.lane, other, None, take)
        if second is None:  # not captured (the usual way then), or failed: the first one's step stands
            self._collect(first, take)
            return [r for r in other if not r.finished]
        self._collect(first, take)
        nxt = [r for r in first.reqs if not r.finished]
        if nxt and not busy():
            self.ahead = self._launch(first.lane, nxt, None, take)
        self._collect(second, take)
        return []

    def drain(self, take: Take, keep: Optional[list[list[Request]]] = None) -> list[int]:
        """The step launched ahead, collected now — unless `keep` (this step's micro-batches) holds its requests as
        one of them, so that the staggering goes on. Returns the ids of the requests collected (they have had this
        step's token)."""
        a = self.ahead
        if a is None or (keep is not None and len(keep) == 2 and a.ids in ([r.id for r in g] for g in keep)):
            return []
        self.ahead = None
        self._collect(a, take)
        return a.ids

    def _launch(self, lane: int, reqs: list[Request], part: Optional[Part], take: Take) -> Optional[Ahead]:
        """The micro-batch's step launched on `lane` (part: its inputs, made here if None); None where its graph is
        not captured, or where the launch failed (its requests then fail)."""
        try:
            handle = self.decoder.launch(lane, part or self.inputs(reqs))
        except Exception as e:
            take(reqs, e)
            return None
        return None if handle is None else Ahead(reqs, lane, handle)

    def _collect(self, a: Ahead, take: Take) -> None:
        try:
            logits = self.decoder.collect(a.handle)
        except Exception as e:
            take(a.reqs, e)
            return
        take(a.reqs, logits)
