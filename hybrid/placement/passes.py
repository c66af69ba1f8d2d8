"""Placement passes, applied to a loaded model from outside, so the model code stays device-agnostic.

- `experts_to_cpu_kernels`: every MoE layer's routed experts run on the native fused CPU op (csrc/moe.cpp),
  whatever device the rest of the model is on. Their weights stay in host memory: they are kept out of the module
  tree, so moving the model leaves them where they are. The variant (`VARIANTS`: eager, or with expert deferral)
  is chosen here, once.
- `swap_experts`: wrappers around every layer's CPU experts for a while (CUDA-graph capture, the step profiler),
  the layers put back after.
- `place`: the rest of the model (attention, dense layers, shared experts, router, embeddings, lm_head) moves to
  the compute device; on a GPU its FP8 weights are dequantised once to the compute dtype (`gpu_weights=dense`) or
  kept in FP8 and dequantised per use (`fp8`: half the memory). The modules it places get the FP8 GEMM and the
  fused-kernel decision chosen for the device. On the CPU with the native kernels, its FP8 Linears run on them too
  (`CpuFp8Gemm`, over the FP8 bytes in place) and the routed experts run in turn with the rest, on every core; on
  the CPU, a BF16 model's kv_b_proj is dequantised once (attention reads it whole at every step).
- `hot_experts_to_device`: every MoE layer on the CPU kernels gets GPU slots for its hottest routed experts (or
  loses them: n = 0).
- `pin_experts`: the routed experts' weights move into one pinned host arena per layer (fast copies to the GPU for
  stream-loading prefill); the mmap'd checkpoint pages are then no longer referenced. Each arena can be prepared
  before it is page-locked and filled (NUMA: its pages bound to their experts' nodes, hybrid/placement/numa.py).

Legend: T tokens, D hidden, K experts per token.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from hybrid.placement.pinned import pinned_bytes, trim_heap
from hybrid.kernels.fp8_linear import DEFAULT_GEMM, CpuFp8Gemm, Fp8Gemm
from hybrid.kernels.moe import CpuMoE
from hybrid.kernels.pointwise import FUSED, Fused
from hybrid.model.attention import MLA
from hybrid.model.layers import Int4Linear, Linear, RMSNorm
from hybrid.model.moe import MoE, RoutedExperts, Router
from hybrid.placement.hot_experts import PROJ, HotExperts
from hybrid.placement.staging import Deferral, Staging
from hybrid.prefill.ring import expert_tensors, layout
from hybrid.quant import fp8


def _cpu_op(experts: RoutedExperts, kernel: str, nodes: Optional[list[int]] = None) -> CpuMoE:
    if _int4(experts):
        weight, scale = "weight_packed", "weight_scale"
    else:
        weight, scale = "weight", "weight_scale_inv" if experts[0].gate_proj.block else None
    weights = [[getattr(getattr(e, p), weight) for e in experts] for p in PROJ]
    scales = [[getattr(getattr(e, p), scale) for e in experts] for p in PROJ] if scale else [[], [], []]
    return CpuMoE(*weights, *scales, kernel=kernel, nodes=nodes)


def _int4(experts: RoutedExperts) -> bool:
    return isinstance(experts[0].gate_proj, Int4Linear)


class Staged(NamedTuple):
    """A layer's inputs in the host buffers, and what stays on the caller's device."""
    x_h: torch.Tensor
    w_h: torch.Tensor
    ids_h: torch.Tensor  # resident picks as -1
    x_TD: torch.Tensor  # the caller's activations: the output goes back to their device and dtype
    w_TN: Optional[torch.Tensor]  # each token's weight on each resident slot (None: no resident experts)


class CpuExperts(nn.Module):
    """RoutedExperts' interface over the native CPU op. `start` hands the layer to the CPU threads and returns at
    once (the caller computes the shared experts meanwhile); the handle's `result()` joins and hands the output back
    on the caller's device. `start` is `stage` (into the staging buffers) then `submit` (to the CPU threads): a
    wrapper can run them apart. `hot`: experts of this layer resident on the compute device, computed there.
    `nodes`: each expert's NUMA node (set_nodes), whose threads run it."""

    def __init__(self, experts: RoutedExperts, staging: Staging, kernel: str = "auto",
                 hot: Optional[HotExperts] = None):
        super().__init__()
        # in a tuple, not submodules: moving the model leaves the host experts in host memory, and the resident
        # slots are no checkpoint weights (allocated where they live)
        self._outside = (experts, hot)
        self.kernel, self.staging = kernel, staging
        # False (placed on the CPU): `submit` runs the layer on every thread, the caller's too, and returns done;
        # the shared experts then have the cores to themselves
        self.overlap = True
        self.nodes: Optional[list[int]] = None
        self.op = _cpu_op(experts, kernel)
        self.arena: Optional[torch.Tensor] = None  # pin_experts: every expert's weights, slot_bytes apart
        self.slot_bytes = 0

    @classmethod
    def for_layers(cls, experts: list[RoutedExperts], staging: Staging, kernel: str,
                   deferred_experts: int) -> list["CpuExperts"]:
        """One per MoE layer of a model, in order."""
        return [cls(e, staging, kernel) for e in experts]

    @property
    def host_experts(self) -> RoutedExperts:
        return self._outside[0]

    @property
    def hot(self) -> Optional[HotExperts]:
        return self._outside[1]

    def with_hot(self, hot: Optional[HotExperts]) -> "CpuExperts":
        """This layer with `hot` resident experts: a new module over the same host experts, staging and arena."""
        layer = CpuExperts(self.host_experts, self.staging, self.kernel, hot)
        layer.arena, layer.slot_bytes, layer.overlap = self.arena, self.slot_bytes, self.overlap
        if self.nodes is not None:
            layer.set_nodes(self.nodes)
        return layer

    def set_nodes(self, nodes: Sequence[int]) -> None:
        """Each expert's NUMA node: its tasks run on that node's threads of the pool."""
        self.nodes = [int(n) for n in nodes]
        self.op.nodes = self.nodes

    def rebuild(self) -> None:
        """After the expert weights moved (pinning), point the native op at them."""
        self.op = _cpu_op(self.host_experts, self.kernel, self.nodes)

    def stage(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
              sync: bool = True) -> Staged:
        """Takes the resident experts' picks off the CPU's ids and copies the inputs to the host (`sync`: see
        Staging.to_host)."""
        w_TN = None
        if self.hot is not None:  # resident experts leave the CPU's ids as -1; computed on submission
            w_TN, ids_TK = self.hot.route(weights_TK, ids_TK)
        return Staged(*self.staging.to_host(x_TD, weights_TK, ids_TK, sync=sync), x_TD, w_TN)

    def submit(self, s: Staged) -> "_Pending":
        """Starts the CPU op on the staged inputs, then the resident experts on their device (overlapping it)."""
        out_h = self.staging.out(s.x_h.shape[0])
        if self.overlap:
            self.op.submit(s.x_h, s.ids_h, s.w_h, out_h)
        else:
            self.op(s.x_h, s.ids_h, s.w_h, out_h)
        return _Pending(self, out_h, s.x_TD, self.resident(s))

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor):
        return self.submit(self.stage(x_TD, weights_TK, ids_TK))

    def resident(self, s: Staged) -> Optional[torch.Tensor]:
        """The resident experts' output [T, D] (fp32), or None without them."""
        return None if s.w_TN is None else self.hot(s.x_TD, s.w_TN)

    def join(self, out_h: torch.Tensor, like: torch.Tensor, hot_TD: Optional[torch.Tensor]) -> torch.Tensor:
        """The CPU op's output on the caller's device (plus the resident experts')."""
        if hot_TD is None:
            return self.staging.to_device(out_h, like)
        return (self.staging.to_device(out_h, hot_TD) + hot_TD).to(like.dtype)

    def forward(self, x_TD, weights_TK, ids_TK) -> torch.Tensor:
        return self.start(x_TD, weights_TK, ids_TK).result()


class _Pending:
    """A layer on the CPU threads: `wait()` joins the CPU op (idempotent), `result()` also hands the output back."""

    def __init__(self, layer: CpuExperts, out_h: torch.Tensor, like: torch.Tensor, hot_TD=None):
        self.layer, self.out_h, self.like, self.hot_TD = layer, out_h, like, hot_TD

    def wait(self) -> None:
        self.layer.op.wait()

    def result(self) -> torch.Tensor:
        self.wait()
        return self.layer.join(self.out_h, self.like, self.hot_TD)


class DeferredCpuExperts(CpuExperts):
    """CpuExperts with expert deferral (staging.Deferral, shared by the model's layers): each token's lowest-weighted
    experts join the residual stream one MoE layer late; `last`, the model's last MoE layer, waits for its own."""

    def __init__(self, experts: RoutedExperts, staging: Staging, kernel: str, deferral: Deferral,
                 last: bool = False):
        super().__init__(experts, staging, kernel)
        self.deferral, self.last = deferral, last

    @classmethod
    def for_layers(cls, experts: list[RoutedExperts], staging: Staging, kernel: str,
                   deferred_experts: int) -> list["CpuExperts"]:
        deferral = Deferral(deferred_experts, staging)
        return [cls(e, staging, kernel, deferral, last=i == len(experts) - 1) for i, e in enumerate(experts)]

    def with_hot(self, hot: Optional[HotExperts]) -> "CpuExperts":
        raise ValueError("resident (hot) experts need policy.cpu.deferred_experts=0")

    def submit(self, s: Staged):
        return self.deferral.start(self, s.x_h, s.w_h, s.ids_h, s.x_TD)


# the CPU-experts variants, chosen once at placement
VARIANTS: dict[str, type[CpuExperts]] = {"eager": CpuExperts, "deferred": DeferredCpuExperts}


def experts_to_cpu_kernels(model: nn.Module, kernel: str = "auto", staging: Optional[Staging] = None,
                           deferred_experts: int = 0) -> int:
    """Every MoE layer's routed experts onto the CPU op: the `deferred` variant when deferred_experts is set, else
    `eager`. Returns the number of MoE layers placed."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.experts, RoutedExperts)]
    if not moes:
        return 0
    args = moes[0].gate.args
    staging = staging or Staging(args.hidden_size, args.num_experts_per_tok)
    variant = VARIANTS["deferred" if deferred_experts else "eager"]
    for m, layer in zip(moes, variant.for_layers([m.experts for m in moes], staging, kernel, deferred_experts)):
        m.experts = layer
    return len(moes)


class ExpertsWrapper(nn.Module):
    """Base of the wrappers swapped in around a layer's CpuExperts (`swap_experts`): the layer stays a submodule, so
    `cpu_experts` still finds it, and its host-side attributes read through (hybrid/prefill/pipeline.py
    HostExpertLayer). Subclasses define `start`."""

    def __init__(self, layer: CpuExperts):
        super().__init__()
        self.layer = layer

    @property
    def host_experts(self) -> RoutedExperts:
        return self.layer.host_experts

    @property
    def arena(self) -> Optional[torch.Tensor]:
        return self.layer.arena

    @property
    def slot_bytes(self) -> int:
        return self.layer.slot_bytes

    @property
    def hot(self) -> Optional[HotExperts]:
        return self.layer.hot

    def forward(self, x_TD, weights_TK, ids_TK) -> torch.Tensor:
        return self.start(x_TD, weights_TK, ids_TK).result()


def swap_experts(model: nn.Module, wrap: Callable[[CpuExperts], ExpertsWrapper]
                 ) -> tuple[list[ExpertsWrapper], Callable[[], None]]:
    """Every MoE layer's CpuExperts replaced by wrap(layer) (all of them, or none where wrap raises); returns the
    wrappers and the function that puts the layers back."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.experts, CpuExperts)]
    layers = [m.experts for m in moes]
    wrappers = [wrap(layer) for layer in layers]
    for m, w in zip(moes, wrappers):
        m.experts = w

    def restore() -> None:
        for m, layer, w in zip(moes, layers, wrappers):
            if m.experts is w:
                m.experts = layer
    return wrappers, restore


def cpu_experts(model: nn.Module) -> list[CpuExperts]:
    return [m for m in model.modules() if isinstance(m, CpuExperts)]


def place(model: nn.Module, device: torch.device, gpu_weights: str = "dense", gemm: Fp8Gemm = DEFAULT_GEMM,
          fused: Fused = FUSED, cpu_kernel: Optional[str] = None, cpu_lm_head: str = "bf16") -> int:
    """Moves everything but the routed experts to `device`, its Linears computing through `gemm` and its norms, RoPE
    and key expansion by `fused`; returns the bytes of weights now on it. On the CPU, `cpu_kernel` (the native
    kernels' variant, when they run the routed experts) puts the Linears on them too (CpuFp8Gemm over `gemm`) and
    the routed experts in turn with the rest (CpuExperts.overlap off); a BF16 model keeps kv_b dequantised there,
    and its lm_head is quantised to FP8 when `cpu_lm_head` is `fp8` (policy.cpu.lm_head)."""
    model.to(device)
    if device.type == "cpu" and cpu_kernel is not None:
        gemm = CpuFp8Gemm(cpu_kernel, gemm)
        for layer in cpu_experts(model):
            layer.overlap = False
    for m in model.modules():
        if isinstance(m, (Linear, Router)):
            m.gemm = gemm
        elif isinstance(m, (RMSNorm, MLA)):
            m.fused = fused
    if device.type == "cuda" and gpu_weights == "dense":
        for lin in [m for m in model.modules() if isinstance(m, Linear) and m.block is not None]:
            _dense(lin, model.dtype)
    elif device.type == "cpu" and model.dtype == torch.bfloat16:  # float32 (tests) keeps the per-call forms
        for mla in [m for m in model.modules() if isinstance(m, MLA)]:  # attention reads kv_b whole every step
            mla.keep_kv_b(model.dtype)
        if cpu_kernel is not None and cpu_lm_head == "fp8":
            lm_head_to_fp8(model.lm_head)
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def chunk_prefill_attention(model: nn.Module, tokens: int) -> None:
    """Prefill attention over more than `tokens` queries in query chunks of that many (0: one call per layer;
    policy.prefill.attention_chunk_tokens): on a GPU, decode's steps get the SMs between the chunks' kernels. Set
    for every prompt alike, so that a request's tokens do not depend on what else runs."""
    for mla in (m for m in model.modules() if isinstance(m, MLA)):
        mla.query_chunk = tokens


def lm_head_to_fp8(lin: Linear, block: tuple[int, int] = (128, 128)) -> None:
    """A BF16 Linear (lm_head) quantised once into block-scaled FP8 (amax / 448 per block, as the checkpoints'
    FP8 weights), for the native FP8 GEMM: half the bytes per call. The logits change (docs/perf/journal.md)."""
    if lin.block is not None:
        return
    q, scale = fp8.quantize(lin.weight, block, rows=8 * block[0])
    lin.weight = nn.Parameter(q, requires_grad=False)
    lin.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
    lin.block = block


def _dense(lin: Linear, dtype: torch.dtype) -> None:
    """The Linear's weight dequantised to `dtype` once, in place of the FP8 one."""
    lin.weight = nn.Parameter(lin.dense_weight(dtype), requires_grad=False)
    del lin.weight_scale_inv
    lin.block = None


def hot_experts_to_device(model: nn.Module, n: int, device: torch.device,
                          gemm: Fp8Gemm = DEFAULT_GEMM) -> list[HotExperts]:
    """Every MoE layer on the CPU kernels gets n slots on `device` for its hottest routed experts (computed through
    `gemm`), in place of those it had (n = 0: none); returns them, layer by layer."""
    hot = []
    for m in [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.experts, CpuExperts)]:
        m.experts = m.experts.with_hot(HotExperts(m.experts.host_experts, n, device, gemm) if n else None)
        if n:
            hot.append(m.experts.hot)
    return hot


def pin_experts(model: nn.Module, pin: bool = True,
                prepare: Optional[Callable[["CpuExperts", torch.Tensor], object]] = None) -> int:
    """Copies each layer's routed-expert weights into one arena (pinned for fast copies to a GPU), expert after
    expert in the stream-loading ring's slot layout, so one copy moves an expert; returns the arena bytes. Layer by
    layer, the old copies' memory is handed back before the next arena is taken (the peak: one layer's experts above
    the model's own bytes, where no other reference holds them). `prepare(layer, arena)`: called on each fresh arena
    before it is page-locked and filled (placement/numa.py's bind_arena: its pages then land on their nodes)."""
    total = 0
    for layer in cpu_experts(model):
        n = len(layer.host_experts) * layout(expert_tensors(layer.host_experts[0]))[1]
        if pin:  # exactly n bytes page-locked
            arena = pinned_bytes(n, before_lock=functools.partial(prepare, layer) if prepare else None)
        else:
            arena = torch.empty(n, dtype=torch.uint8)
            if prepare:
                prepare(layer, arena)
        move_into_arena(layer, arena)
        total += arena.numel()
    return total


def move_into_arena(layer: CpuExperts, arena: torch.Tensor, copy: bool = True) -> None:
    """The layer's routed experts read from `arena` (uint8, one slot per expert in the ring's layout) from now on:
    copied into it (their old copies' memory back to the OS at once, trim_heap, for the next layer's arena to take),
    or with copy=False found there already (an arena another process filled)."""
    fields, slot = layout(expert_tensors(layer.host_experts[0]))
    for e, expert in enumerate(layer.host_experts):
        for name, t in expert_tensors(expert):
            start = e * slot + fields[name].offset
            view = arena[start:start + t.nbytes].view(t.dtype).view(t.shape)
            if copy:
                view.copy_(t)
            proj, attr = name.split(".")
            setattr(getattr(expert, proj), attr, nn.Parameter(view, requires_grad=False))
        if _int4(layer.host_experts):  # the recorded shapes, the only tensors left in the checkpoint's pages
            for p in PROJ:
                lin = getattr(expert, p)
                lin.weight_shape = nn.Parameter(lin.weight_shape.clone(), requires_grad=False)
    layer.arena, layer.slot_bytes = arena, slot
    layer.rebuild()
    if copy:
        trim_heap()
