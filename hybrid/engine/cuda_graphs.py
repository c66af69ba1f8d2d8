"""CUDA graphs over the hybrid decode step, the CPU MoE hand-off included (`policy.decode.cuda_graphs`).

Eager decode is launch-bound at small batches: an MLA layer is dozens of small kernels. A graph replays a whole
step's kernels with one launch. The routed experts run on the CPU in the middle of every MoE layer, and two ways of
putting that hand-off in a graph are built (the decode bench measures both against eager):

- `hostfn`: ONE graph per step. Each MoE layer's CPU call starts with a host node (cuLaunchHostFunc, as
  KTransformers does) that submits the native MoE op to the thread pool over the pinned staging buffers the graph
  has just copied the router's output into, and returns at once; the shared expert's kernels follow on the GPU;
  then the graph joins the CPU op (`policy.decode.cpu_join`): `signal`, the stream waits for a word of pinned
  memory that the op's last worker sets (cuStreamWaitValue32: no host thread waits); `host`, a second host node
  joins it. Then the experts' output is read back. No Python runs during a step.
- `segments`: the step cut at every hand-off into graphs (before the hand-off / the shared expert / after it);
  Python replays them in turn and runs the CPU op between them, after the first graph's copies are done.

Shapes must be static inside a graph, so there is one graph per (batch size, KV-length bucket): attention reads
the cache up to the bucket (`kv_bucket`: at most 1/4 past the longest sequence) and masks the positions past each
token, as it already does for sequences of different lengths. Graphs are captured lazily (a warm-up step, then the
capture; for its duration each MoE layer's CPU experts are swapped for `CapturedExperts`, which records the
hand-off) and share one memory pool; they are replayed one at a time on one stream. A step whose capture fails runs
eagerly (with a warning), and so does every later step of that shape. While a prompt is prefilled beside decode no
graph may be captured (the capture would catch the prefill's kernels), so every step that may capture also captures
the graphs of the buckets its batch reaches in the next AHEAD_TOKENS tokens (`buckets_ahead`): a request whose KV
length crosses a bucket during a long prefill keeps replaying graphs. (Without it, on the H200 test machine, a
32K prefill beside one decoding request ran most of its steps eagerly once the request crossed 256 tokens: a mean
step of 31-34 ms against 17-20 graphed.)

Dual-batch decode (`policy.decode.dual_batch`, `GraphedDecode.dual`): a step's requests as two micro-batches, each
with graphs of its own (a lane: the mode's graphs, its own memory pool, staging buffers and stream, and for the
second lane a twin of each layer's native op, so both lanes' calls of a layer can be pending at once), so the GPU
computes one micro-batch's attention and shared experts while the CPU computes the other's routed experts:
- `hostfn`: each lane's step is one graph, replayed on its own stream; the two streams' host nodes hand the CPU
  experts to the thread pool, which queues the calls in the order they come: a worker done with one lane's call
  goes on to the other's (each join waits for its own call). With `signal` joins no host function blocks, so one
  lane's submit never waits behind the other's join (CUDA may run all host functions on one thread). No Python
  runs between the lanes. `dual` replays both lanes' steps together and returns when both end; with
  `launch`/`collect` the engine keeps them half a step apart instead (policy.decode.dual_stagger): one lane's
  next step is launched as soon as its tokens are sampled, while the other's step is still running.
- `segments`: `interleave` enqueues one micro-batch's GPU segment, then the other's, and runs the CPU experts of
  each in turn from Python.

Legend: B batch (sequences), V vocabulary.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from hybrid.engine.capture import CapturedExperts, HostFnCapture, SegmentCapture, interleave, join_on_host
from hybrid.engine.decoder import Decoder
from hybrid.placement.passes import CpuExperts, DeferredCpuExperts, cpu_experts, swap_experts
from hybrid.placement.staging import Staging
from hybrid.engine.streams import decode_stream
from hybrid.config.schema import CPU_JOINS
from hybrid.model.kv_cache import KVCache
from hybrid.model.transformer import Transformer

MODES = ("off", "hostfn", "segments")
MIN_BUCKET = 256
BUCKETS_PER_OCTAVE = 8


# a step that may capture also captures its batch's graphs for the buckets of the next this many tokens (buckets_ahead)
AHEAD_TOKENS = 1024


def buckets_ahead(bucket: int, max_context: int, ahead: int = AHEAD_TOKENS) -> list[int]:
    """The buckets after `bucket` that KV lengths up to `ahead` tokens past it fall in (none past the cache)."""
    out, end = [], min(max_context, bucket + ahead)
    while bucket < end:
        bucket = kv_bucket(bucket + 1, max_context)
        out.append(bucket)
    return out


def kv_bucket(kv_len: int, max_context: int) -> int:
    """The KV length a graph is captured for: kv_len rounded up to a multiple of an eighth of the next power of two
    (at least MIN_BUCKET), capped at the cache's length — attention reads at most 1/4 more positions than it needs
    (past MIN_BUCKET), and a 32K cache needs 24 graphs per batch size."""
    if not 1 <= kv_len <= max_context:
        raise ValueError(f"kv_len {kv_len} outside 1..{max_context} (policy.kv.max_context)")
    step = max(MIN_BUCKET, (1 << (kv_len - 1).bit_length()) // BUCKETS_PER_OCTAVE)
    return min(max_context, -(-kv_len // step) * step)


@dataclass
class _Graph:
    steps: list[Callable[[], None]]
    logits: torch.Tensor
    jobs: list  # (native job, CpuMoE, its signal word or None) per MoE layer


@dataclass
class Launched:
    """A dual-batch lane's step replayed and not yet collected: its graph (logits, native jobs) and an event on the
    lane's stream after it."""
    graph: _Graph
    done: torch.cuda.Event


class _Lane:
    """Graphs captured for one stream of decode steps: their capture mode, their memory pool, the static inputs by
    batch size, the staging lane their hand-offs copy through. Lane 0 serves single-batch steps; dual-batch decode
    replays lanes 1 and 2 at once, so they share neither a pool nor staging buffers nor native ops with each other."""

    def __init__(self, index: int, mode: str, device: torch.device):
        self.index, self.mode, self.device = index, mode, device
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.eager: set[tuple[int, int]] = set()  # shapes whose capture failed
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = decode_stream(device) if index else None  # lane 0 replays on the caller's stream
        self.twins: dict[int, tuple] = {}  # id(layer's op) -> (that op, its twin): lane 2's native ops

    def op(self, layer: CpuExperts):
        """The native op this lane's hand-offs call: the layer's own, or on lane 2 a twin of it (lanes 1 and 2 run
        at once; lanes 0 and 1 never do)."""
        if self.index < 2:
            return layer.op
        if id(layer.op) not in self.twins:
            self.twins[id(layer.op)] = (layer.op, layer.op.twin())
        return self.twins[id(layer.op)][1]

    def load(self, tokens_B1: torch.Tensor, pos_B1: torch.Tensor, slots_B: torch.Tensor):
        """The step's inputs copied into this lane's static tensors for its batch size."""
        b = tokens_B1.shape[0]
        if b not in self.inputs:
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=self.device)  # noqa: E731
            self.inputs[b] = (zeros(b, 1), zeros(b, 1), torch.arange(b, device=self.device))
        for dst, src in zip(self.inputs[b], (tokens_B1, pos_B1, slots_B)):
            dst.copy_(src, non_blocking=True)
        return self.inputs[b]


class GraphedDecode(Decoder):
    """decode(tokens_B1, pos_B1, slots_B, kv_len) -> logits_BV through captured graphs (same result as
    `model(...)[:, -1]`); `dual(...)` runs two micro-batches' steps overlapped; hostfn graphs stagger them."""

    def __init__(self, model: Transformer, cache: KVCache, staging: Staging, mode: str, max_batch: int,
                 join: str = "host"):
        if mode not in MODES[1:]:
            raise ValueError(f"policy.decode.cuda_graphs must be one of {MODES}, got {mode!r}")
        if join not in CPU_JOINS:
            raise ValueError(f"policy.decode.cpu_join must be one of {CPU_JOINS}, got {join!r}")
        if any(isinstance(layer, DeferredCpuExperts) for layer in cpu_experts(model)):
            raise ValueError("CUDA graphs need policy.cpu.deferred_experts=0")
        self.model, self.cache, self.staging, self.mode, self.join = model, cache, staging, mode, join
        self.max_batch = max_batch
        self.device = next(model.parameters()).device
        self.main = _Lane(0, mode, self.device)
        self.lanes: list[_Lane] = []  # dual-batch decode's two lanes, made on first use
        staging.reserve(max_batch)

    @property
    def staggers(self) -> bool:
        return self.mode == "hostfn"

    @property
    def graphs(self) -> dict[tuple[int, int], _Graph]:
        """The single-batch steps' graphs, by (batch size, KV-length bucket)."""
        return self.main.graphs

    def __call__(self, tokens_B1: torch.Tensor, pos_B1: torch.Tensor, slots_B: torch.Tensor,
                 kv_len: int, capture: bool = True) -> torch.Tensor:
        """One decode step, replaying the graph of its shape; a shape not captured yet is captured first, or with
        `capture` False (another thread is using the GPU: a capture would catch its calls) runs eagerly this time."""
        lane = self.main
        key = self._load(lane, (tokens_B1, pos_B1, slots_B, kv_len))
        graph = self._graph(lane, key, capture)
        if graph is None:
            return self._run(lane, *key)  # at the graphs' KV length: the same numbers as a replay
        for step in graph.steps:
            step()
        torch.cuda.current_stream().synchronize()  # the sampler reads the logits next anyway
        self._finish([graph])
        return graph.logits

    def dual(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
             capture: bool = True) -> list[torch.Tensor]:
        """Two micro-batches' decode steps (each (tokens_B1, pos_B1, slots_B, kv_len)) at once, each lane's graphs
        on its own stream, so one micro-batch's GPU work runs while the CPU computes the other's routed experts:
        hostfn, both graphs replayed (their host nodes hand over the CPU); segments, interleaved at the CPU
        hand-offs (`interleave`). Each micro-batch gets the logits its own step would give. A shape that cannot be
        replayed (no capture allowed now, or its capture failed) runs both steps one after the other instead."""
        if len(parts) != 2:
            raise ValueError(f"dual-batch decode takes two micro-batches, got {len(parts)}")
        graphs = [self._graph(lane, self._load(lane, part), capture) for lane, part in zip(self._dual_lanes(), parts)]
        if any(g is None for g in graphs):  # one after the other on lane 0, whose graph of a batch size has one
            return [self(*part, capture=capture).clone() for part in parts]  # logits tensor: copied before reuse
        if self.mode == "hostfn":
            return [self.collect(h) for h in [self._replay(lane, g) for lane, g in zip(self.lanes, graphs)]]
        main = torch.cuda.current_stream()
        for lane in self.lanes:  # the inputs copied on the caller's stream come first
            lane.stream.wait_stream(main)
        interleave([(functools.partial(torch.cuda.stream, lane.stream), g.steps)
                    for lane, g in zip(self.lanes, graphs)])
        for lane in self.lanes:
            main.wait_stream(lane.stream)
        main.synchronize()
        self._finish(graphs)
        return [g.logits for g in graphs]

    def prepare(self, i: int, part: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], capture: bool) -> bool:
        """Staggered dual-batch decode (hostfn): whether micro-batch lane i (0 or 1) can `launch` this part's step:
        its graph exists, captured now if `capture` (nothing may be running on the GPU then)."""
        if self.mode != "hostfn":
            return False
        lane = self._dual_lanes()[i]
        return self._graph(lane, self._load(lane, part), capture) is not None

    def launch(self, i: int, part: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]) -> Optional["Launched"]:
        """Staggered dual-batch decode (hostfn): lane i's step replayed on its stream and left running — the caller
        goes on (samples the other lane's tokens, launches its next step) and takes the logits with `collect`.
        None, with nothing started, where that shape's graph is not captured (a launch never captures: the other
        lane may be running; `prepare` captures)."""
        if self.mode != "hostfn":
            return None
        lane = self._dual_lanes()[i]
        key = self._load(lane, part)
        graph = None if key in lane.eager else lane.graphs.get(key)
        return None if graph is None else self._replay(lane, graph)

    def collect(self, launched: "Launched") -> torch.Tensor:
        """A launched step's logits, once it has ended (the caller's stream ordered after it); they stay valid until
        that lane's next launch."""
        launched.done.synchronize()
        torch.cuda.current_stream().wait_event(launched.done)
        self._finish([launched.graph])
        return launched.graph.logits

    def _dual_lanes(self) -> list["_Lane"]:
        if not self.lanes:
            for i in (1, 2):
                self.staging.reserve(self.max_batch, lane=i)
            self.lanes = [_Lane(i, self.mode, self.device) for i in (1, 2)]
        return self.lanes

    def _load(self, lane: "_Lane", part) -> tuple[int, int]:
        """The part's inputs into the lane's static tensors; its graph's key."""
        tokens_B1, pos_B1, slots_B, kv_len = part
        lane.load(tokens_B1, pos_B1, slots_B)
        return tokens_B1.shape[0], kv_bucket(kv_len, self.cache.max_context)

    @staticmethod
    def _replay(lane: "_Lane", graph: "_Graph") -> "Launched":
        """The lane's graph replayed on its stream after what the caller's stream has queued (its inputs)."""
        lane.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(lane.stream):
            for step in graph.steps:
                step()
        done = torch.cuda.Event()
        done.record(lane.stream)
        return Launched(graph, done)

    def jobs(self) -> list:
        """The native jobs of every captured graph (their own timings: cpu_s, calls)."""
        return [job for lane in (self.main, *self.lanes) for g in lane.graphs.values() for job, *_ in g.jobs]

    def layer_jobs(self) -> list[list]:
        """The single-batch steps' native jobs by MoE layer, in the model's order: each layer's job in every graph of
        lane 0 (one per batch size and KV bucket)."""
        by_graph = [[job for job, *_ in g.jobs] for g in self.main.graphs.values()]
        return [list(jobs) for jobs in zip(*by_graph)]

    @staticmethod
    def _finish(graphs: list[_Graph]) -> None:
        """After the replays: the calls the streams joined by their signal words are joined on the host too (the
        ops are free for an eager call next: a capture's warm-up, a prefill), and any error is raised."""
        for g in graphs:
            for job, _, signal in g.jobs:
                if signal is not None:
                    join_on_host(job)
        failed = [job for g in graphs for job, *_ in g.jobs if job.error]
        if failed:
            errors = [job.error for job in failed]
            for job in failed:  # seen: the jobs run again next step
                job.error = ""
            raise RuntimeError("CPU experts in a graphed decode step: " + "; ".join(errors))

    def _graph(self, lane: _Lane, key: tuple[int, int], capture: bool):
        """The lane's graph for this shape, captured now if allowed; None: this step runs eagerly."""
        graph = self._captured(lane, key, capture)
        if capture:  # the buckets ahead now, while nothing else runs on the GPU (see AHEAD_TOKENS)
            for kv in buckets_ahead(key[1], self.cache.max_context):
                self._captured(lane, (key[0], kv), True)
        return graph

    def _captured(self, lane: _Lane, key: tuple[int, int], capture: bool):
        """The lane's graph for this shape, captured now if allowed and not failed before; None: eager."""
        if key in lane.eager:
            return None
        graph = lane.graphs.get(key)
        if graph is None and capture:
            try:
                graph = self._capture(lane, *key)
            except RuntimeError as e:  # e.g. an operation CUDA graphs cannot hold: this shape runs eagerly
                print(f"warning: decode step of batch {key[0]}, KV length {key[1]} runs eagerly: CUDA graph capture "
                      f"failed ({str(e).splitlines()[0]})", file=sys.stderr)
                lane.eager.add(key)
        return graph

    def _run(self, lane: _Lane, b: int, kv_len: int) -> torch.Tensor:
        tokens, pos, slots = lane.inputs[b]
        return self.model(tokens, pos, self.cache, slots, kv_len=kv_len)[:, -1]

    def _capture(self, lane: _Lane, b: int, kv_len: int) -> _Graph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self.staging.lane(lane.index):
            self._run(lane, b, kv_len)  # warm-up (lazy initialisation must not happen during capture)
            side.synchronize()
            capture = (HostFnCapture(lane.pool, self.join) if lane.mode == "hostfn"
                       else SegmentCapture(lane.pool))
            try:
                _, restore = swap_experts(self.model, lambda layer: CapturedExperts(layer, capture, lane.op(layer)))
                try:
                    logits = self._run(lane, b, kv_len)
                finally:
                    restore()
            except BaseException:
                with contextlib.suppress(Exception):  # end the capture; the first error is the one to report
                    capture.finish()
                raise
            steps = capture.finish()
        torch.cuda.current_stream().wait_stream(side)
        graph = _Graph(steps, logits, capture.jobs)
        lane.graphs[(b, kv_len)] = graph
        return graph
