"""Hand-off between the compute device and the CPU expert kernels.

`Staging` holds one set of host buffers (pinned when the model runs on a GPU) shared by every MoE layer: the
router's ids and weights and the activations are copied into them, the stream is synchronised once per layer (the
only host<->device synchronisation of a layer; counted in `syncs`), and the CPU op's output goes back with a
stream-ordered copy. Reusing one set is safe: the next layer's synchronisation also waits for the previous copy
back. CUDA graphs copy into fixed buffers instead, one set per lane: dual-batch decode replays two micro-batches'
graphs at once, each through its own set (`lane`, chosen while a graph is captured). On the CPU the buffers are
bypassed unless `stage_on_cpu` (tests use it to run the GPU logic in CI).

With `mapped` (policy.decode.mapped_outputs), the CPU op's output is not copied back: a kernel on the stream reads
it straight from the pinned buffer over PCIe (the buffer's address is valid on the GPU: unified addressing) and
writes it in the model's dtype. The GPU's copy engine runs host-to-device copies in the order they were queued,
and a stream-loading prefill beside decode keeps expert copies queued there; a decode step's outputs read this way
never wait behind them.

`Deferral` is KTransformers' expert deferral (policy.cpu.deferred_experts = D; placement's DeferredCpuExperts): each
token's D lowest-weighted experts run after the others, overlapping the next layer's attention; their output joins
the residual stream one MoE layer late (the last layer waits for its own). It changes the model's output slightly,
so it is off by default.

Legend: T tokens, D hidden, K experts per token.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


class _Buffers:
    def __init__(self, rows: int, hidden: int, top_k: int, pin: bool):
        new = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, pin_memory=pin)  # noqa: E731
        self.rows = rows
        self.x = new(rows, hidden, dtype=torch.bfloat16)
        self.w = new(rows, top_k, dtype=torch.float32)
        self.ids = new(rows, top_k, dtype=torch.int64)
        self.out = new(rows, hidden, dtype=torch.float32)


def mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the pinned host tensor's memory (no copy: kernels that read it read host memory)."""
    if not host.is_pinned():
        raise ValueError("only pinned host memory can be read by the GPU in place")

    class _Memory:  # the CUDA array interface, which torch.as_tensor takes without copying
        __cuda_array_interface__ = {"data": (host.data_ptr(), False), "shape": tuple(host.shape), "version": 3,
                                    "typestr": {torch.float32: "<f4", torch.int64: "<i8"}[host.dtype],
                                    "strides": tuple(s * host.element_size() for s in host.stride())}

    return torch.as_tensor(_Memory(), device=device)


def read_in_place(host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`host` (pinned) on `device` as `dtype`, read by a kernel on the current stream (not by the copy engine)."""
    view = mapped(host, device)
    return view.to(dtype) if view.dtype != dtype else view.mul(1)  # mul: a kernel; a same-dtype copy_ is a memcpy


class Staging:
    def __init__(self, hidden: int, top_k: int, pin: bool = False, stage_on_cpu: bool = False, mapped: bool = False):
        self.hidden, self.top_k, self.pin, self.stage_on_cpu = hidden, top_k, pin, stage_on_cpu
        self.mapped = mapped and pin
        self.syncs = 0
        self._bufs: Optional[_Buffers] = None  # eager calls: grown on demand
        # CUDA graphs: by lane, allocated once, never moved (graphs hold addresses)
        self._fixed: dict[int, _Buffers] = {}
        self._lane = 0  # the lane a graph being captured copies into

    def reserve(self, rows: int, lane: int = 0) -> None:
        """The fixed buffers CUDA graphs of `lane` copy into, for up to `rows` tokens (allocate before capturing)."""
        if lane not in self._fixed:
            self._fixed[lane] = _Buffers(rows, self.hidden, self.top_k, self.pin)
        elif self._fixed[lane].rows < rows:
            raise RuntimeError("staging for CUDA graphs is already allocated and must not move")

    @contextlib.contextmanager
    def lane(self, lane: int) -> Iterator[None]:
        """Graphs captured within copy through `lane`'s fixed buffers (reserve them first)."""
        if lane not in self._fixed:
            raise RuntimeError(f"staging lane {lane} is not reserved: Staging.reserve(rows, lane) first")
        before, self._lane = self._lane, lane
        try:
            yield
        finally:
            self._lane = before

    def _buffers(self, rows: int, fixed: bool) -> _Buffers:
        if fixed:
            bufs = self._fixed.get(self._lane)
            if bufs is None or rows > bufs.rows:
                raise RuntimeError(f"{rows} rows asked while capturing a CUDA graph: Staging.reserve() them first")
            return bufs
        if self._bufs is None or rows > self._bufs.rows:
            self._bufs = _Buffers(max(rows, 2 * (self._bufs.rows if self._bufs else 0)), self.hidden, self.top_k,
                                  self.pin)
        return self._bufs

    def to_host(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, sync: bool = True):
        """Copies into the staging buffers; with `sync` (the eager path) waits for them, once per layer; without,
        into the fixed buffers, for a graph being captured."""
        if x_TD.device.type == "cpu" and not self.stage_on_cpu:
            return x_TD.to(torch.bfloat16).contiguous(), weights_TK.float().contiguous(), ids_TK.contiguous()
        t, k = ids_TK.shape
        b = self._buffers(t, fixed=not sync)
        x_h, w_h, ids_h = b.x[:t], b.w[:t, :k], b.ids[:t, :k]
        blocking = x_TD.device.type == "cpu"
        x_h.copy_(x_TD, non_blocking=not blocking)
        w_h.copy_(weights_TK, non_blocking=not blocking)
        ids_h.copy_(ids_TK, non_blocking=not blocking)
        if not blocking and sync:
            torch.cuda.current_stream(x_TD.device).synchronize()
        self.syncs += sync
        return x_h, w_h, ids_h

    def out(self, rows: int, fixed: bool = False) -> torch.Tensor:
        if fixed:
            return self._buffers(rows, fixed=True).out[:rows]
        if self._bufs is None or rows > self._bufs.rows:  # unstaged CPU path
            return torch.empty(rows, self.hidden, dtype=torch.float32)
        return self._bufs.out[:rows]

    def to_device(self, out_h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if like.device.type == "cpu":
            staged = any(b is not None and out_h.data_ptr() == b.out.data_ptr()
                         for b in (self._bufs, *self._fixed.values()))
            return out_h.to(like.dtype, copy=staged)
        if self.mapped and out_h.is_pinned():
            return read_in_place(out_h, like.device, like.dtype)
        return out_h.to(like.device, non_blocking=True).to(like.dtype)


class Deferral:
    def __init__(self, deferred: int, staging: Staging):
        if deferred < 0:
            raise ValueError("deferred_experts must be >= 0")
        self.deferred, self.staging = deferred, staging
        self._late: Optional[tuple] = None  # (layer, out_h) of the deferred experts in flight

    def start(self, layer, x_h, w_h, ids_h, like):
        k = ids_h.shape[1]
        if not 0 < self.deferred < k:
            raise ValueError(f"policy.cpu.deferred_experts={self.deferred} must be below the {k} experts per token")
        order = w_h.argsort(dim=1, descending=True)
        now, late = order[:, : k - self.deferred], order[:, k - self.deferred:]
        out_now = torch.empty(x_h.shape, dtype=torch.float32)
        layer.op.submit(x_h, ids_h.gather(1, now), w_h.gather(1, now), out_now)
        late_job = (x_h.clone(), ids_h.gather(1, late), w_h.gather(1, late))  # own copies: staging gets reused
        return _DeferredPending(self, layer, out_now, late_job, like)

    def take_late(self, layer) -> Optional[torch.Tensor]:
        """Waits for the previous layer's deferred experts and returns their output (or None)."""
        if self._late is None:
            return None
        prev_layer, out_h = self._late
        prev_layer.op.wait()
        self._late = None
        return out_h


class _DeferredPending:
    """`wait()` joins the layer's experts run now (idempotent); `result()` also takes the previous layer's deferred
    ones, submits this layer's and hands the sum back."""

    def __init__(self, deferral: Deferral, layer, out_now, late_job, like):
        self.d, self.layer, self.out_now, self.late_job, self.like = deferral, layer, out_now, late_job, like

    def wait(self) -> None:
        self.layer.op.wait()

    def result(self) -> torch.Tensor:
        self.wait()
        total = self.out_now
        previous = self.d.take_late(self.layer)
        if previous is not None:
            total = total + previous
        x_late, ids_late, w_late = self.late_job
        out_late = torch.empty(x_late.shape, dtype=torch.float32)
        self.layer.op.submit(x_late, ids_late, w_late, out_late)
        if self.layer.last:  # nothing comes after: wait for this layer's own deferred experts
            self.layer.op.wait()
            total = total + out_late
        else:
            self.d._late = (self.layer, out_late)
        return self.d.staging.to_device(total, self.like)
