"""Expert parallelism for a context-parallel prefill: rank r owns a contiguous share of every MoE layer's routed
experts (`shard`), and only its share streams through its device (`owned_streaming`).

- SmallEP (`smallep`): every rank all-gathers the tokens (N·D per link), runs the router on all of them (replicated:
  the same picks everywhere), groups the rows by expert, computes only its own experts and sums them per token into
  a partial [N, D]; then one exchange of partial sums (each rank sends every other rank that rank's tokens' rows)
  and a local sum. Per-link traffic ~2·N·D, whatever the number of picks per token.
- EP (`ep`), to measure against: the router on each rank's own tokens; every (token, pick) row goes to the rank that
  owns its expert (~N·K·D/W per link), is computed and weighted there, and comes back.
The shared experts run on each rank's own tokens.

`sharded_moe` swaps every MoE module for a ShardedMoE around it for the duration of one prefill (a pass from
outside; the MoE module stays inside, so passes that look for it, like stream-loading, still find it).

Legend: T this rank's tokens, N all ranks' tokens, D hidden, K picks per token, P picks computed on this rank,
E experts.
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from hybrid.model.moe import MoE, RoutedExperts
from hybrid.parallel.group import Dist
from hybrid.prefill.pipeline import HostExpertLayer, Pipeline
from hybrid.prefill.slp import SWITCH_INTERVAL_S, StreamedExperts, StreamLoader

MODES = ("smallep", "ep")


def shard(n_experts: int, rank: int, world: int) -> range:
    """The experts rank `rank` owns: a contiguous share, the earlier ranks one more where they do not divide."""
    base, extra = divmod(n_experts, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class PhaseClock:
    """Seconds per phase, summed over calls. On a GPU each phase ends with a device synchronisation, which takes
    away some overlap: for benchmarks' splits only."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.seconds[phase] += time.perf_counter() - t0

    def sync(self) -> None:
        """Waits for the device's queued work (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class ShardedMoE(nn.Module):
    """A MoE layer whose routed experts are shared out over the ranks (`mode`: smallep | ep). `counts`: every
    rank's token count in this prefill. `local`, when set (owned_streaming), computes this rank's experts by their
    index within its share; else the MoE's own experts (the plain torch ones) are called with the global ids."""

    def __init__(self, moe: MoE, dist: Dist, mode: str, counts: Sequence[int], clock: Optional[PhaseClock] = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"expert parallelism is one of {', '.join(MODES)}, got {mode!r}")
        self.moe, self.dist, self.mode, self.counts, self.clock = moe, dist, mode, list(counts), clock
        self.owned = shard(moe.gate.args.n_routed_experts, dist.rank, dist.world)
        self.local: Optional[nn.Module] = None

    def _phase(self, name: str):
        return self.clock(name) if self.clock is not None else contextlib.nullcontext()

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.flatten(0, 1)
        routed_TD = self._smallep(x_TD) if self.mode == "smallep" else self._ep(x_TD)
        with self._phase("shared_experts"):
            shared_TD = self.moe.shared_experts(x_TD)
        return (routed_TD + shared_TD).view_as(x_BSD)

    def _smallep(self, x_TD: torch.Tensor) -> torch.Tensor:
        d = self.dist
        with self._phase("gather"):
            x_ND = d.all_gather_rows(x_TD, self.counts)
        with self._phase("experts"):
            weights_NK, ids_NK = self.moe.gate(x_ND)
            mine_NK = (ids_NK >= self.owned.start) & (ids_NK < self.owned.stop)
            tok_P, k_P = mine_NK.nonzero(as_tuple=True)
            y_PD = self._experts(x_ND[tok_P], weights_NK[tok_P, k_P], ids_NK[tok_P, k_P])
            partial_ND = torch.zeros(x_ND.shape, dtype=torch.float32, device=x_ND.device)
            partial_ND.index_add_(0, tok_P, y_PD.float())
        with self._phase("exchange"):
            return d.reduce_scatter_rows(partial_ND.to(x_TD.dtype), self.counts).to(x_TD.dtype)

    def _ep(self, x_TD: torch.Tensor) -> torch.Tensor:
        d, k = self.dist, self.moe.gate.args.num_experts_per_tok
        with self._phase("experts"):
            weights_TK, ids_TK = self.moe.gate(x_TD)
            bounds = torch.tensor([shard(self.moe.gate.args.n_routed_experts, r, d.world).stop
                                   for r in range(d.world)], device=ids_TK.device)
            owner_R = torch.bucketize(ids_TK.flatten(), bounds, right=True)  # R = T·K (token, pick) rows
            order_R = owner_R.argsort(stable=True)  # rows by owning rank
            tok_R = order_R // k
            sent = torch.bincount(owner_R, minlength=d.world).tolist()
        with self._phase("gather"):  # the dispatch: rows to the ranks owning their experts
            got_x = d.exchange(list(x_TD[tok_R].split(sent)))
            arrived = [g.shape[0] for g in got_x]
            got_ids = d.exchange(list(ids_TK.flatten()[order_R].split(sent)), arrived)
            got_w = d.exchange(list(weights_TK.flatten()[order_R].split(sent)), arrived)
        with self._phase("experts"):
            y_PD = self._experts(torch.cat(got_x), torch.cat(got_w), torch.cat(got_ids))
        with self._phase("exchange"):  # the results back, in the order their rows came
            back = d.exchange(list(y_PD.to(x_TD.dtype).split(arrived)), sent)
            out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
            out_TD.index_add_(0, tok_R, torch.cat(back).float())
        return out_TD.to(x_TD.dtype)

    def _experts(self, x_PD: torch.Tensor, w_P: torch.Tensor, ids_P: torch.Tensor) -> torch.Tensor:
        """w_P[p] · expert ids_P[p] (x_PD[p]): one pick per row, every one of this rank's share."""
        if self.local is not None:
            return self.local.start(x_PD, w_P[:, None], (ids_P - self.owned.start)[:, None]).result()
        from hybrid.placement.passes import CpuExperts

        experts = self.moe.experts
        if not isinstance(experts, (RoutedExperts, CpuExperts)):
            raise ValueError(f"expert parallelism computes its share of the experts streamed (owned_streaming), "
                             f"with the plain torch experts or on the CPU kernels, not {type(experts).__name__}")
        return experts.start(x_PD, w_P[:, None], ids_P[:, None]).result()


@contextlib.contextmanager
def sharded_moe(model: nn.Module, dist: Dist, mode: str, counts: Sequence[int],
                clock: Optional[PhaseClock] = None) -> Iterator[list[ShardedMoE]]:
    """Within the block, every MoE module of `model` runs as a ShardedMoE around it; put back after."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, MoE):
                swapped.append((parent, name, child))
    wrappers = [ShardedMoE(moe, dist, mode, counts, clock) for _, _, moe in swapped]
    for (parent, name, _), w in zip(swapped, wrappers):
        setattr(parent, name, w)
    try:
        yield wrappers
    finally:
        for parent, name, moe in swapped:
            setattr(parent, name, moe)


class OwnedExperts:
    """A MoE layer's host experts (HostExpertLayer, as placement leaves them) narrowed to one rank's share: its
    experts, and the slice of the pinned arena holding them (experts are slot_bytes apart)."""

    def __init__(self, layer: HostExpertLayer, owned: range):
        self.host_experts = nn.ModuleList(list(layer.host_experts)[owned.start:owned.stop])
        self.slot_bytes = layer.slot_bytes
        self.arena = (None if layer.arena is None
                      else layer.arena[owned.start * layer.slot_bytes:owned.stop * layer.slot_bytes])
        self.hot = None  # the resident experts are computed with the rest of the share


@contextlib.contextmanager
def owned_streaming(wrappers: list[ShardedMoE], device: torch.device, ring_len: int, budget_bytes: float,
                    group: int = 1, loader: Optional[StreamLoader] = None) -> Iterator[Pipeline]:
    """Within the block, each rank's share of every MoE layer's routed experts streams through its device's ring
    (stream-loading prefill, hybrid/prefill/slp.py, over half the experts with two ranks). The MoE layers must have
    their experts placed on the CPU kernels."""
    layers = []
    for w in wrappers:
        if not isinstance(w.moe.experts, HostExpertLayer):
            raise ValueError("streaming the experts needs them placed on the CPU kernels (experts_to_cpu_kernels)")
        layers.append(OwnedExperts(w.moe.experts, w.owned))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        with Pipeline(layers, device, ring_len, budget_bytes, group, loader) as pipe:
            try:
                for i, w in enumerate(wrappers):
                    w.local = StreamedExperts(pipe, i)
                yield pipe
            finally:
                for w in wrappers:
                    w.local = None
    finally:
        sys.setswitchinterval(switch)
