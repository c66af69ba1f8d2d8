"""Process groups for multi-device prefill: one process per device, NCCL between GPUs, gloo where there are none
(the CPU stand-in that CI runs). `Dist` is the communication the parallel passes (cp.py, smallep.py) are handed;
nothing else in them knows how ranks talk.

Rows: every collective here moves tensors along their first dimension, each rank holding its own number of rows
(a prompt split in two need not split evenly).

    run_ranks(fn, 2, args)   # fn(dist, *args) in two spawned processes; their return values, by rank
"""
from __future__ import annotations

import contextlib
import datetime
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


COLLECTIVE_TIMEOUT_S = 300  # a prefill's collectives take seconds; this long means a peer is gone


@dataclass(frozen=True)
class Dist:
    """This process's place in the group: its rank, the number of ranks, the device its tensors live on."""
    rank: int
    world: int
    device: torch.device

    @property
    def peers(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]

    def row_counts(self, n: int) -> list[int]:
        """Every rank's row count, given this one's."""
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [int(c) for c in torch.cat(out).tolist()]

    def all_gather_rows(self, x: torch.Tensor, counts: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Every rank's rows of x, rank after rank (`counts`: each rank's row count, when known)."""
        counts = list(counts) if counts is not None else self.row_counts(x.shape[0])
        if counts[self.rank] != x.shape[0]:
            raise ValueError(f"rank {self.rank} holds {x.shape[0]} rows, the counts say {counts[self.rank]}")
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:x.shape[0]] = x
        out = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(out, padded.contiguous())
        return torch.cat([part[:n] for part, n in zip(out, counts)])

    def exchange(self, parts: Sequence[torch.Tensor], incoming: Optional[Sequence[int]] = None) -> list[torch.Tensor]:
        """All-to-all of rows: parts[r] goes to rank r; returns what each rank sent this one (this rank's own part
        stays as it is). `incoming`: the row count each rank sends this one, when known (else exchanged first).
        Point-to-point sends, so every link carries only its own rows."""
        if len(parts) != self.world:
            raise ValueError(f"exchange needs one part per rank ({self.world}), got {len(parts)}")
        if incoming is None:
            sent = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64, device=self.device)
            table = [torch.empty_like(sent) for _ in range(self.world)]
            dist.all_gather(table, sent)
            incoming = [int(t[self.rank]) for t in table]
        like = parts[self.rank]
        got = [parts[r] if r == self.rank else like.new_empty((incoming[r], *like.shape[1:]))
               for r in range(self.world)]
        ops = [dist.P2POp(dist.isend, parts[r].contiguous(), r) for r in self.peers if parts[r].shape[0]]
        ops += [dist.P2POp(dist.irecv, got[r], r) for r in self.peers if incoming[r]]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return got

    def reduce_scatter_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x holds every rank's rows (counts[r] of them for rank r, rank after rank); returns this rank's rows
        summed over all ranks' x, in FP32. One exchange: each rank sends every other rank only that rank's rows."""
        if sum(counts) != x.shape[0]:
            raise ValueError(f"reduce-scatter of {x.shape[0]} rows by counts {list(counts)}")
        got = self.exchange(list(x.split(list(counts))), [counts[self.rank]] * self.world)
        out = got[0].to(torch.float32, copy=True)
        for part in got[1:]:  # in rank order
            out += part.float()
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """x as rank `src` holds it (every rank passes a tensor of the same shape and dtype)."""
        x = x.contiguous()
        dist.broadcast(x, src)
        return x

    def barrier(self) -> None:
        dist.barrier()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(rank: int, device_type: str) -> torch.device:
    """Rank r's device: GPU r, or the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


@contextlib.contextmanager
def process_group(rank: int, world: int, init_file: str, device: torch.device) -> Iterator[Dist]:
    """This process joined to the group (rendezvous through `init_file`, a path no earlier group used), left again
    at the end."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # a peer that died fails the collectives within minutes, not the backends' default half hour
    dist.init_process_group(backend_for(device), init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        yield Dist(rank, world, device)
    finally:
        dist.destroy_process_group()


def _entry(rank: int, fn: Callable, world: int, tmp: str, device_type: str, threads: int, args: tuple) -> None:
    torch.set_num_threads(threads)
    with process_group(rank, world, str(Path(tmp) / "rendezvous"), rank_device(rank, device_type)) as d:
        out = fn(d, *args)
    torch.save(out, Path(tmp) / f"rank{rank}.pt")  # a file, not a queue: shared tensors die with their process


def run_ranks(fn: Callable[..., Any], world: int, args: tuple = (), device_type: str = "cpu",
              threads: int = 1) -> list[Any]:
    """fn(dist, *args) in `world` spawned processes (fn and args picklable: fn a module-level function); returns
    what each returned, by rank. A rank's exception is raised here. `threads`: torch's intra-op threads per
    process (ranks sharing a CPU should not each take every core)."""
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks on GPUs need {world} GPUs; torch sees {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="hybrid-group-") as tmp:
        mp.start_processes(_entry, args=(fn, world, tmp, device_type, threads, args), nprocs=world, join=True,
                           start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
