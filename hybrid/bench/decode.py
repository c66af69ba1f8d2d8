"""`mode=bench bench=decode`: hybrid decode on the configured model (meant for model=dsv3_slice): per context
length, TPOT and where the step's time goes per layer (device attention / router / shared experts / dense MLP,
host staging, CPU MoE, waits), routed-expert bytes read per token against the read roof measured in the same run,
GPU- and CPU-idle fractions, and a projection to the full 61-layer model (labelled as one). On a GPU the same
steps also run under CUDA graphs (`bench.graph_modes`: hostfn, segments) — graph vs eager. Graphed steps cannot be
split per layer; their records give TPOT, the bound, CPU-idle (the native op's own clock) and GPU-idle (kernel time
from torch.profiler over a few more steps).

The sequences sit at the context length without prefilling it: attention reads every cached position up to the
current one whatever the values, so a step's cost at context C is that of a real step at C.

Without a GPU every layer runs on the CPU in turn (the routed experts too: placement runs them synchronously, the
shared experts after them), so host clocks around each layer split the step exactly: `split.outside_layers` is the
rest (embeddings, final norm, lm_head, sampling), counted once in the projection, not per layer, and `split.lm_head`
lm_head alone; `split.cpu_moe` is the routed experts alone (their submit-to-join span, less the shared experts run
inside it); the idle fractions there are shares of the step (no device idles beside another). The CPU runs every
weight, so its bound is all of them: `all_bytes_per_token` (bounds.cpu_decode_bytes, by part in its record) over
the read roof measured in the same run (`decode_vs_all_bytes_bound`), and `weight_read_gbs` what the step reached.
`attention_per_layer` is attention's time per layer against reading that layer's attention weights and the
cache at the roof (`bound_ms`, `vs_bound`).

Under policy.cpu.numa (docs/design/numa.md): each node's read roof, local and remote (`node_read_roof`), and per
context the routed-expert bytes each node's threads read in a step against each node's local roof
(`node_bytes_per_step`). `bench.numa` runs the whole benchmark at each value of policy.cpu.numa, the model placed
anew for each, every record carrying its `numa`.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import sys
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from hybrid.bench import bounds, numa
from hybrid.bench.gpu_profile import gpu_times
from hybrid.bench.records import Record, Records
from hybrid.engine.build import build
from hybrid.engine.profile import HOST_PARTS, StepProfile
from hybrid.errors import ConfigError
from hybrid.kernels.membw import calibrate, read_roof
from hybrid.model.kv_cache import KVCache
from hybrid.model.moe import MoE
from hybrid.model.transformer import Block
from hybrid.weights.presets import DEEPSEEK_V3

if TYPE_CHECKING:
    from hybrid.engine.cuda_graphs import GraphedDecode

FULL_DENSE_LAYERS = DEEPSEEK_V3["first_k_dense_replace"]  # the full model projected to: 61 layers, 3 dense
FULL_MOE_LAYERS = DEEPSEEK_V3["num_hidden_layers"] - FULL_DENSE_LAYERS
DEVICE_PARTS = ("attention", "router", "shared_experts", "dense_mlp")


def _timed(engine, cfg, ctx: int, step, on_warm=None, steps: int = 0) -> list[float]:
    dev, b = engine.device, cfg.batch
    slots = torch.arange(b, device=dev)
    tokens = torch.randint(2, engine.model.args.vocab_size, (b, 1), device=dev)
    times = []
    n = steps or cfg.steps + 2  # two warm-up steps (graphs are captured in the first)
    for i in range(n):
        if i == 2 and on_warm:
            on_warm()
        pos = torch.full((b, 1), ctx - n + i, device=dev)  # the last step attends over exactly ctx positions
        t0 = time.perf_counter()
        step(tokens, pos, slots, ctx - n + i + 1).argmax(-1).tolist()  # the sampler's hand-back: one sync
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


class _LayerClocks:
    """Host clocks around each decoder layer (the CPU device: layers run one after another), summed by kind."""

    def __init__(self, model):
        self.seconds: dict[str, float] = defaultdict(float)
        self.open: dict[int, float] = {}
        self.handles = []
        for block in (m for m in model.modules() if isinstance(m, Block)):
            kind = "moe_layers" if isinstance(block.mlp, MoE) else "dense_layers"
            self._clock(block, kind)
        self._clock(model.lm_head, "lm_head")

    def _clock(self, module, kind: str) -> None:
        self.handles += [module.register_forward_pre_hook(self._pre),
                         module.register_forward_hook(functools.partial(self._post, kind))]

    def _pre(self, mod, args) -> None:
        self.open[id(mod)] = time.perf_counter()

    def _post(self, kind, mod, args, out) -> None:
        self.seconds[kind] += time.perf_counter() - self.open.pop(id(mod))

    def reset(self) -> None:
        self.seconds.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _context(engine, cfg, ctx: int) -> tuple[list[float], dict]:
    profile = StepProfile(engine.model, engine.device)
    clocks = _LayerClocks(engine.model) if engine.device.type == "cpu" else None

    def reset():
        profile.reset()
        if clocks:
            clocks.reset()
    try:
        times = _timed(engine, cfg, ctx, engine.decoder("off"), reset)
        return times, {**profile.summary(), **(clocks.seconds if clocks else {})}
    finally:
        profile.close()  # hooks off: graphs are captured without them
        if clocks:
            clocks.close()


def _graphed(engine, cfg, ctx: int, graphs: GraphedDecode) -> tuple[list[float], dict]:
    jobs0 = {}

    def snapshot():
        jobs0.update({id(j): j.cpu_s for j in graphs.jobs()})
    times = _timed(engine, cfg, ctx, graphs, snapshot)
    jobs = graphs.jobs()
    wall, busy, _ = gpu_times(lambda: _timed(engine, cfg, ctx, graphs, steps=3))  # kernel records, a few steps
    return times, {"cpu_moe": sum(j.cpu_s - jobs0.get(id(j), 0.0) for j in jobs), "gpu_busy": busy["kernels_s"] / wall}


def run(settings) -> list[Record]:
    s, cfg = settings, settings.bench
    if min(cfg.contexts) < cfg.steps + 2:
        raise ConfigError(f"bench.contexts must be at least bench.steps + 2 = {cfg.steps + 2} (the steps end there)")
    if max(cfg.contexts) > s.policy.kv.max_context:
        raise ConfigError(f"bench.contexts reach {max(cfg.contexts)} but the KV cache "
                          f"holds policy.kv.max_context={s.policy.kv.max_context}: raise policy.kv.max_context")
    if cfg.batch > s.policy.kv.max_batch:
        raise ConfigError(f"bench.batch={cfg.batch} exceeds policy.kv.max_batch={s.policy.kv.max_batch}")
    if not cfg.numa:
        return _run(s, cfg)
    records, plans = [], {}
    for on in cfg.numa:  # each way on the model placed anew (its experts bound, or not)
        c = s.policy.cpu
        way = dataclasses.replace(c, numa=on, numa_simulated=c.numa_simulated if on else 0)
        got = _run(dataclasses.replace(s, policy=dataclasses.replace(s.policy, cpu=way)), cfg)
        records += [dataclasses.replace(r, extra={**r.extra, "numa": on}) for r in got]
        plans[f"numa_{str(on).lower()}"] = got.context["plan"]
        gc.collect()  # the way's engine and model gone before the next is placed
    return Records(records, {"plan": plans[f"numa_{str(cfg.numa[0]).lower()}"], "plans": plans})


def _run(s, cfg) -> Records:
    engine = build(s, s.hw, progress=sys.stderr.isatty())
    a = engine.model.args
    n_moe, expert_bytes = a.n_moe_layers, bounds.expert_bytes(a)
    streams, _ = calibrate(cfg.roof_gb)
    roof = read_roof(cfg.roof_gb, 5, streams)
    print(f"decode on {engine.device}: {n_moe} MoE layers, roof {roof:.1f} GB/s", file=sys.stderr)
    cpu = engine.plan.cpu
    nodes = numa.node_roofs(cpu, cfg.roof_gb, streams)
    graphable = engine.device.type == "cuda" and cpu.moe_backend == "native" and not cpu.deferred_experts
    modes = ["eager"] + (list(cfg.graph_modes) if graphable else [])
    graphs = {m: engine.decoder(m) for m in modes[1:]}
    records = [Record("read_roof", roof, "GB/s", extra={"streams": streams}), *nodes]
    for ctx in cfg.contexts:
        syncs0 = engine.placed.staging.syncs
        times, parts = _context(engine, cfg, ctx)
        records += _records(cfg, ctx, times, parts, roof, expert_bytes, n_moe, a.first_k_dense_replace,
                            (engine.placed.staging.syncs - syncs0) / (cfg.steps + 2), s, a)
        if cpu.numa and cpu.moe_backend == "native":  # the last step's MoE calls, each node's share of them
            read = numa.node_bytes(engine.model)
            records.append(Record("node_bytes_per_step", sum(read), "B", extra={
                "context": ctx, "batch": cfg.batch, **numa.node_extra(read, numa.local_roofs(nodes),
                                                                        statistics.median(times))}))
        eager_tpot, experts = statistics.median(times), parts["experts_read"] / len(times)
        for mode, g in graphs.items():
            times, parts = _graphed(engine, cfg, ctx, g)
            records += _graph_records(cfg, ctx, mode, times, parts, experts * expert_bytes, roof, eager_tpot)
    for mode in modes:
        tpot = {r.extra["context"]: r.value for r in records if r.name == "tpot" and r.extra["mode"] == mode}
        first, last = cfg.contexts[0], cfg.contexts[-1]
        records.append(Record("tpot_ratio", tpot[last] / tpot[first], "x",
                              extra={"from_context": first, "to_context": last, "mode": mode}))
    return Records(records, {"plan": engine.plan.params()})


def _step_records(cfg, ctx, mode, times, bytes_step, roof, **tpot_extra) -> tuple[dict, Record, Record]:
    """The fields every record of a mode shares, and its TPOT and TPOT-vs-bound records."""
    b, tpot = cfg.batch, statistics.median(times)
    bound = bounds.read_seconds(bytes_step, roof)
    common = {"context": ctx, "batch": b, "mode": mode}
    return (common,
            Record("tpot", tpot, "s", None, b, extra={**common, "tokens_per_s": b / tpot, **tpot_extra,
                                                      "min_s": min(times)}),
            Record("decode_vs_expert_bound", bound / tpot, "fraction", 1.0, b,
                   extra={**common, "bound_s": bound, "roof_gbs": roof}))


def _graph_records(cfg, ctx, mode, times, parts, bytes_step, roof, eager_tpot) -> list[Record]:
    steps, tpot = len(times), statistics.median(times)
    common, tpot_record, bound_record = _step_records(cfg, ctx, mode, times, bytes_step, roof)
    return [
        tpot_record, bound_record,
        Record("graph_speedup", eager_tpot / tpot, "x", extra={**common, "eager_tpot_s": eager_tpot}),
        Record("cpu_idle_fraction", max(0.0, 1 - parts["cpu_moe"] / steps / tpot), "fraction", extra=common),
        Record("gpu_idle_fraction", 1 - parts["gpu_busy"], "fraction",
               extra={**common, "note": "1 - GPU kernel time / wall time over 3 steps under torch.profiler"}),
        Record("split.cpu_moe", parts["cpu_moe"] / steps * 1e3, "ms/step", extra=common),
    ]


def project(tpot: float, per_step: dict, n_moe: int, n_dense: int) -> float:
    """TPOT of the full model from a slice's step: a dense layer costs its attention share plus its MLP; a MoE layer
    the rest of the step, divided among the slice's MoE layers (embeddings, lm_head and sampling are counted in it,
    so the projection errs high)."""
    layers = n_moe + n_dense
    dense = per_step.get("attention", 0.0) / layers + per_step.get("dense_mlp", 0.0) / max(n_dense, 1)
    moe = (tpot - n_dense * dense) / n_moe
    return FULL_MOE_LAYERS * moe + FULL_DENSE_LAYERS * dense


def project_cpu(per_step: dict, n_moe: int, n_dense: int) -> float:
    """TPOT of the full model from a slice's step on the CPU, its layers clocked one by one: each kind of layer at
    its mean time, and what runs outside the layers once."""
    return (FULL_MOE_LAYERS * per_step["moe_layers"] / n_moe
            + FULL_DENSE_LAYERS * per_step.get("dense_layers", 0.0) / max(n_dense, 1) + per_step["outside_layers"])


def _all_bytes_records(a, s, common: dict, tpot: float, roof: float) -> list[Record]:
    """The CPU-only bound: every weight byte a step reads (as this path reads them) at the read roof."""
    b = common["batch"]
    parts = bounds.cpu_decode_bytes(a, b, lm_head_fp8=s.policy.cpu.lm_head == "fp8")
    total = sum(parts.values())
    bound = bounds.read_seconds(total, roof)
    return [
        Record("all_bytes_per_token", total / b, "B", extra={**common, **{f"{k}_mb": round(v / 1e6, 1)
                                                                        for k, v in parts.items()}}),
        Record("decode_vs_all_bytes_bound", bound / tpot, "fraction", 1.0, b,
               extra={**common, "bound_s": bound, "roof_gbs": roof}),
        Record("weight_read_gbs", total / tpot / 1e9, "GB/s", roof, b, extra=common),
    ]


def _attention_record(a, common: dict, attention_s: float, ctx: int, roof: float) -> Record:
    """Attention's time per layer on the CPU against reading what it must at the roof: the layer's weights (as
    this path reads them) and every sequence's cache up to `ctx` (docs/perf/cpu-attention.md)."""
    b = common["batch"]
    weights = bounds.cpu_decode_bytes(a, b)["attention"] / a.num_hidden_layers
    cache = b * ctx * KVCache.bytes_per_token(1, a.kv_lora_rank, a.qk_rope_head_dim)  # BF16, as the CPU keeps it
    bound = bounds.read_seconds(weights + cache, roof)
    per_layer = attention_s / a.num_hidden_layers
    return Record("attention_per_layer", per_layer * 1e3, "ms", extra={
        **common, "bound_ms": bound * 1e3, "vs_bound": per_layer / bound, "weight_bytes": int(weights),
        "cache_bytes": int(cache), "roof_gbs": roof})


def _records(cfg, ctx, times, parts, roof, expert_bytes, n_moe, n_dense, syncs, s, a=None) -> list[Record]:
    steps, b = len(times), cfg.batch
    tpot = statistics.median(times)
    per_step = {k: v / steps for k, v in parts.items()}
    on_cpu = "moe_layers" in per_step
    if on_cpu:  # the shared experts ran between the experts' submission and their join
        per_step["cpu_moe"] -= per_step.get("shared_experts", 0.0)
        per_step["outside_layers"] = max(0.0, tpot - per_step["moe_layers"] - per_step.get("dense_layers", 0.0))
    bytes_step = per_step["experts_read"] * expert_bytes
    device_busy = sum(per_step.get(k, 0.0) for k in DEVICE_PARTS)
    common, tpot_record, bound_record = _step_records(cfg, ctx, "eager", times, bytes_step, roof,
                                                      syncs_per_step=syncs)
    bound = bound_record.extra["bound_s"]
    out = [
        tpot_record,
        Record("expert_bytes_per_token", bytes_step / b, "B", extra={**common, "experts_per_step":
                                                                     per_step["experts_read"]}),
        bound_record,
        Record("gpu_idle_fraction", max(0.0, 1 - device_busy / tpot), "fraction", extra=common),
        Record("cpu_idle_fraction", max(0.0, 1 - per_step["cpu_moe"] / tpot), "fraction", extra=common),
    ]
    for part in DEVICE_PARTS + HOST_PARTS + ("outside_layers", "lm_head"):
        if part in per_step:
            out.append(Record(f"split.{part}", per_step[part] * 1e3, "ms/step", extra=common))
    scale = FULL_MOE_LAYERS / n_moe
    how = (f"this machine, from the step's split: {FULL_MOE_LAYERS} x the MoE-layer time + {FULL_DENSE_LAYERS} x "
           "the dense-layer time")
    if on_cpu:
        projected, how = project_cpu(per_step, n_moe, n_dense), how + " + the time outside the layers, once"
    else:
        projected = project(tpot, per_step, n_moe, n_dense)
    out.append(Record("projected_tpot_61_layers", projected, "s", extra={**common, "projection": how}))
    if on_cpu:
        out += _all_bytes_records(a, s, common, tpot, roof)
        out.append(_attention_record(a, common, per_step["attention"], ctx, roof))
    if s.hw.cpu.mem_bw_gbps and bound > 0:
        frac = min(1.0, bound / tpot)
        t_hw = bounds.read_seconds(bytes_step * scale, s.hw.cpu.mem_bw_gbps * frac)
        out.append(Record("projected_tpot_61_layers_on_profile", t_hw, "s", extra={
            **common, "projection": f"{s.hw.name}: expert bytes / ({s.hw.cpu.mem_bw_gbps} GB/s x {frac:.2f}, the "
                                    "fraction of the roof reached here)"}))
    return out
