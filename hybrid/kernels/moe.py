"""The routed experts of one MoE layer on the CPU, fused (csrc/moe.cpp): Σ_k w·down(SiLU(gate(x))⊙up(x)).

Weights stay where the checkpoint put them (memory-mapped FP8, 128x128 block scales): the kernels read the
row-major [N, K] layout directly, so nothing is repacked and no second copy exists.
Legend: T tokens, D hidden, K experts per token.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from hybrid import _native
from hybrid.kernels.dispatch import kernel_name
from hybrid.kernels.view import view


def _prepare(x_TD, ids_TK, weights_TK, out_TD):
    """The types the native op takes (no copy when they already are), and an output if none is given."""
    x_TD = x_TD.to(torch.bfloat16).contiguous()
    ids_TK, weights_TK = ids_TK.contiguous(), weights_TK.to(torch.float32).contiguous()
    if out_TD is None:
        out_TD = torch.empty(x_TD.shape, dtype=torch.float32)
    return x_TD, ids_TK, weights_TK, out_TD


class CpuMoE:
    """`nodes`: each expert's NUMA node, whose pool group runs its tasks (docs/design/numa.md); None: node 0."""

    def __init__(self, gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                 gate_scale: Sequence[torch.Tensor] = (), up_scale: Sequence[torch.Tensor] = (),
                 down_scale: Sequence[torch.Tensor] = (), kernel: str = "auto", nodes: Optional[Sequence[int]] = None):
        self._keep = [list(t) for t in (gate, up, down, gate_scale, up_scale, down_scale)]  # the C++ holds addresses
        self.kernel = kernel
        self._op = _native.MoELayer(*[[view(t) for t in ts] for ts in
                                      (gate, gate_scale, up, up_scale, down, down_scale)])
        self._inflight: Optional[tuple] = None
        if nodes is not None:
            self.nodes = nodes

    @property
    def nodes(self) -> list[int]:
        return self._op.nodes

    @nodes.setter
    def nodes(self, nodes: Sequence[int]) -> None:
        self._op.nodes = [int(n) for n in nodes]

    @property
    def node_bytes(self) -> list[int]:
        """The last call's expert weight bytes (and scales) read by each group of the pool's threads: per NUMA node
        under policy.cpu.numa, one entry on a plain pool."""
        return self._op.group_bytes

    def trace(self, on: bool = True) -> None:
        """While on, each call records who ran each of its tasks (`take_trace`): a debugging aid."""
        self._op.set_trace(on)

    def take_trace(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """The last call's tasks: (expert, stage (0 gate/up, 1 down), first row, end row, the thread's pool group,
        its worker index (-1: the caller), the CPU it ran on)."""
        return self._op.take_trace()

    def submit(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
               out_TD: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Start the layer on the CPU threads and return at once; `wait()` before reading the result."""
        x_TD, ids_TK, weights_TK, out_TD = _prepare(x_TD, ids_TK, weights_TK, out_TD)
        self._op.submit(view(x_TD), view(ids_TK), view(weights_TK), view(out_TD), kernel_name(self.kernel))
        self._inflight = (x_TD, ids_TK, weights_TK, out_TD)  # alive until wait(); only once accepted: a refused
        return out_TD                                           # submit must not drop a running call's tensors

    def __del__(self):
        # Join a submitted call before the weights in _keep go: the native op's own destructor runs too late.
        op = getattr(self, "_op", None)
        if op is not None:
            op.wait()

    def wait(self) -> torch.Tensor:
        self._op.wait()
        out = self._inflight[3] if self._inflight else None
        self._inflight = None
        return out

    def __call__(self, x_TD, ids_TK, weights_TK, out_TD=None) -> torch.Tensor:
        """Synchronous: the calling thread works alongside the pool's workers."""
        x_TD, ids_TK, weights_TK, out_TD = _prepare(x_TD, ids_TK, weights_TK, out_TD)
        self._op.forward(view(x_TD), view(ids_TK), view(weights_TK), view(out_TD), kernel_name(self.kernel))
        return out_TD

    def twin(self) -> "CpuMoE":
        """Another op over the same weights (nothing copied) with call state of its own: while this op's call is
        pending, the twin's may be submitted too (a second decode lane); the thread pool runs them in turn."""
        return CpuMoE(*self._keep, kernel=self.kernel, nodes=self.nodes)

    def host_job(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 out_TD: torch.Tensor, signal: Optional[torch.Tensor] = None) -> "_native.HostJob":
        """A call over these fixed buffers that a CUDA stream runs as host functions (`_native.host_submit_fn`
        then `_native.host_wait_fn`, with `job.address`): the buffers must stay alive and in place as long as the
        job is used. Arguments are checked when the job runs; an error is left in `job.error`. `signal` (one int32,
        alive as long as the job): set to 0 when the call is submitted and to 1 once it is complete (or refused), so
        that a stream can wait for it instead of a `host_wait_fn`."""
        if signal is not None and (signal.dtype != torch.int32 or signal.numel() != 1 or signal.device.type != "cpu"):
            raise ValueError("host_job: signal must be one int32 in host memory")
        for name, t, dtype in (("x", x_TD, torch.bfloat16), ("ids", ids_TK, torch.int64),
                               ("weights", weights_TK, torch.float32), ("out", out_TD, torch.float32)):
            if t.dtype != dtype:
                raise ValueError(f"host_job: {name} must be {dtype}, got {t.dtype}")
            if not t.is_contiguous():
                raise ValueError(f"host_job: {name} must be contiguous (the job keeps its address)")
        return _native.HostJob(self._op, view(x_TD), view(ids_TK), view(weights_TK), view(out_TD),
                               kernel_name(self.kernel), signal.data_ptr() if signal is not None else 0)

    @property
    def global_syncs(self) -> int:
        return self._op.global_syncs

    @property
    def wait_s(self) -> float:
        """The last call's threads' seconds, summed over them, spent waiting for another thread's task (an expert's
        gate/up rows before its down rows, its activations being prepared)."""
        return self._op.wait_s

    @property
    def tail_s(self) -> float:
        """The last call's threads' seconds, summed over them, between leaving the task list and the last thread's
        leaving: the layer's end, where threads run out of tasks at different times."""
        return self._op.tail_s

    @property
    def stage_s(self) -> dict[str, float]:
        """The last call's threads' seconds, summed over them, in each stage of the tasks: "prep" (an expert's
        activations gathered and packed for its kernels), "gate_up" (the gate and up GEMMs), "silu" (SiLU(gate) ⊙ up,
        written in the down GEMM's layout), "down" (the down GEMM) and "sums" (each token's weighted sum over its
        experts, taken by whoever finishes its last down rows)."""
        return self._op.stage_s


def set_moe_lag_rounds(rounds: int) -> None:
    """How many rounds of tasks (one per thread) an expert's down tasks are queued behind its gate/up tasks (default
    2; 1 was the order before, for side-by-side timing). The order of tasks changes no result."""
    _native.set_moe_lag_rounds(rounds)


def set_moe_longest_first(on: bool) -> None:
    """Queue the experts' tasks by token count, most first (True, the default: the layer's last tasks are the
    cheapest, so the threads run out of work closer together), or in expert order (False, the order before, for
    side-by-side timing). The order of tasks changes no result."""
    _native.set_moe_longest_first(bool(on))
