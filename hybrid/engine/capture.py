"""How a graphed decode step hands its routed experts to the CPU (hybrid/engine/cuda_graphs.py): the CUDA driver's
host functions and stream waits, the two capture forms (`hostfn`: host nodes in one graph; `segments`: the step cut
into graphs at each hand-off, the CPU call run from Python between them), the CPU experts as a capture records them,
and the interleaving of two micro-batches' segments."""
from __future__ import annotations

import ctypes
import functools
from typing import Callable, ContextManager, Sequence

import torch

from hybrid import _native
from hybrid.placement.passes import CpuExperts, DeferredCpuExperts, ExpertsWrapper


class HostFunctions:
    """From the CUDA driver: cuLaunchHostFunc (enqueue a native host function, an address, on the current stream)
    and cuStreamWaitValue32 (the current stream waits until a 32-bit word, here of pinned host memory, equals a
    value; captured into a graph as a memory-operation node)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")  # the driver is loaded once per process by ctypes
        fn = lib.cuLaunchHostFunc
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        self._launch = fn
        wait = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32", None)
        if wait is not None:
            wait.argtypes, wait.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint], \
                ctypes.c_int
        self._wait = wait

    def launch(self, fn: int, arg: int) -> None:
        rc = self._launch(torch.cuda.current_stream().cuda_stream, fn, arg)
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {rc})")

    def wait_value(self, word: torch.Tensor, value: int) -> int:
        """The current stream waits until `word` (one int32 of pinned memory: its address is valid on the GPU under
        unified addressing) equals `value`; the CUresult (0: queued)."""
        if self._wait is None:
            return -1
        return self._wait(torch.cuda.current_stream().cuda_stream, word.data_ptr(), value, 0)  # 0: ..._WAIT_VALUE_EQ


@functools.lru_cache(maxsize=None)
def stream_waits(device: torch.device) -> bool:
    """Whether a stream on `device` can wait for a word of pinned host memory, also inside a CUDA graph (tried once
    per process, on a word that already holds the value)."""
    word, host = torch.ones(1, dtype=torch.int32).pin_memory(), HostFunctions()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        if host.wait_value(word, 1) != 0:
            return False
    side.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)  # and inside a graph
    try:
        with torch.cuda.stream(side):
            graph.capture_begin()
            try:
                rc = host.wait_value(word, 1)
            finally:
                graph.capture_end()
        graph.replay()
        side.synchronize()
    except RuntimeError:
        return False
    return rc == 0


_host_call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # a native host function called from Python (segments)
_submit, _wait = _host_call(_native.host_submit_fn), _host_call(_native.host_wait_fn)


def join_on_host(job) -> None:
    """Waits on this thread for a native MoE job handed over in a graph."""
    _wait(job.address)


class HostFnCapture:
    """`hostfn`: one graph; the hand-off is a host node submitting the CPU op before the work that overlaps it,
    and a join after: the stream waiting for the op's signal word (`signal`), or a host node (`host`)."""

    def __init__(self, pool, join: str = "host"):
        self.host, self.jobs, self.join = HostFunctions(), [], join
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=pool)

    def handoff_start(self, op, x_h, ids_h, w_h, out_h):
        signal = torch.zeros(1, dtype=torch.int32, pin_memory=True) if self.join == "signal" else None
        job = op.host_job(x_h, ids_h, w_h, out_h, signal=signal)
        self.jobs.append((job, op, signal))  # the op (and the weights it holds) lives as long as the graph
        self.host.launch(_native.host_submit_fn, job.address)
        return job, signal

    def handoff_end(self, handoff) -> None:
        job, signal = handoff
        if signal is None:
            self.host.launch(_native.host_wait_fn, job.address)
            return
        rc = self.host.wait_value(signal, 1)
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc}): policy.decode.cpu_join=host")

    def finish(self) -> list[Callable[[], None]]:
        self.graph.capture_end()
        return [self.graph.replay]


class SegmentCapture:
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
        self.jobs.append((job, op, None))
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
        self.steps.append(CpuStep(cpu_moe))
        self._open()

    def finish(self) -> list[Callable[[], None]]:
        self._close()
        return self.steps


class CapturedExperts(ExpertsWrapper):
    """A layer's CPU experts while a graph is captured (swapped in for the capture only): the inputs go into the
    fixed staging buffers without synchronising, and the hand-off is the capture's (`handoff_start` /
    `handoff_end`: host nodes, or a cut between graphs)."""

    def __init__(self, layer: CpuExperts, capture, op=None):
        if isinstance(layer, DeferredCpuExperts):
            raise ValueError("CUDA graphs need policy.cpu.deferred_experts=0")
        super().__init__(layer)
        self.capture, self.op = capture, op if op is not None else layer.op

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> "_Captured":
        layer = self.layer
        s = layer.stage(x_TD, weights_TK, ids_TK, sync=False)
        out_h = layer.staging.out(s.x_h.shape[0], fixed=True)
        handoff = self.capture.handoff_start(self.op, s.x_h, s.ids_h, s.w_h, out_h)
        return _Captured(self, handoff, out_h, s.x_TD, layer.resident(s))


class _Captured:
    def __init__(self, experts: CapturedExperts, handoff, out_h: torch.Tensor, like: torch.Tensor, hot_TD=None):
        self.experts, self.handoff, self.out_h, self.like, self.hot_TD = experts, handoff, out_h, like, hot_TD

    def result(self) -> torch.Tensor:
        self.experts.capture.handoff_end(self.handoff)
        return self.experts.layer.join(self.out_h, self.like, self.hot_TD)


class CpuStep:
    """A step that runs on the CPU and returns when done (the routed experts of a graph segment's hand-off): where
    interleaved decode steps switch to the other micro-batch."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


def interleave(lanes: Sequence[tuple[Callable[[], ContextManager], Sequence[Callable[[], None]]]]) -> None:
    """Runs every lane's steps in its own order, switching lanes at each CPU step (dual-batch overlap). A lane's
    steps up to its next CPU step are GPU work, enqueued within its context (its stream) without waiting; then the
    next lane's. A lane's CPU step blocks, and meanwhile the GPU works through what the other lanes enqueued:

        A: gpu0 | B: gpu0 | A: cpu0, gpu1 | B: cpu0, gpu1 | A: cpu1, gpu2 | ...

    so the CPU computes A's experts while the GPU runs B's attention, and the other way round. One CPU step at a
    time: the native MoE op of a layer serves both micro-batches in turn."""
    at = [0] * len(lanes)

    def enqueue(i: int) -> None:
        context, steps = lanes[i]
        with context():
            while at[i] < len(steps) and not isinstance(steps[at[i]], CpuStep):
                steps[at[i]]()
                at[i] += 1

    for i in range(len(lanes)):
        enqueue(i)
    while any(a < len(steps) for a, (_, steps) in zip(at, lanes)):
        for i, (_, steps) in enumerate(lanes):
            if at[i] < len(steps):
                steps[at[i]]()  # a CPU step: the lane's previous GPU work is what it waits for
                at[i] += 1
                enqueue(i)
