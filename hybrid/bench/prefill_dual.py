"""`mode=bench bench=prefill policy.prefill.gpus=2`: stream-loading prefill over two GPUs, one process each
(hybrid/parallel/): context-parallel attention, each GPU streaming half of every layer's experts from the one shared
copy in host memory, SmallEP against standard EP.

Bound per prompt: max(routed-expert bytes ÷ (2 × pinned H2D rate), the prefill's matmul FLOPs ÷ (2 × GPU matmul
rate)), the rates measured by each GPU in this run (the slower GPU's count). Per MoE layer, each prompt's time is
split into the token gather (SmallEP's all-gather, EP's dispatch), the experts (router, grouping, the streamed
share), the exchange (partial sums; EP's results back), the shared experts, and the rest (attention with its latent
gather, norms, dense layers) — one extra run with a device synchronisation at each phase's end.

Each rank places the model as the engine's prefill peer does (hybrid/engine/build.py `peer_model`, from the plan
`plan_for` resolves) and attaches its routed experts to the one shared copy the parent made (`shared_experts`); its
ring is sized as the peer's (hybrid/parallel/peer_commands.py `streaming`).
"""
from __future__ import annotations

import sys
import time

import torch

from hybrid.bench import bounds
from hybrid.bench.decode import FULL_MOE_LAYERS
from hybrid.bench.prefill import h2d_rate, matmul_rate
from hybrid.bench.records import Record, Records
from hybrid.engine.build import peer_model, plan_for, shared_experts
from hybrid.errors import ConfigError
from hybrid.models import args_of
from hybrid.parallel.group import Dist, run_ranks
from hybrid.parallel.peer_commands import Knobs, streaming
from hybrid.parallel.prefill import parallel_prefill
from hybrid.parallel.shared import attach_experts, pin_shared
from hybrid.parallel.smallep import MODES, PhaseClock, shard
from hybrid.prefill.slp import StreamLoader

GPUS = 2
PHASES = ("gather", "experts", "exchange", "shared_experts")


def run(settings) -> Records:
    s, p = settings, settings.policy
    if torch.cuda.device_count() < GPUS:
        raise ConfigError(f"bench=prefill with policy.prefill.gpus=2 runs one process per GPU: it needs {GPUS} GPUs, "
                          f"torch sees {torch.cuda.device_count()}")
    if p.cpu.moe_backend != "native":
        raise ConfigError("bench=prefill on two GPUs streams the experts from the CPU kernels' host weights: it "
                          "needs policy.cpu.moe_backend=native")
    if max(s.bench.prompt_lengths) > p.kv.max_context:
        raise ConfigError(f"bench.prompt_lengths reach {max(s.bench.prompt_lengths)}: raise policy.kv.max_context")
    plan = plan_for(s, s.hw)
    arenas = shared_experts(s.model, plan, progress=sys.stderr.isatty())  # the one copy both processes stream from
    threads = max(1, plan.cpu.threads // 2)  # the ranks share the CPU, as the engine and its peer do
    per_rank = run_ranks(_rank, GPUS, (s, plan, threads, arenas), device_type="cuda", threads=threads)
    return Records(_records(args_of(s.model), per_rank, s.bench.prompt_lengths),
                   {"gpus": GPUS, "ep_modes": list(MODES)})


def rank_model(device: torch.device, s, plan, threads: int, arenas: list) -> tuple[torch.nn.Module, StreamLoader]:
    """A rank's model placed on its device as the engine's prefill peer is (peer_model), its routed experts
    attached to the shared copy (page-locked in place for this process's copies on a GPU)."""
    model, loader = peer_model(device, s.model, plan, threads)
    attach_experts(model, arenas)
    if device.type == "cuda":
        pin_shared(arenas)
    return model, loader


def _rank(d: Dist, s, plan, threads: int, arenas: list) -> dict:
    """One GPU's process: the model placed on it; its rates, then each prompt length's time and phase split, in
    both modes."""
    model, loader = rank_model(d.device, s, plan, threads, arenas)
    out = {"h2d": h2d_rate(), "matmul": matmul_rate(), "runs": []}
    cache = model.new_cache(1, max(s.bench.prompt_lengths), d.device)
    knobs = Knobs(ring_len=plan.prefill.ring_len or None, group=plan.prefill.slp_group_experts,
                  budget_gb=plan.gpu.memory_budget_gb or None)
    for n in s.bench.prompt_lengths:
        for mode in MODES:
            out["runs"].append(_measure(d, model, cache, loader, n, mode, knobs))
    return out


def _measure(d: Dist, model, cache, loader: StreamLoader, n: int, mode: str, knobs: Knobs) -> dict:
    """TTFT of an n-token prompt (the second of two runs), then the phases of a third run; the ring over this
    rank's share of the experts, sized for all n tokens (SmallEP holds every rank's tokens in the MoE layers)."""
    a = model.args
    owned = len(shard(a.n_routed_experts, d.rank, d.world))
    ring = streaming(model, d.device, loader, n, knobs, owned)
    prompt = torch.randint(2, a.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()

    waiter = PhaseClock(d.device)  # for its device synchronisation only

    def once(clock=None) -> float:
        d.barrier()
        waiter.sync()
        t0 = time.perf_counter()
        logits = parallel_prefill(model, d, prompt, cache, 0, mode=mode, streaming=ring, clock=clock)
        logits.argmax().item()
        return time.perf_counter() - t0

    once()
    ttft = once()
    clock = PhaseClock(d.device)
    split_total = once(clock)
    return {"n": n, "mode": mode, "ttft_s": ttft, "ring_len": ring.ring_len, "split_total_s": split_total,
            "phases_s": dict(clock.seconds)}


def _records(a, per_rank: list[dict], lengths) -> list[Record]:
    h2d = min(r["h2d"] for r in per_rank)
    mm = min(r["matmul"] for r in per_rank)
    records = [Record("h2d_pinned_per_gpu", h2d, "GB/s"), Record("gpu_bf16_matmul_per_gpu", mm, "TFLOP/s")]
    n_moe = a.n_moe_layers
    for i, run in enumerate(per_rank[0]["runs"]):
        n, mode = run["n"], run["mode"]
        ttft = max(r["runs"][i]["ttft_s"] for r in per_rank)  # the slower rank's: both end with the logits
        bound = bounds.parallel_prefill_bound_seconds(bounds.routed_bytes(a), bounds.prefill_flops(a, n), h2d, mm,
                                                      GPUS)
        split = _split(per_rank, i, n_moe)
        link = (bounds.smallep_link_bytes(n, a.hidden_size, GPUS) if mode == "smallep"
                else bounds.ep_link_bytes(n, a.hidden_size, a.num_experts_per_tok, GPUS))
        records.append(Record("dual_slp_ttft", ttft, "s", bound, n, extra={
            "ep": mode, "tokens_per_s": n / ttft, "ring_len": run["ring_len"], **split,
            "received_per_gpu_per_moe_layer_bytes": link,
            "projected_full_model_s": ttft * FULL_MOE_LAYERS / n_moe,
            "projection": f"{n_moe} MoE layers measured, scaled to {FULL_MOE_LAYERS} (a projection, not a "
                          "measurement)"}))
    return records


def _split(per_rank: list[dict], i: int, n_moe: int) -> dict:
    """Seconds per MoE layer of each phase (the slower rank's), and the rest of the synchronised run."""
    runs = [r["runs"][i] for r in per_rank]
    out = {f"{ph}_per_layer_s": max(r["phases_s"].get(ph, 0.0) for r in runs) / n_moe for ph in PHASES}
    total = max(r["split_total_s"] for r in runs)
    moe = max(sum(r["phases_s"].values()) for r in runs)
    out["attention_and_rest_s"] = total - moe
    out["split_run_s"] = total
    return out
