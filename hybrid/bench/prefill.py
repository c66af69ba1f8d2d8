"""`mode=bench bench=prefill`: stream-loading prefill (SLP) against its bound, the CPU path beside it (on two GPUs,
policy.prefill.gpus=2: hybrid/bench/prefill_dual.py); `bench.sweep` ({policy key: values}, e.g.
{prefill.ring_len: [8, 32]}) times the longest prompt again on the engine replanned at every combination.

Bound per prompt: max(routed-expert bytes ÷ pinned host-to-device rate, the prefill's matmul FLOPs ÷ GPU BF16 matmul
rate), both rates measured in this run. SLP moves every expert of every MoE layer once per prompt. Beside it, not
instead: the same bound with the causal attention's FLOPs at the attention kernel's own measured rate (long prompts
spend much of their compute there, and no attention kernel runs at the GEMM rate).
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from hybrid.bench import bounds, sweep, timeline
from hybrid.bench.decode import FULL_MOE_LAYERS
from hybrid.bench.gpu_profile import gpu_times
from hybrid.bench.records import Record, Records, save_log_plot
from hybrid.bench.timing import cuda_seconds
from hybrid.config.bench import label, points
from hybrid.config.compose import RUNS_DIR
from hybrid.engine.build import build, warm_up_experts
from hybrid.errors import ConfigError
from hybrid.kernels import fp8_linear
from hybrid.locking import unique_path


def h2d_rate(gigabytes: float = 1.0) -> float:
    src = torch.empty(int(gigabytes * 1e9), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, src.numel() / (time.perf_counter() - t0) / 1e9)
    return best


def matmul_rate(m: int = 8192, n: int = 2048, k: int = 7168) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return bounds.gemm_flops(m, n, k) / cuda_seconds(lambda i: a @ b.t(), 20) / 1e12


def _ttft(engine, n: int, streamed: bool = True, loop: dict | None = None, **stream) -> float:
    """Seconds to the first token of an n-token prompt (stream-loaded, or on the CPU path); `stream` (ring_len,
    group, gemm) replaces the plan's; `loop` receives the expert loops' wall and CPU seconds (model thread) when the
    prompt streamed."""
    prompt = torch.randint(2, engine.model.args.vocab_size, (n,)).tolist()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits, pipes = engine.prefill(prompt, streamed=streamed, **stream)
    logits.argmax().item()
    t = time.perf_counter() - t0
    if loop is not None and pipes:
        loop.update(expert_loop_s=sum(p["expert_loop_s"] for p in pipes),
                    expert_loop_cpu_s=sum(p["expert_loop_cpu_s"] for p in pipes))
    return t


def _cpu_only(engine, cfg) -> Records:
    """Without a GPU: the CPU path's TTFT at each prompt length up to bench.cpu_max_tokens (every token through
    every layer), with its matmul rate (bounds.prefill_flops / TTFT)."""
    a, records = engine.model.args, []
    lengths = [n for n in cfg.prompt_lengths if n <= cfg.cpu_max_tokens]
    if not lengths or max(lengths) > engine.plan.kv.max_context:
        raise ConfigError(f"bench=prefill without a GPU times prompts up to bench.cpu_max_tokens="
                          f"{cfg.cpu_max_tokens} that fit policy.kv.max_context={engine.plan.kv.max_context}")
    if cfg.sweep:
        print("bench=prefill: bench.sweep times stream-loading, which needs a GPU: not run", file=sys.stderr)
    _ttft(engine, min(lengths), streamed=False)  # warm-up
    for n in lengths:
        t = _ttft(engine, n, streamed=False)
        gflop = bounds.prefill_flops(a, n) / 1e9
        records.append(Record("cpu_path_ttft", t, "s", None, n, extra={"tokens_per_s": n / t, "gflop": gflop,
                                                                      "gflop_s": gflop / t}))
    return Records(records, {"plan": engine.plan.params()})


def _tile_sweep(engine, n: int, specs) -> list[Record]:
    """TTFT with each Triton tile for prefill-sized row counts (`bench.fp8_tiles`)."""
    if not specs or fp8_linear.triton is None:
        return []
    default, out = engine.placed.gemm, []
    for spec in specs:
        gemm = default.with_("triton", fp8_linear.Tile.parse(spec))  # every row count through the FP8 (W4A16) GEMM
        warm_up_experts(engine.model.args, engine.device, gemm)  # compile outside the timing
        out.append(Record("slp_fp8_tile", _ttft(engine, n, gemm=gemm), "s", None, n,
                          extra={"tile": str(gemm.large_tile), "default": str(default.large_tile)}))
    return out


def attention_rate(a, n: int) -> float:
    """TFLOP/s of the causal attention kernel prefill uses (torch's SDPA, BF16), at the model's head shapes and n
    tokens, measured here."""
    h = a.num_attention_heads  # laid out as prefill's are: [B, S, H, K] seen as [B, H, S, K], v split off kv
    q, k = (torch.randn(1, n, h, a.qk_head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    kv = torch.randn(1, n, h, a.qk_nope_head_dim + a.v_head_dim, device="cuda", dtype=torch.bfloat16)
    v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)[1].transpose(1, 2)
    flops = bounds.attention_flops(a, n, 1)
    reps = max(1, min(20, int(2e14 // flops)))
    seconds = cuda_seconds(lambda i: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.softmax_scale),
                           reps)
    return flops / seconds / 1e12


def run(settings) -> list[Record]:
    s, cfg = settings, settings.bench
    if s.policy.prefill.gpus == 2:  # one process per GPU: hybrid/bench/prefill_dual.py
        from hybrid.bench.prefill_dual import run as run_dual

        if cfg.sweep:
            raise ConfigError("bench.sweep: not with policy.prefill.gpus=2 (its ranks time both policy.prefill.ep "
                              "modes at each prompt length)")

        return run_dual(s)
    for spec in cfg.fp8_tiles:  # before minutes of set-up
        fp8_linear.Tile.parse(spec)
    sweep.check(cfg.sweep)
    engine = build(s, s.hw, progress=sys.stderr.isatty())
    if engine.device.type == "cpu" and s.policy.cpu.moe_backend == "native":
        return _cpu_only(engine, cfg)
    if engine.device.type != "cuda" or engine.placed.loader is None:
        raise ConfigError("bench=prefill streams experts through a GPU: it needs a GPU profile (+hw=...) with CUDA "
                          "and policy.cpu.moe_backend=native")
    if max(cfg.prompt_lengths) > s.policy.kv.max_context:
        raise ConfigError(f"bench.prompt_lengths reach {max(cfg.prompt_lengths)}: raise policy.kv.max_context")
    a = engine.model.args
    n_moe = a.n_moe_layers
    h2d, mm = h2d_rate(), matmul_rate()
    print(f"pinned H2D {h2d:.1f} GB/s, BF16 matmul {mm:.0f} TFLOP/s", file=sys.stderr)
    records = [Record("h2d_pinned", h2d, "GB/s"), Record("gpu_bf16_matmul", mm, "TFLOP/s")]
    _ttft(engine, min(cfg.prompt_lengths))  # warm-up
    transfer = bounds.transfer_seconds(a, h2d)  # every expert once per prompt
    for n in cfg.prompt_lengths:
        flops, attn = bounds.prefill_flops(a, n), bounds.attention_flops(a, n)
        bound = bounds.prefill_bound_seconds(transfer, flops, mm)
        # beside it (not instead): attention's FLOPs at the attention kernel's own measured rate
        attn_rate = attention_rate(a, n)
        bound_attn = bounds.prefill_bound_seconds(transfer, flops, mm, attn, attn_rate)
        first = _ttft(engine, n)  # a first prompt of a new length also pays the allocator's growth
        loop: dict = {}
        t = _ttft(engine, n, loop=loop)
        records.append(Record("slp_ttft", t, "s", None, n, extra={"tokens_per_s": n / t, "bound_s": bound,
                                                                 "first_run_s": first, **loop,
                                                                 "attention_tflop_s": attn_rate,
                                                                 "bound_attention_at_its_rate_s": bound_attn,
                                                                 "fraction_of_that_bound": bound_attn / t,
                                                                 "fraction_of_bound": bound / t,
                                                                 "projected_61_layers_s": t * FULL_MOE_LAYERS / n_moe}))
        if n <= cfg.cpu_max_tokens:
            tc = _ttft(engine, n, streamed=False)
            records.append(Record("cpu_path_ttft", tc, "s", None, n, extra={"tokens_per_s": n / tc}))
    longest = max(cfg.prompt_lengths)
    for how in fp8_linear.BACKENDS:  # the streamed experts' FP8 (INT4) math: the Triton GEMM, dequantise, by rows
        t = _ttft(engine, longest, gemm=engine.placed.gemm.with_(backend=how))
        quantised = a.fp8_block is not None or a.expert_group is not None
        records.append(Record("slp_fp8_gemm", t, "s", None, longest, extra={
            "backend": how, "weights": "int4" if a.expert_group else "fp8" if a.fp8_block else "bf16",
            "applies": quantised and (how == "dequant" or fp8_linear.triton is not None)}))
    records += _tile_sweep(engine, longest, cfg.fp8_tiles)
    trace = None
    if cfg.trace:
        trace = unique_path(RUNS_DIR / "bench", f"prefill-{time.strftime('%Y%m%d-%H%M%S')}", ".trace.json.gz")
    t, busy, table = gpu_times(lambda: _ttft(engine, longest), trace=trace)
    print(f"stream-loading prefill of {longest} tokens under the profiler ({t:.3f} s), top GPU rows:\n{table}",
          file=sys.stderr)
    if trace is not None:
        print(f"timeline: {trace} (python -m hybrid.bench.timeline {trace})", file=sys.stderr)
        print(json.dumps(timeline.summarise(timeline.load(trace))), file=sys.stderr)
    records += [
        Record("slp_gpu_busy_fraction", busy["kernels_s"] / t, "fraction", None, longest,
               extra={"kernels_s": busy["kernels_s"], "profiled_ttft_s": t,
                      "note": "GPU kernel time (all streams) / TTFT, one run under torch.profiler"}),
        Record("slp_h2d_busy_fraction", busy["h2d_s"] / t, "fraction", None, longest,
               extra={"h2d_s": busy["h2d_s"], "profiled_ttft_s": t}),
    ]
    plan = engine.plan.params()  # the policy's (the sweep replans the engine)
    return Records(records + _sweep(engine, s, longest), {"plan": plan})


def _sweep(engine, s, n: int) -> list[Record]:
    """bench.sweep: an n-token prompt stream-loaded at each point, on the engine replanned for it (`slp_sweep`, the
    point's knobs and the expert loops' times beside each)."""
    out = []
    for point in points(s.bench.sweep) if s.bench.sweep else []:
        engine = sweep.replanned(engine, s, point)
        loop: dict = {}
        t = _ttft(engine, n, loop=loop)
        print(f"  {label(point)}: TTFT {t:.3f} s", file=sys.stderr)
        out.append(Record("slp_sweep", t, "s", None, n, extra={**point, **loop}))
    return out


def plot(records: list[Record], png) -> None:
    """TTFT against prompt length on log axes (like the paper's), SLP and the CPU path, the crossover marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {name: sorted((r.m, r.value) for r in records if r.name == name) for name in ("slp_ttft", "cpu_path_ttft")}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("slp_ttft", "stream-loading prefill (GPU)"), ("cpu_path_ttft", "CPU path")):
        if series[name]:
            ax.plot(*zip(*series[name]), marker="o", label=label)
    cross = crossover(series["slp_ttft"], series["cpu_path_ttft"])
    if cross:
        ax.axvline(cross, linestyle="--", color="grey", label=f"crossover ≈ {cross:.0f} tokens")
    save_log_plot(fig, ax, png, "prompt tokens", "TTFT (s)", "Prefill TTFT")


def crossover(slp: list[tuple[int, float]], cpu: list[tuple[int, float]]):
    """The prompt length where the two TTFT curves cross (log-linear interpolation between measured lengths), or
    None when one path wins over the whole shared range."""
    import math

    common = sorted(set(dict(slp)) & set(dict(cpu)))
    diff = [(n, math.log(dict(cpu)[n]) - math.log(dict(slp)[n])) for n in common]
    for (n0, d0), (n1, d1) in zip(diff, diff[1:]):
        if d0 <= 0 < d1 or d0 >= 0 > d1:
            f = d0 / (d0 - d1)
            return math.exp(math.log(n0) + f * (math.log(n1) - math.log(n0)))
    return None


def both_paths(engine, lengths: list[int]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(length, TTFT) of each prompt length on both prefill paths, stream-loaded and chunked on the CPU: the second
    of two runs each (the first also pays allocations of a new length)."""
    slp, cpu = [], []
    _ttft(engine, min(lengths))  # warm-up
    for n in lengths:
        for streamed, out in ((True, slp), (False, cpu)):
            _ttft(engine, n, streamed=streamed)
            out.append((n, _ttft(engine, n, streamed=streamed)))
    return slp, cpu


def cutoff_at(slp: list[tuple[int, float]], cpu: list[tuple[int, float]]) -> int:
    """policy.prefill.slp_cutoff_tokens from the two TTFT curves: the crossover (prompts up to it go on the CPU);
    where one path wins at every measured length, the longest length (the CPU's) or one below the shortest (SLP's)."""
    cross = crossover(slp, cpu)
    if cross is not None:
        return int(cross)
    lengths = sorted(dict(cpu))
    return lengths[-1] if all(dict(cpu)[n] <= dict(slp)[n] for n in lengths) else max(0, lengths[0] - 1)


def crossover_figure(slp: list[tuple[int, float]], cpu: list[tuple[int, float]], cutoff: int, title: str):
    """TTFT of both prefill paths against prompt length, the cutoff marked (a matplotlib figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*slp), marker="o", label="stream-loading prefill (GPU)")
    ax.plot(*zip(*cpu), marker="o", label="CPU path (chunked)")
    ax.axvline(max(cutoff, 1), linestyle="--", color="grey", label=f"cutoff {cutoff} tokens")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (s)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
