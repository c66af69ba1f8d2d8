"""The engine's run-time plan: every choice of the policy resolved once (`null` and `auto` replaced by what this
machine and model get), frozen, printed at start-up and logged with the run. Built by hybrid/engine/build.py; the
engine and the passes read their configuration from it, nothing else.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from hybrid.placement.memory import Ledger
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class Plan:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # CPU experts
    threads: int = 1
    cpu_kernel: str = "auto"  # the ISA variant the native kernels run (resolved: amx | avx512_bf16 | avx512 | avx2 | generic)
    cpu_gemm_tile_tokens: int = 64
    cpu_amx_min_tokens: int = 4
    cpu_batch_invariant: bool = False  # the CPU kernels keep one form of sums at every token count
    moe_backend: str = "native"
    cpu_lm_head: str = "bf16"  # lm_head's weights without a GPU: bf16 | fp8 (quantised at load)
    deferred_experts: int = 0
    # requests
    max_batch: int = 8
    max_context: int = 4096
    batch_cap: int = 8
    prefill_chunk_tokens: int = 512
    prefill_attention_chunk: int = 0  # a prompt's attention in query chunks of this many (0: one call per layer)
    # stream-loading prefill (on a GPU only)
    slp_cutoff_tokens: int = 128
    slp_chunk_tokens: int = 0  # 0 = the whole prompt at once
    ring_len: Optional[int] = None  # None = per prompt, as deep as the ledger's free memory allows
    slp_group_experts: int = 1
    prefill_gpus: int = 1  # GPUs a long prompt's prefill may take when nothing decodes (resolve_prefill_gpus)
    prefill_ep: str = "smallep"  # how two GPUs share the routed experts: smallep | ep
    prefill_beside_decode: bool = False  # a stream-loaded prompt on its own thread while the others decode
    prefill_beside_cores: int = 0  # meanwhile decode's CPU experts run on this many fewer threads
    stream_cap_bytes_s: Optional[float] = None  # that stream's copy rate while requests decode (None: no cap)
    stream_queue_bytes: Optional[int] = None  # ... and its copies queued on the GPU at a time (None: no bound)
    stream_duty: Optional[float] = None  # ... and the prefill at work this share of the time (None: always)
    cores_back_in_rests: bool = False  # a decode step begun in the prefill's rest takes its cores (and holds the rest)
    prefill_sms: Optional[int] = None  # beside decode, the prefill's kernels on this many SMs (None: every SM)
    mapped_outputs: bool = False  # the CPU experts' outputs read in place from pinned memory by the GPU
    cpu_join: str = "host"  # hostfn graphs: the GPU waits for the CPU experts on a signal word | a host node
    # GPU side
    gpu_weights: str = "dense"
    gpu_fp8_gemm: str = "triton"
    gpu_fp8_dequant_rows: int = 512
    cuda_graphs: str = "off"  # resolved: off where graphs do not apply
    dual_batch: bool = False  # >= 2 decoding: two micro-batches, interleaved (overlapped under graphs)
    dual_stagger: bool = False  # ... half a step apart: each one's next step launched once its tokens are sampled
    gpu_experts_per_layer: int = 0
    gpu_pad_rows: int = 0  # batch-invariant decode: GPU GEMMs of fewer rows padded to this many (0: off)
    ledger: Ledger = field(default_factory=Ledger)

    def params(self) -> dict:
        """Flat name -> value, for tracking."""
        out = {k: v for k, v in asdict(self).items() if k != "ledger"}
        out["device"] = str(self.device)
        out.update({f"ledger.{k}": v for k, v in self.ledger.params().items()})
        return out

    def describe(self) -> str:
        """The plan as the start-up banner prints it."""
        p = self
        amx = f", AMX from {p.cpu_amx_min_tokens}" if p.cpu_kernel == "amx" else ""
        lines = [f"plan: device {p.device}, {p.threads} CPU threads, CPU kernel {p.cpu_kernel} "
                 f"(tiles reused from {p.cpu_gemm_tile_tokens} tokens per expert{amx}"
                 + ("; batch-invariant: one form of sums at every token count" if p.cpu_batch_invariant else "")
                 + f"), experts on {p.moe_backend}"
                 + (f", lm_head {p.cpu_lm_head}" if p.device.type == "cpu" else ""),
                 f"  requests: {p.max_batch} KV slots x {p.max_context} tokens, at most {p.batch_cap} running, "
                 f"prefill chunks of {p.prefill_chunk_tokens} tokens, "
                 + (f"attention over longer prompts in query chunks of {p.prefill_attention_chunk}"
                    if p.prefill_attention_chunk else "attention in one call per layer")
                 + (", decode in two micro-batches " + (f"overlapped ({p.cuda_graphs} graphs on two streams"
                                                        + (", half a step apart)" if p.dual_stagger else ")")
                                                        if p.cuda_graphs != "off" else "in turn (no overlap)")
                    if p.dual_batch else "")]
        if p.device.type == "cuda":
            ring = "auto (per prompt)" if p.ring_len is None else str(p.ring_len)
            gpus = "one GPU"
            if p.prefill_gpus > 1:
                gpus += (f" ({p.prefill_gpus} when nothing decodes, {p.prefill_ep}, with the prefill peer process; "
                         "while requests decode, the peer alone)")
            beside = "alone in its step (decode held)"
            if p.prefill_beside_decode:
                cap = "uncapped" if p.stream_cap_bytes_s is None else f"{p.stream_cap_bytes_s / 1e9:g} GB/s"
                if p.stream_queue_bytes:
                    cap += f", at most {p.stream_queue_bytes >> 20} MB of copies queued"
                if p.stream_duty:
                    cap += f", at work {p.stream_duty:.0%} of the time"
                cores = (f", decode's experts on {decode_threads(p, True)} threads meanwhile"
                         if p.prefill_beside_cores else "")
                if p.prefill_beside_cores and p.stream_duty and p.cores_back_in_rests:
                    cores += f" ({p.threads} in the prefill's rests)"
                if p.prefill_sms:
                    cores += f", its kernels on {p.prefill_sms} SMs (a green context)"
                beside = f"beside decode ({cap} while requests decode{cores})"
            lines += [f"  stream-loading prefill above {p.slp_cutoff_tokens} tokens: ring {ring}, experts in groups "
                      f"of {p.slp_group_experts}, chunks {p.slp_chunk_tokens or 'whole prompt'}, on {gpus}, "
                      f"{beside}",
                      f"  GPU: weights {p.gpu_weights}, FP8 GEMM {p.gpu_fp8_gemm}, CUDA graphs {p.cuda_graphs}"
                      + (f" (CPU experts joined by {'a signal word' if p.cpu_join == 'signal' else 'a host node'})"
                         if p.cuda_graphs == "hostfn" else "") + ", "
                      f"CPU experts' outputs {'read in place' if p.mapped_outputs else 'copied back'}, "
                      f"{p.gpu_experts_per_layer} hot experts per layer, decode "
                      + (f"batch-invariant (GEMMs padded to {p.gpu_pad_rows} rows, attention in fixed chunks)"
                         if p.gpu_pad_rows else "not batch-invariant (einsum attention)"),
                      "  memory: " + ", ".join(f"{name} {b / 1e9:.2f} GB" for name, b in p.ledger.rows())]
        return "\n".join(lines)


def decode_threads(p: Plan, beside: bool) -> int:
    """Threads of decode's CPU experts: all the plan's, but while a prompt streams beside decode
    `prefill_beside_cores` fewer (at least one): the pool's workers are pinned, one per core, so a core the prefill's
    own threads (model, loader, unloader) take from a worker holds that worker's task, and the step, until the
    scheduler gives it back."""
    return max(1, p.threads - p.prefill_beside_cores) if beside else p.threads


def resolve_prefill_gpus(setting: Optional[int], profile_gpus: int, device_type: str) -> int:
    """policy.prefill.gpus as a number: null = min(2, the profile's GPUs); 1 without a GPU to compute on. Two asked
    for on a profile with fewer is a configuration error."""
    if device_type != "cuda":
        return 1
    if setting is None:
        return max(1, min(2, profile_gpus))
    if setting > profile_gpus:
        raise ConfigError(f"policy.prefill.gpus={setting} but the hw profile has {profile_gpus} GPU(s)")
    return setting
