"""Stream-loading prefill (SLP): the whole prefill runs on the compute device while the routed experts stream
through it from pinned host memory, one expert at a time, through the ring buffer (hybrid/prefill/ring.py).
The loader and unloader threads, the ring and the streamed experts' GEMMs: hybrid/prefill/pipeline.py.

A `StreamLoader`, one per engine, runs the prefills (`streaming`): it keeps the last one's ring for the next,
remembers where grouped GEMMs failed, and holds the kernels' configuration (the FP8 GEMM, the combine's Triton pass).

Legend: T tokens, D hidden, K experts per token.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
from typing import Iterator, Optional

import torch
from torch import nn

from hybrid.model.moe import Done, MoE
from hybrid.prefill.pipeline import HostExpertLayer, Pipeline
from hybrid.prefill.ring import Ring
from hybrid.prefill.throttle import Throttle
from hybrid.kernels.combine import combine
from hybrid.kernels.fp8_linear import DEFAULT_GEMM, Fp8Gemm


# The loader and unloader need the GIL for a moment per expert while the model thread launches kernels; at
# Python's default 5 ms switch interval a hand-off can wait longer than an expert's copy takes (~0.8 ms).
SWITCH_INTERVAL_S = 2e-4


class StreamLoader:
    """Runs stream-loading prefills (`streaming`), one at a time: the last one's ring is kept for the next one of
    the same shape, and where a grouped GEMM failed it is not tried again. `gemm`: the streamed experts' FP8 GEMM;
    `fused_combine`: their outputs summed by the Triton pass on a GPU (False where it failed to compile)."""

    def __init__(self, gemm: Fp8Gemm = DEFAULT_GEMM, fused_combine: bool = True):
        self.gemm, self.fused_combine = gemm, fused_combine
        self.kept: Optional[Ring] = None  # the last prefill's ring
        self.no_grouped_gemm: set = set()  # (device type, dtype) where torch._grouped_mm is missing or failed

    def kept_ring_bytes(self, device: torch.device) -> int:
        """Device memory the kept ring holds: the next prefill gets it back (reused or let go), so budgets count it
        as free."""
        ring = self.kept
        return ring.memory.numel() if ring is not None and torch.device(ring.device) == torch.device(device) else 0

    def take_ring(self, ring_len: int, fields, slot_bytes: int, device: torch.device, budget_bytes: float) -> Ring:
        """The ring for a prefill: the kept one when it has the same shape (its memory and slot views made once),
        else a new one (the kept one is let go first, so both are never held)."""
        ring, self.kept = self.kept, None
        if (ring is not None and ring.fits(ring_len, fields, slot_bytes, device)
                and ring_len * slot_bytes <= budget_bytes):
            ring.reset()
            return ring
        del ring
        return Ring(ring_len, fields, slot_bytes, device, budget_bytes)

    def keep_ring(self, ring: Ring) -> None:
        """A prefill's ring, once the device is done with it: the next prefill's."""
        self.kept = ring

    def grouped_gemm_applies(self, x: torch.Tensor) -> bool:
        """Whether experts can go in groups for activations like x (see grouped_gemm_missing); says why, once, when
        not."""
        if (x.device.type, x.dtype) in self.no_grouped_gemm:
            return False
        why = grouped_gemm_missing(x.device, x.dtype)
        return True if why is None else self.grouped_gemm_failed(x, why)

    def grouped_gemm_failed(self, x: torch.Tensor, why: str) -> bool:
        """No grouped GEMM for activations like x from now on, with a warning; False."""
        self.no_grouped_gemm.add((x.device.type, x.dtype))
        warnings.warn(f"stream-loading prefill: no grouped GEMM for {x.dtype} on {x.device.type} ({why}); "
                      "policy.prefill.slp_group_experts falls back to one expert at a time", stacklevel=3)
        return False

    @contextlib.contextmanager
    def streaming(self, model: nn.Module, device: torch.device, ring_len: int, budget_bytes: float,
                  group: int = 1, gemm: Optional[Fp8Gemm] = None,
                  throttle: Optional[Throttle] = None,
                  cancel: Optional[threading.Event] = None) -> Iterator[Pipeline]:
        """A pipeline streaming the model's routed experts through the device (the model must have been placed with
        experts on the CPU kernels); the model runs with them when called with `experts=pipe.experts` (the model
        itself is not changed: decode may go on with its own experts meanwhile). Up to `group` experts already on
        the device are computed together; `gemm` for this prefill instead of the loader's (benchmarks);
        `throttle` paces the copies and `cancel`, once set, ends the prefill at its next expert with
        PrefillCancelled (prefill beside decode)."""
        moes = {i: block.mlp for i, block in enumerate(model.model.layers)
                if isinstance(block.mlp, MoE) and isinstance(block.mlp.experts, HostExpertLayer)}
        if not moes:
            raise ValueError("stream-loading prefill needs the routed experts placed on the CPU kernels")
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            with Pipeline([m.experts for m in moes.values()], device, ring_len, budget_bytes, group, self, gemm,
                          throttle, cancel) as pipe:
                pipe.experts = {i: StreamedExperts(pipe, j) for j, i in enumerate(moes)}
                yield pipe
        finally:
            sys.setswitchinterval(switch)


def grouped_gemm_missing(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why experts cannot go in groups on `device` for `dtype` activations, or None when they can: torch has a
    native grouped GEMM for them (torch >= 2.8; on CUDA, BF16 on Hopper, compute capability 9.x — elsewhere torch
    loops over the groups with a device->host read of the offsets, which would stall the loader, or on 10.x before
    torch 2.13 may fail to launch)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (needs >= 2.8)"
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        if dtype != torch.bfloat16 or major != 9:
            return f"{dtype} on compute capability {major}.x: no native grouped GEMM used here (BF16 on 9.x is)"
    return None


class StreamedExperts(nn.Module):
    """RoutedExperts' interface for one MoE layer during SLP: every expert comes through the pipeline in turn."""

    def __init__(self, pipeline: Pipeline, layer: int):
        super().__init__()
        self.pipeline, self.layer = pipeline, layer

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> Done:
        p, k = self.pipeline, ids_TK.shape[1]
        # Rows grouped by expert once per layer, on the device; one device->host read per layer (the counts, through
        # pinned memory). No host->device copy here: it would queue behind the loader's expert copies.
        flat = ids_TK.flatten()
        order = flat.argsort(stable=True)
        counts_dev = torch.zeros(p.n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # torch.bincount would read its max back (a sync)
        hot = p.layers[self.layer].hot
        if hot is not None:  # the routing statistics that choose the GPU-resident experts
            hot.observe_counts(counts_dev)
        counts = p.host_counts(counts_dev)
        x_RD = x_TD[order // k]  # R = T·K rows, expert by expert
        y_RD = torch.empty_like(x_RD)
        e = start = 0
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        while e < len(counts):
            p.breathe()
            slots = p.take_group(self.layer, e, len(counts))
            ns = counts[e:e + len(slots)]
            live = [n > 0 for n in ns]
            end = start + sum(ns)
            grouped = sum(live) > 1 and p.loader.grouped_gemm_applies(x_RD)
            if grouped:
                try:
                    p.grouped(slots, counts_dev[e:e + len(slots)], live, x_RD[start:end], y_RD[start:end])
                except torch.cuda.OutOfMemoryError:
                    raise
                except (RuntimeError, NotImplementedError) as err:
                    p.loader.grouped_gemm_failed(x_RD, str(err))
                    grouped = False
            if not grouped:
                at = start
                for slot, n in zip(slots, ns):
                    if n:
                        rows = slice(at, at + n)
                        p.linear(slot, "down_proj", p.activation(slot, x_RD[rows]), out=y_RD[rows])
                    at += n
            p.give_back(slots, [(self.layer, e + j) for j in range(len(slots))])
            p.group_sizes.append(len(slots))
            e, start = e + len(slots), end
        p.expert_loop_s += time.perf_counter() - wall0
        p.expert_loop_cpu_s += time.thread_time() - cpu0
        row_R = torch.empty_like(order)  # where each (token, pick) landed among the rows
        row_R[order] = torch.arange(len(order), device=order.device)
        return Done(combine(y_RD, row_R.view(ids_TK.shape), weights_TK, x_TD.dtype, p.loader.fused_combine))

    def forward(self, x_TD, weights_TK, ids_TK) -> torch.Tensor:
        return self.start(x_TD, weights_TK, ids_TK).result()
