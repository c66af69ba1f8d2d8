"""CUDA graphs over the hybrid decode step, the CPU MoE hand-off included (`policy.decode.cuda_graphs`).

Eager decode is launch-bound at small batches: an MLA layer is dozens of small kernels. A graph replays a whole
step's kernels with one launch. The routed experts run on the CPU in the middle of every MoE layer, and two ways of
putting that hand-off in a graph are built (the decode bench measures both against eager):

- `hostfn`: ONE graph per step. Each MoE layer's CPU call becomes two host nodes (cuLaunchHostFunc, as
  KTransformers does): the first starts the native MoE op on the thread pool over the pinned staging buffers the
  graph has just copied the router's output into, and returns at once; the shared expert's kernels follow on the
  GPU; the second host node joins the CPU op, after which the graph copies the experts' output back. No Python
  runs during a step.
- `segments`: the step cut at every hand-off into graphs (before the hand-off / the shared expert / after it);
  Python replays them in turn and runs the CPU op between them, after the first graph's copies are done.

Shapes must be static inside a graph, so there is one graph per (batch size, KV-length bucket): attention reads
the cache up to the bucket (`kv_bucket`: at most 1/4 past the longest sequence) and masks the positions past each
token, as it already does for sequences of different lengths. Graphs are captured lazily (a warm-up step, then the
capture; for its duration each MoE layer's CPU experts are swapped for `CapturedExperts`, which records the
hand-off) and share one memory pool; they are replayed one at a time on one stream. A step whose capture fails runs
eagerly (with a warning), and so does every later step of that shape.

Legend: B batch (sequences), V vocabulary.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid import _native
from hybrid.engine.placement import CpuExperts, DeferredCpuExperts, ExpertsWrapper, cpu_experts, swap_experts
from hybrid.engine.staging import Staging
from hybrid.model.kv_cache import KVCache
from hybrid.model.transformer import Transformer

MODES = ("off", "hostfn", "segments")
MIN_BUCKET = 256
BUCKETS_PER_OCTAVE = 8


def kv_bucket(kv_len: int, max_context: int) -> int:
    """The KV length a graph is captured for: kv_len rounded up to a multiple of an eighth of the next power of two
    (at least MIN_BUCKET), capped at the cache's length — attention reads at most 1/4 more positions than it needs
    (past MIN_BUCKET), and a 32K cache needs 24 graphs per batch size."""
    if not 1 <= kv_len <= max_context:
        raise ValueError(f"kv_len {kv_len} outside 1..{max_context} (policy.kv.max_context)")
    step = max(MIN_BUCKET, (1 << (kv_len - 1).bit_length()) // BUCKETS_PER_OCTAVE)
    return min(max_context, -(-kv_len // step) * step)


class HostFunctions:
    """cuLaunchHostFunc from the CUDA driver: enqueue a native host function (an address) on the current stream."""

    def __init__(self):
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc  # the driver is loaded once per process by ctypes
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        self._launch = fn

    def launch(self, fn: int, arg: int) -> None:
        rc = self._launch(torch.cuda.current_stream().cuda_stream, fn, arg)
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {rc})")


_host_call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # a native host function called from Python (segments)
_submit, _wait = _host_call(_native.host_submit_fn), _host_call(_native.host_wait_fn)


class _HostFnCapture:
    """`hostfn`: one graph; the hand-off is a pair of host nodes around the work that overlaps it."""

    def __init__(self, pool):
        self.host, self.jobs = HostFunctions(), []
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=pool)

    def handoff_start(self, op, x_h, ids_h, w_h, out_h):
        job = op.host_job(x_h, ids_h, w_h, out_h)
        self.jobs.append((job, op))  # the op (and the weights it holds) lives as long as the graph
        self.host.launch(_native.host_submit_fn, job.address)
        return job

    def handoff_end(self, job) -> None:
        self.host.launch(_native.host_wait_fn, job.address)

    def finish(self) -> list[Callable[[], None]]:
        self.graph.capture_end()
        return [self.graph.replay]


class _SegmentCapture:
    """`segments`: a graph up to each hand-off's copies, one for the work that overlaps the CPU, one after."""

    def __init__(self, pool):
        self.pool, self.jobs, self.steps = pool, [], []  # the steps' bound replay methods keep the graphs alive
        self._open()

    def _open(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def _close(self) -> None:
        self.graph.capture_end()
        self.steps.append(self.graph.replay)

    def handoff_start(self, op, x_h, ids_h, w_h, out_h):
        job = op.host_job(x_h, ids_h, w_h, out_h)
        self.jobs.append((job, op))
        staged = torch.cuda.Event()
        self._close()
        self.steps.append(staged.record)
        self._open()
        return job, staged

    def handoff_end(self, handoff) -> None:
        job, staged = handoff
        self._close()

        def cpu_moe() -> None:  # after the overlapping graph is launched: wait for the copies, run the CPU op
            staged.synchronize()
            _submit(job.address)
            _wait(job.address)
        self.steps.append(cpu_moe)
        self._open()

    def finish(self) -> list[Callable[[], None]]:
        self._close()
        return self.steps


class CapturedExperts(ExpertsWrapper):
    """A layer's CPU experts while a graph is captured (swapped in for the capture only): the inputs go into the
    fixed staging buffers without synchronising, and the hand-off is the capture's (`handoff_start` /
    `handoff_end`: host nodes, or a cut between graphs)."""

    def __init__(self, layer: CpuExperts, capture):
        if isinstance(layer, DeferredCpuExperts):
            raise ValueError("CUDA graphs need policy.cpu.deferred_experts=0")
        super().__init__(layer)
        self.capture = capture

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> "_Captured":
        layer = self.layer
        s = layer.stage(x_TD, weights_TK, ids_TK, sync=False)
        out_h = layer.staging.out(s.x_h.shape[0], fixed=True)
        handoff = self.capture.handoff_start(layer.op, s.x_h, s.ids_h, s.w_h, out_h)
        return _Captured(self, handoff, out_h, s.x_TD, layer.resident(s))


class _Captured:
    def __init__(self, experts: CapturedExperts, handoff, out_h: torch.Tensor, like: torch.Tensor, hot_TD=None):
        self.experts, self.handoff, self.out_h, self.like, self.hot_TD = experts, handoff, out_h, like, hot_TD

    def result(self) -> torch.Tensor:
        self.experts.capture.handoff_end(self.handoff)
        return self.experts.layer.join(self.out_h, self.like, self.hot_TD)


@dataclass
class _Graph:
    steps: list[Callable[[], None]]
    logits: torch.Tensor
    jobs: list  # (native job, CpuMoE) per MoE layer


class GraphedDecode:
    """decode(tokens_B1, pos_B1, slots_B, kv_len) -> logits_BV through captured graphs (same result as
    `model(...)[:, -1]`)."""

    def __init__(self, model: Transformer, cache: KVCache, staging: Staging, mode: str, max_batch: int):
        if mode not in MODES[1:]:
            raise ValueError(f"policy.decode.cuda_graphs must be one of {MODES}, got {mode!r}")
        if any(isinstance(layer, DeferredCpuExperts) for layer in cpu_experts(model)):
            raise ValueError("CUDA graphs need policy.cpu.deferred_experts=0")
        self.model, self.cache, self.staging, self.mode = model, cache, staging, mode
        self.device = next(model.parameters()).device
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.eager: set[tuple[int, int]] = set()  # shapes whose capture failed
        self.pool = torch.cuda.graph_pool_handle()
        staging.reserve(max_batch)

    def __call__(self, tokens_B1: torch.Tensor, pos_B1: torch.Tensor, slots_B: torch.Tensor,
                 kv_len: int, capture: bool = True) -> torch.Tensor:
        """One decode step, replaying the graph of its shape; a shape not captured yet is captured first, or with
        `capture` False (another thread is using the GPU: a capture would catch its calls) runs eagerly this time."""
        b = tokens_B1.shape[0]
        key = (b, kv_bucket(kv_len, self.cache.max_context))
        tokens, pos, slots = self._inputs(b)
        tokens.copy_(tokens_B1, non_blocking=True)
        pos.copy_(pos_B1, non_blocking=True)
        slots.copy_(slots_B, non_blocking=True)
        if key in self.eager:
            return self._run(b, key[1])  # at the graphs' KV length: the same numbers as a replay
        graph = self.graphs.get(key)
        if graph is None and not capture:
            return self._run(b, key[1])  # at the graphs' KV length: the same numbers as a replay
        if graph is None:
            try:
                graph = self._capture(*key)
            except RuntimeError as e:  # e.g. an operation CUDA graphs cannot hold: this shape runs eagerly
                print(f"warning: decode step of batch {b}, KV length {key[1]} runs eagerly: CUDA graph capture "
                      f"failed ({str(e).splitlines()[0]})", file=sys.stderr)
                self.eager.add(key)
                return self._run(b, key[1])  # at the graphs' KV length: the same numbers as a replay
        for step in graph.steps:
            step()
        torch.cuda.current_stream().synchronize()  # the sampler reads the logits next anyway
        failed = [job for job, _ in graph.jobs if job.error]
        if failed:
            errors = [job.error for job in failed]
            for job in failed:  # seen: the jobs run again next step
                job.error = ""
            raise RuntimeError("CPU experts in a graphed decode step: " + "; ".join(errors))
        return graph.logits

    def jobs(self) -> list:
        """The native jobs of every captured graph (their own timings: cpu_s, calls)."""
        return [job for g in self.graphs.values() for job, _ in g.jobs]

    def _inputs(self, b: int):
        if b not in self.inputs:
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=self.device)  # noqa: E731
            self.inputs[b] = (zeros(b, 1), zeros(b, 1), torch.arange(b, device=self.device))
        return self.inputs[b]

    def _run(self, b: int, kv_len: int) -> torch.Tensor:
        tokens, pos, slots = self.inputs[b]
        return self.model(tokens, pos, self.cache, slots, kv_len=kv_len)[:, -1]

    def _capture(self, b: int, kv_len: int) -> _Graph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(b, kv_len)  # warm-up (lazy initialisation must not happen during capture)
            side.synchronize()
            capture = (_HostFnCapture if self.mode == "hostfn" else _SegmentCapture)(self.pool)
            try:
                _, restore = swap_experts(self.model, lambda layer: CapturedExperts(layer, capture))
                try:
                    logits = self._run(b, kv_len)
                finally:
                    restore()
            except BaseException:
                with contextlib.suppress(Exception):  # end the capture; the first error is the one to report
                    capture.finish()
                raise
            steps = capture.finish()
        torch.cuda.current_stream().wait_stream(side)
        graph = _Graph(steps, logits, capture.jobs)
        self.graphs[(b, kv_len)] = graph
        return graph
