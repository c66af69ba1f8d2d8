"""Build the engine from the configs: load the checkpoint, place it (routed experts on the CPU kernels, the rest on
the compute device), plan the device's memory, resolve every `null` of the policy into the plan, and make the
`Engine`. The one place that decides devices.

`rebuild` makes a new Engine around an already placed model for a policy that differs only in REBUILDABLE knobs
(threads, chunk sizes, cutoff, ring, group size, batch cap, graphs mode, hot experts): the tuner's trials change
those without loading the model again."""
from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid import models
from hybrid.config.schema import HwConfig, HybridConfig, PolicyConfig, slp_cutoff
from hybrid.engine.engine import Engine
from hybrid.placement.hot_experts import HotExperts
from hybrid.engine.long_prefill import LongPrefill
from hybrid.placement.memory import Ledger, auto_chunk, check_kv_cache, free_bytes, group_bytes, kv_cache_bytes
from hybrid.placement.passes import (chunk_prefill_attention, cpu_experts, experts_to_cpu_kernels,
                                     hot_experts_to_device, pin_experts, place)
from hybrid.engine.plan import Plan, resolve_prefill_gpus
from hybrid.placement.staging import Staging
from hybrid.engine.streams import prefill_sms
from hybrid.errors import ConfigError
from hybrid.kernels import combine, fp8_linear, pointwise, thread_pool
from hybrid.kernels.dispatch import kernel_name, selected
from hybrid.kernels.gemm import (AMX_MIN_TOKENS, OUTER_MIN_TOKENS, TILE_MIN_TOKENS, set_amx_min_tokens,
                                 set_batch_invariant, set_tile_min_tokens)
from hybrid.model.transformer import Transformer
from hybrid.prefill.ring import expert_tensors, layout
from hybrid.prefill.slp import StreamLoader, group_size


def compute_device(hw: HwConfig) -> torch.device:
    """The GPU when the (resolved) profile has one and torch sees it; else the CPU does the GPU side's work."""
    return torch.device("cuda", 0) if hw.gpus and torch.cuda.is_available() else torch.device("cpu")


def cpu_threads(p: PolicyConfig, hw: HwConfig) -> int:
    """policy.cpu.threads, else the profile's physical cores, else this machine's."""
    if p.cpu.threads is not None:
        return p.cpu.threads
    if hw.cpu.cores:
        return hw.cpu.cores
    from hybrid.hw.detect import detect

    return detect().physical_cores


def amx_min_tokens(p: PolicyConfig) -> int:
    """policy.cpu.amx_min_tokens, else 1 under policy.decode.batch_invariant, else AMX_MIN_TOKENS. The AMX tiles
    and the AVX-512 kernel round differently (the same products summed in another order), so with a threshold above
    1 a token's expert outputs would depend on how many batch mates picked the same expert; on tiles alone they do
    not (tests/kernels/test_amx.py)."""
    if p.cpu.amx_min_tokens is not None:
        return p.cpu.amx_min_tokens
    return 1 if p.decode.batch_invariant else AMX_MIN_TOKENS


def gemm_tile_tokens(p: PolicyConfig) -> int:
    """policy.cpu.gemm_tile_tokens, else the measured threshold of the form the converted tiles take here:
    OUTER_MIN_TOKENS where avx512_bf16 multiplies them in the outer-product form, TILE_MIN_TOKENS where they keep the
    streaming form's sums (variant avx512; avx512_bf16 under policy.decode.batch_invariant; the other variants do
    not read it)."""
    if p.cpu.gemm_tile_tokens is not None:
        return p.cpu.gemm_tile_tokens
    try:
        outer = selected(p.cpu.kernel) == "avx512_bf16" and not p.decode.batch_invariant
    except ValueError:  # a variant this CPU lacks: the engine's build says so
        outer = False
    return OUTER_MIN_TOKENS if outer else TILE_MIN_TOKENS


def configure_cpu(threads: int, p: PolicyConfig) -> None:
    """The native kernels' process-wide settings (one thread pool per process) and torch's intra-op threads, from
    the plan, once per engine. One count for both: without a GPU they take turns within a step (placement runs the
    routed experts synchronously, the shared experts after them), and torch keeps every core for what stays its own
    (the BF16 lm_head, attention's score products). Under policy.decode.batch_invariant the kernels keep one form
    of sums at every token count (amx_min_tokens, set_batch_invariant)."""
    torch.set_num_threads(threads)
    thread_pool.set_threads(threads)
    set_tile_min_tokens(gemm_tile_tokens(p))
    set_amx_min_tokens(amx_min_tokens(p))
    set_batch_invariant(p.decode.batch_invariant)


# Knobs a rebuild changes around the placed model (`rebuild`): every other knob needs the model placed again.
REBUILDABLE = frozenset({"cpu.threads", "cpu.gemm_tile_tokens", "cpu.amx_min_tokens", "prefill.chunk_tokens",
                         "prefill.slp_cutoff_tokens", "prefill.ring_len", "prefill.slp_chunk_tokens",
                         "prefill.slp_group_experts", "prefill.beside_decode", "prefill.stream_cap_gbps",
                         "prefill.stream_duty",
                         "prefill.attention_chunk_tokens", "prefill.beside_cores", "prefill.stream_queue_mb",
                         "prefill.beside_sms", "prefill.cores_back_in_rests",
                         "decode.batch_cap", "decode.cuda_graphs", "decode.dual_batch", "decode.dual_stagger",
                         "decode.mapped_outputs",
                         "decode.cpu_join",
                         "gpu.experts_per_layer"})


@dataclass(frozen=True)
class Placed:
    """The loaded, placed model and what placement made for it: what `rebuild` keeps."""
    policy: PolicyConfig  # the policy it was placed with
    model: Transformer
    tokenizer: object
    device: torch.device
    staging: Staging
    gemm: fp8_linear.Fp8Gemm
    fused: pointwise.Fused
    weight_bytes: int
    native: bool
    loader: Optional[StreamLoader]  # stream-loading prefill's (GPU, native experts only)
    prefill_gpus: int = 1  # policy.prefill.gpus, resolved (prefill_devices)
    arenas: Optional[list] = None  # the routed experts' one shared copy, when a prefill peer will attach to it
    threads: int = 1  # the CPU threads placement configured


def build(s: HybridConfig, hw: HwConfig, progress: bool = True, cpu_peer: bool = False) -> Engine:
    """cpu_peer: the two-GPU mode's stand-in on the CPU (the tests'): policy.prefill.gpus resolved as on a profile
    with two GPUs, the prefill peer process on the CPU too, the two processes joined over gloo."""
    return assemble(place_model(s, hw, progress, cpu_peer), s, hw)


def prefill_devices(p: PolicyConfig, hw: HwConfig, device: torch.device, native: bool,
                    cpu_peer: bool = False) -> tuple[int, bool]:
    """(policy.prefill.gpus resolved, whether a prefill peer process serves the second device). The peer streams
    its share of the experts from the one shared copy of the CPU kernels' host weights (moe_backend=native) and
    needs a second GPU that torch sees; where null asked for two and one of those is missing, the engine plans and
    runs one device, with a note; an explicit 2 is then an error."""
    if device.type == "cpu":
        gpus = (1 if p.prefill.gpus == 1 else 2) if cpu_peer else 1
    else:
        gpus = resolve_prefill_gpus(p.prefill.gpus, len(hw.gpus), device.type)
    if gpus < 2:
        return gpus, False
    why = None
    if not native:
        why = "the peer streams the experts from the CPU kernels' host weights: policy.cpu.moe_backend=native"
    elif device.type == "cuda" and torch.cuda.device_count() < 2:
        why = f"a peer process on a second GPU, and torch sees {torch.cuda.device_count()}"
    if why is None:
        return gpus, True
    if p.prefill.gpus == 2:
        raise ConfigError(f"policy.prefill.gpus=2 needs {why} (or set policy.prefill.gpus=1)")
    print(f"note: prefill on one GPU (policy.prefill.gpus=null would take two, but that needs {why})",
          file=sys.stderr)
    return 1, False


def rebuild(engine: Engine, s: HybridConfig, hw: HwConfig) -> Engine:
    """A new Engine for policy s.policy around `engine`'s placed model (its KV cache, stream loader and, where they
    still apply, hot experts and captured graphs kept). Only the REBUILDABLE knobs may differ from the policy it
    was placed with; `engine` must be idle and is not used after."""
    placed: Placed = engine.parts["placed"]
    changed = [k for k in _changed(placed.policy, s.policy) if k not in REBUILDABLE]
    if changed:
        raise ConfigError(f"policy.{changed[0]} changed: it needs the model placed again (build, not rebuild)")
    if engine.has_work():
        raise RuntimeError("rebuild: the engine still has requests")
    return assemble(placed, s, hw, engine)


def cpu_lm_head(p, device: torch.device, native: bool) -> str:
    """The lm_head's form on the CPU (policy.cpu.lm_head), or `bf16` where that knob does not apply."""
    return p.cpu.lm_head if device.type == "cpu" and native else "bf16"


def device_gemm(p: PolicyConfig, device: torch.device) -> fp8_linear.Fp8Gemm:
    """The compute device's GEMM object (policy.gpu) for the engine's process and a prefill peer alike. Rows padded
    for batch-invariant decode (policy.decode.batch_invariant): every batch size up to kv.max_batch through one
    kernel shape; none without a GPU (the CPU kernels: configure_cpu)."""
    pad = max(16, p.kv.max_batch) if p.decode.batch_invariant and device.type == "cuda" else 0
    return fp8_linear.Fp8Gemm(p.gpu.fp8_gemm, p.gpu.fp8_dequant_rows, pad_rows=pad)


def place_model(s: HybridConfig, hw: HwConfig, progress: bool = True, cpu_peer: bool = False) -> Placed:
    """Load the checkpoint and place it: routed experts on the CPU kernels (pinned for a GPU; in one shared-memory
    copy when a prefill peer will stream from it too), the rest on the compute device; the FP8 GEMM and fused
    kernels warmed up."""
    p = s.policy
    device = compute_device(hw)
    threads = cpu_threads(p, hw)
    configure_cpu(threads, p)
    gemm = device_gemm(p, device)
    if device.type == "cuda" and fp8_linear.triton is None:
        print("note: Triton is not installed: FP8 weights on the GPU are dequantised with torch ops before use "
              f"(policy.gpu.fp8_gemm={p.gpu.fp8_gemm} needs it)", file=sys.stderr)
    model, tok = models.load(s.model, progress)
    a = model.args
    staging = Staging(a.hidden_size, a.num_experts_per_tok, pin=device.type == "cuda")
    native = p.cpu.moe_backend == "native"
    gpus, peer = prefill_devices(p, hw, device, native, cpu_peer)
    arenas = None
    if native:
        experts_to_cpu_kernels(model, kernel_name(p.cpu.kernel), staging, p.cpu.deferred_experts)
        if peer:  # the one copy both processes stream from (and this one's CPU kernels read)
            from hybrid.parallel.shared import pin_shared, share_experts

            arenas = share_experts(model)
            if device.type == "cuda":
                pin_shared(arenas)
            print(f"routed experts: {sum(a.numel() for a in arenas) / 1e9:.2f} GB in shared host memory"
                  + (" (pinned)" if device.type == "cuda" else ""), file=sys.stderr)
        elif device.type == "cuda":
            pinned = pin_experts(model)
            print(f"routed experts: {pinned / 1e9:.2f} GB in pinned host memory", file=sys.stderr)
    elif p.cpu.deferred_experts:
        raise ConfigError("policy.cpu.deferred_experts needs policy.cpu.moe_backend=native")
    # Triton compiles now, not in a first long prompt; where it fails, the torch forms run
    fused = pointwise.Fused(pointwise.warm_up(a, device, model.dtype))
    weight_bytes = place(model, device, p.gpu.weights, gemm, fused, kernel_name(p.cpu.kernel) if native else None,
                         p.cpu.lm_head)
    loader = None
    if device.type == "cuda" and native:
        if a.fp8_block:
            fp8_linear.warm_up(expert_gemm_shapes(a), device, gemm)
        loader = StreamLoader(gemm, combine.warm_up(a.num_experts_per_tok, a.hidden_size, device, model.dtype))
    return Placed(p, model, tok, device, staging, gemm, fused, weight_bytes, native, loader, gpus, arenas, threads)


def assemble(placed: Placed, s: HybridConfig, hw: HwConfig, previous: Optional[Engine] = None) -> Engine:
    """The Engine for policy s.policy around a placed model: threads, hot experts, KV cache, memory ledger,
    stream-loading prefill, decode graphs, plan. `previous`: the engine it replaces (its cache, hot experts and
    graphs are reused where the policy leaves them as they were)."""
    p, model, device = s.policy, placed.model, placed.device
    a = model.args
    threads = cpu_threads(p, hw)
    chunk_prefill_attention(model, p.prefill.attention_chunk_tokens)
    if previous is not None:  # a fresh build's place_model set them already, from the same policy
        configure_cpu(threads, p)
    same_hot = previous is not None and previous.plan.gpu_experts_per_layer == p.gpu.experts_per_layer
    if same_hot:
        hot = previous.parts["hot"]
        for h in hot:  # each engine starts cold: a trial's hot set is its own traffic's, not earlier trials'
            h.reset()
    else:
        if previous is not None and previous.parts["hot"]:
            hot_experts_to_device(model, 0, device)  # the old slots go before the new are counted against the budget
        hot = hot_experts(s, model, device, placed.gemm)
    hot_bytes = sum(h.nbytes for h in hot)
    if device.type == "cuda" and previous is None:
        print(f"GPU side: {(placed.weight_bytes + hot_bytes) / 1e9:.2f} GB of weights", file=sys.stderr)
    cache = previous.cache if previous is not None else None
    held = kv_cache_bytes(a, model.dtype, cache.slots, cache.max_context) if cache is not None else 0
    if placed.loader is not None:  # the last prefill's ring, kept: the next one reuses or frees it
        held += placed.loader.kept_ring_bytes(device)
    budget = free_bytes(device, p.gpu.memory_budget_gb) + held
    kv = check_kv_cache(a, model.dtype, p.kv.max_batch, p.kv.max_context, budget, device)
    cache = cache or model.new_cache(p.kv.max_batch, p.kv.max_context, device)

    long_prefill, group, chunk = None, 1, 0
    if placed.loader is not None and cpu_experts(model):  # an all-dense model has no experts to stream
        group = group_size(p.prefill.slp_group_experts, device, model.dtype)
        slot = slot_bytes(model)
        ledger = Ledger(budget, placed.weight_bytes, kv, hot_bytes, group_bytes(a, group))
        chunk = p.prefill.slp_chunk_tokens or auto_chunk(a, ledger.free, slot)
        long_prefill = LongPrefill(model, device, placed.loader, slot, group, p.prefill.ring_len,
                                   p.gpu.memory_budget_gb)
    else:
        ledger = Ledger(budget, placed.weight_bytes, kv, hot_bytes)
    graphs = graphs_apply(s, device)
    decode = None
    mapped = placed.staging.pin and p.decode.mapped_outputs
    join = "host"
    if graphs and p.decode.cuda_graphs == "hostfn":
        from hybrid.engine.cuda_graphs import cpu_join, stream_waits  # GPU only: loads the CUDA driver's entry point

        join = cpu_join(p.decode.cpu_join, stream_waits(device))
    same_handoff = previous is not None and (previous.plan.mapped_outputs, previous.plan.cpu_join) == (mapped, join)
    placed.staging.mapped = mapped
    if graphs:
        # graphs captured with these slots and the same hand-off of the CPU experts (their join and outputs)
        decode = previous.decoder(p.decode.cuda_graphs) if same_hot and same_handoff else None
        if decode is None:
            from hybrid.engine.cuda_graphs import GraphedDecode  # GPU only: loads the CUDA driver's entry point

            decode = GraphedDecode(model, cache, placed.staging, p.decode.cuda_graphs, p.kv.max_batch, join)
    plan = Plan(device=device, threads=threads, cpu_kernel=selected(p.cpu.kernel) if placed.native else "torch",
                cpu_gemm_tile_tokens=gemm_tile_tokens(p), cpu_amx_min_tokens=amx_min_tokens(p),
                cpu_batch_invariant=p.decode.batch_invariant,
                moe_backend=p.cpu.moe_backend, cpu_lm_head=cpu_lm_head(p, device, placed.native),
                deferred_experts=p.cpu.deferred_experts, max_batch=p.kv.max_batch, max_context=p.kv.max_context,
                batch_cap=p.decode.batch_cap, prefill_chunk_tokens=p.prefill.chunk_tokens,
                prefill_attention_chunk=p.prefill.attention_chunk_tokens,
                slp_cutoff_tokens=slp_cutoff(p, hw), slp_chunk_tokens=chunk,
                ring_len=p.prefill.ring_len, slp_group_experts=group,
                prefill_gpus=placed.prefill_gpus, prefill_ep=p.prefill.ep,
                prefill_beside_decode=p.prefill.beside_decode, prefill_beside_cores=p.prefill.beside_cores,
                stream_cap_bytes_s=p.prefill.stream_cap_gbps * 1e9 if p.prefill.stream_cap_gbps else None,
                stream_queue_bytes=p.prefill.stream_queue_mb << 20 if p.prefill.stream_queue_mb else None,
                stream_duty=p.prefill.stream_duty if p.prefill.stream_duty != 1 else None,
                cores_back_in_rests=p.prefill.cores_back_in_rests,
                prefill_sms=prefill_sms(device, p.prefill.beside_sms) if p.prefill.beside_decode else None,
                gpu_weights=p.gpu.weights, gpu_fp8_gemm=p.gpu.fp8_gemm, gpu_fp8_dequant_rows=p.gpu.fp8_dequant_rows,
                cuda_graphs=p.decode.cuda_graphs if graphs else "off", dual_batch=dual_batch(p, graphs),
                dual_stagger=p.decode.dual_stagger and hostfn_graphs(p, graphs),
                mapped_outputs=mapped, cpu_join=join,
                gpu_experts_per_layer=p.gpu.experts_per_layer, gpu_pad_rows=placed.gemm.pad_rows, ledger=ledger)
    print(plan.describe(), file=sys.stderr)
    after = functools.partial(_refresh, hot) if hot else None
    parts = {"staging": placed.staging, "loader": placed.loader, "graphs": decode, "hot": hot, "gemm": placed.gemm,
             "fused": placed.fused, "placed": placed}
    return Engine(model, plan, placed.tokenizer, cache, decode, long_prefill, after, parts,
                  start_peer(placed, s) if previous is None else previous.peer)


def start_peer(placed: Placed, s: HybridConfig):
    """The prefill peer process for the second device (hybrid/parallel/peer.py), when placement shared the experts
    for one; None otherwise. A peer that cannot start stops the build."""
    if placed.arenas is None:
        return None
    from hybrid.parallel.peer import Peer

    p = s.policy
    loader = placed.loader or StreamLoader(placed.gemm)  # rank 0's share streams (the CPU stand-in: on the CPU)
    peer = Peer.start(peer_model, (s, max(1, placed.threads // 2)), placed.arenas, placed.device,
                      p.kv.max_context, loader, p.gpu.memory_budget_gb, threads=max(1, placed.threads // 2))
    print(f"prefill peer: process {peer.pid} on {peer.device} (policy.prefill.gpus={placed.prefill_gpus}, "
          f"experts by {p.prefill.ep})", file=sys.stderr)
    return peer


def peer_model(device: torch.device, s: HybridConfig, threads: int) -> tuple[Transformer, StreamLoader]:
    """In the peer process: the model loaded and placed on its device as place_model does (the routed experts on
    the CPU kernels, attached to the engine's shared copy after), and its stream loader."""
    p = s.policy
    configure_cpu(threads, p)
    model, _ = models.load(s.model, progress=False)
    a = model.args
    cuda = device.type == "cuda"
    experts_to_cpu_kernels(model, kernel_name(p.cpu.kernel), Staging(a.hidden_size, a.num_experts_per_tok, pin=cuda))
    gemm = device_gemm(p, device)
    fused = pointwise.Fused(pointwise.warm_up(a, device, model.dtype))
    place(model, device, p.gpu.weights, gemm, fused, kernel_name(p.cpu.kernel), p.cpu.lm_head)
    chunk_prefill_attention(model, p.prefill.attention_chunk_tokens)
    if not cuda:
        return model, StreamLoader(gemm)
    if a.fp8_block:
        fp8_linear.warm_up(expert_gemm_shapes(a), device, gemm)
    return model, StreamLoader(gemm, combine.warm_up(a.num_experts_per_tok, a.hidden_size, device, model.dtype))


def _changed(a, b, prefix: str = "") -> list[str]:
    """Dotted paths of the knobs whose values differ between two policies (nested dataclasses)."""
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            out += _changed(x, y, f"{prefix}{f.name}.")
        elif x != y:
            out.append(prefix + f.name)
    return out


def _refresh(hot: list[HotExperts]) -> None:
    for h in hot:
        h.refresh()


def hot_experts(s: HybridConfig, model: Transformer, device: torch.device,
                gemm: fp8_linear.Fp8Gemm = fp8_linear.DEFAULT_GEMM) -> list[HotExperts]:
    """policy.gpu.experts_per_layer > 0: that many slots per MoE layer for the hottest routed experts on the GPU."""
    n, p = s.policy.gpu.experts_per_layer, s.policy
    if not n:
        return []
    if device.type != "cuda":
        raise ConfigError("policy.gpu.experts_per_layer > 0 keeps hot experts on the GPU: this profile runs "
                          "without one (set it to 0)")
    if p.cpu.moe_backend != "native" or p.cpu.deferred_experts:
        raise ConfigError("policy.gpu.experts_per_layer > 0 needs policy.cpu.moe_backend=native and "
                          "policy.cpu.deferred_experts=0")
    layers = cpu_experts(model)
    need = n * len(layers) * slot_bytes(model)
    budget = free_bytes(device, p.gpu.memory_budget_gb)
    if need > budget:
        raise ConfigError(f"policy.gpu.experts_per_layer={n} needs {need / 1e9:.2f} GB of GPU memory for "
                          f"{len(layers)} MoE layers but {max(budget, 0) / 1e9:.2f} GB is free: lower it "
                          "(or raise policy.gpu.memory_budget_gb)")
    return hot_experts_to_device(model, n, device, gemm)


def expert_gemm_shapes(a) -> list[tuple[int, int]]:
    """The weight shapes [N, K] a streamed expert multiplies by: gate+up fused, gate or up alone, down."""
    i, d = a.moe_intermediate_size, a.hidden_size
    return [(2 * i, d), (i, d), (d, i)]


def dual_batch(p: PolicyConfig, graphs: bool) -> bool:
    """policy.decode.dual_batch resolved: null = on where decode replays hostfn graphs (the micro-batches then run
    half a step apart, the GPU's share of a step hidden behind the CPU experts: 1.27-1.37x at 2D and 4D on the H200
    test machine), off elsewhere (eagerly, or on the CPU, the two halves run in turn and gain nothing)."""
    if p.decode.dual_batch is not None:
        return p.decode.dual_batch
    return hostfn_graphs(p, graphs)


def hostfn_graphs(p: PolicyConfig, graphs: bool) -> bool:
    """Whether decode replays hostfn graphs (`graphs`: whether graphs apply here at all, graphs_apply)."""
    return graphs and p.decode.cuda_graphs == "hostfn"


def graphs_apply(s: HybridConfig, device: torch.device) -> bool:
    """CUDA graphs need a GPU and every MoE layer's experts on the native op without deferral (whose Python-side
    bookkeeping runs between layers); otherwise decode stays eager."""
    p = s.policy
    if p.decode.cuda_graphs == "off" or device.type != "cuda":
        return False
    if p.cpu.moe_backend != "native" or p.cpu.deferred_experts:
        print("note: decode runs eagerly (policy.decode.cuda_graphs needs policy.cpu.moe_backend=native and "
              "policy.cpu.deferred_experts=0)", file=sys.stderr)
        return False
    return True


def slot_bytes(model: Transformer) -> int:
    return layout(expert_tensors(cpu_experts(model)[0].host_experts[0]))[1]
