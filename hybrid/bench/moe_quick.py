"""One MoE layer of DeepSeek-V3's shape on the CPU kernels, quickly: `python -m hybrid.bench.moe_quick`.

bench=kernels generates every expert of the layer (11 GB for 256 experts: minutes on a few cores); this draws
`--distinct` experts' FP8 weights (48: 2.1 GB, several times any L3) and lets the layer's 256 experts use them in
turn, so every expert's bytes still come from DRAM. Each expert gets exactly `--tokens-per-expert` tokens (16: the
T = 512 case of top-8 over 256 experts), or with `--routing random` that many on average, each token's top-k drawn
uniformly as bench=kernels draws them. Prints time, GB/s of expert bytes against the read roof measured in the
same run, and TFLOP/s, per kernel variant. `--amx-prefetch=-1,0,512`: variant amx at each prefetch distance
(set_amx_prefetch); `--amx-overlap=1,0`: with the next weight slab converted while the tiles multiply and without
(set_amx_overlap); `--lag-rounds=2,1`: an expert's down tasks queued that many rounds of tasks behind its gate/up
tasks (set_moe_lag_rounds); `--order=longest,ids`: the experts' tasks queued by token count, most first (the
default), or by expert id (set_moe_longest_first); every combination is a way, the ways alternating within each
repeat. Per way, the threads' time waiting for another's task and idle at the layer's end, and in each stage of
the tasks (activations packed, the gate/up GEMMs, SiLU, the down GEMM, the weighted sums: CpuMoE.stage_s), as
shares of threads x time.

`--lanes N`: decode's two-request step instead, N times per way, side by side: one call of two tokens; two one-token
calls in turn (each joined before the next is submitted: a job's tail and the next one's start do not overlap); two
one-token calls queued (dual-batch decode's two lanes, an op and its twin: the pool's workers go from one to the
next as each runs out of tasks). Each step routes both tokens afresh."""
from __future__ import annotations

import argparse
import time

import torch

from hybrid.kernels import membw
from hybrid.kernels.dispatch import available
from hybrid.kernels.gemm import AMX_MIN_TOKENS, set_amx_min_tokens, set_amx_overlap, set_amx_prefetch
from hybrid.kernels.moe import CpuMoE, set_moe_lag_rounds, set_moe_longest_first
from hybrid.kernels.thread_pool import set_threads, threads


def fp8_weight(n: int, k: int) -> torch.Tensor:
    """Random E4M3 codes without the NaN codes (0x7F, 0xFF)."""
    codes = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8) | (torch.randint(0, 2, (n, k), dtype=torch.uint8) << 7)
    return codes.view(torch.float8_e4m3fn)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="amx,avx512_bf16", help="variants, comma-separated (those this CPU lacks "
                    "are skipped)")
    ap.add_argument("--threads", type=int, default=0, help="0: every CPU this process may run on")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--distinct", type=int, default=48)
    ap.add_argument("--tokens-per-expert", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--routing", choices=("balanced", "random"), default="balanced",
                    help="balanced: exactly tokens-per-expert tokens on every expert; random: each token's top-k "
                         "drawn uniformly (the counts vary around tokens-per-expert, as in bench=kernels)")
    ap.add_argument("--amx-min-tokens", type=int, default=AMX_MIN_TOKENS, help="tokens per expert from which the "
                    f"amx variant runs AMX tiles (default: {AMX_MIN_TOKENS}, policy.cpu.amx_min_tokens' null)")
    ap.add_argument("--amx-prefetch", default="-1", help="variant amx: bytes ahead prefetched into L2, comma-"
                    "separated ways (-1: the next 32-row group's same spot, the default; 0: none; n: n bytes along "
                    "the row)")
    ap.add_argument("--amx-overlap", default="1", help="variant amx: 1 = the next slab converted while the tiles "
                    "multiply (the default), 0 = after them; comma-separated ways")
    ap.add_argument("--lag-rounds", default="2", help="rounds of tasks (one per thread) an expert's down tasks are "
                    "queued behind its gate/up tasks (2: the default); comma-separated ways")
    ap.add_argument("--order", default="longest", help="the experts' tasks queued by token count, most first "
                    "(longest, the default) or by expert id (ids); comma-separated ways")
    ap.add_argument("--roof-gb", type=float, default=4.0, help="buffer of the read-roof probe (GB)")
    ap.add_argument("--lanes", type=int, default=0, help="time decode's two-request step this many times per way "
                    "(one two-token call, two one-token calls in turn, two queued) instead of the layer")
    a = ap.parse_args(argv)
    E, tpe, K, D, I = a.experts, a.tokens_per_expert, a.top_k, 7168, 2048
    if set(a.order.split(",")) - {"longest", "ids"}:
        ap.error(f"--order: ways are 'longest' and 'ids', not {a.order!r}")
    if (E * tpe) % K:
        ap.error("experts x tokens-per-expert must be a multiple of top-k")
    set_threads(a.threads)
    set_amx_min_tokens(a.amx_min_tokens)
    torch.manual_seed(0)
    scale = lambda n, k: torch.rand((n + 127) // 128, (k + 127) // 128) * 1e-2 + 1e-3  # noqa: E731
    n = min(a.distinct, E)
    w = [[fp8_weight(I, D) for _ in range(n)], [fp8_weight(I, D) for _ in range(n)],
         [fp8_weight(D, I) for _ in range(n)]]
    s = [[scale(I, D) for _ in range(n)], [scale(I, D) for _ in range(n)], [scale(D, I) for _ in range(n)]]
    turn = lambda xs: [xs[e % n] for e in range(E)]  # noqa: E731
    T = E * tpe // K
    if a.routing == "balanced":
        ids = torch.arange(E).repeat(tpe)[torch.randperm(E * tpe)].view(T, K)
    else:
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    counts = torch.bincount(ids.flatten(), minlength=E)
    x, weights = torch.randn(T, D).to(torch.bfloat16), torch.rand(T, K)
    roof = max(membw.read_roof(a.roof_gb, 3, streams) for streams in (8, 16))
    used = int((counts > 0).sum())  # the experts a token picked: only theirs are read
    gb, flop = used * 3 * I * D / 1e9, 2 * 3 * I * D * E * tpe
    print(f"{threads()} threads, read roof {roof:.1f} GB/s; one layer: {E} experts ({n} distinct), T = {T}, "
          f"{tpe} tokens per expert ({a.routing}: {int(counts.min())}-{int(counts.max())}), {used} experts used, "
          f"{gb:.1f} GB of experts read")
    have = set(available())
    if a.lanes:
        return lanes(a, [k for k in a.kernels.split(",") if k in have], turn(w[0]), turn(w[1]), turn(w[2]),
                     turn(s[0]), turn(s[1]), turn(s[2]), roof)
    for kernel in a.kernels.split(","):
        if kernel not in have:
            print(f"{kernel}: not on this CPU, skipped")
            continue
        op = CpuMoE(turn(w[0]), turn(w[1]), turn(w[2]), turn(s[0]), turn(s[1]), turn(s[2]), kernel=kernel)
        amx = [(int(pf), int(ov)) for pf in a.amx_prefetch.split(",") for ov in a.amx_overlap.split(",")] \
            if kernel == "amx" else [(-1, 1)]
        ways = [(pf, ov, int(lag), order) for pf, ov in amx for lag in a.lag_rounds.split(",")
                for order in a.order.split(",")]
        ts: dict = {way: [] for way in ways}
        for r in range(a.repeats + 1):  # the first round warms up
            for way in ways:
                set_amx_prefetch(way[0])
                set_amx_overlap(bool(way[1]))
                set_moe_lag_rounds(way[2])
                set_moe_longest_first(way[3] == "longest")
                t0 = time.perf_counter()
                op(x, ids, weights)
                if r:
                    sec = time.perf_counter() - t0
                    share = {k: v / (threads() * sec) for k, v in op.stage_s.items()}
                    share.update(waiting=op.wait_s / (threads() * sec), end=op.tail_s / (threads() * sec))
                    ts[way].append((sec, share))
        set_amx_prefetch(-1)
        set_amx_overlap(True)
        set_moe_lag_rounds(2)
        set_moe_longest_first(True)
        for way, runs in ts.items():
            t = sorted(sec for sec, _ in runs)
            best, med = t[0], t[len(t) // 2]
            mean = {k: sum(share[k] for _, share in runs) / len(runs) for k in runs[0][1]}
            name = kernel if kernel != "amx" else f"{kernel} pf {way[0]} ov {way[1]}"
            print(f"{name:12s} lag {way[2]} {way[3]:7s}  best {best * 1e3:7.1f} ms  median {med * 1e3:7.1f} ms  "
                  f"{gb / best:6.1f} GB/s ({gb / best / roof:4.0%} of the roof)  {flop / best / 1e12:5.2f} TFLOP/s  "
                  f"waiting {mean['waiting']:4.1%}  idle at the end {mean['end']:4.1%}  |  prep {mean['prep']:4.1%}  "
                  f"gate/up {mean['gate_up']:4.1%}  SiLU {mean['silu']:4.1%}  down {mean['down']:4.1%}  "
                  f"sums {mean['sums']:4.1%}")


def lanes(a, kernels: list[str], gate, up, down, gs, us, ds, roof: float) -> None:
    """Decode's two-request step three ways, interleaved step by step (the host's bandwidth drifts)."""
    E, K, D = len(gate), a.top_k, gate[0].shape[1]
    per_expert = 3 * gate[0].numel()  # FP8: one byte per weight
    for kernel in kernels:
        op = CpuMoE(gate, up, down, gs, us, ds, kernel=kernel)
        twin = op.twin()
        ways = {"one call of 2 tokens": [], "two calls in turn": [], "two calls queued": []}
        read = 0
        for step in range(a.lanes + 1):
            ids = torch.stack([torch.randperm(E)[:K] for _ in range(2)])
            x, wts = torch.randn(2, D).to(torch.bfloat16), torch.rand(2, K)
            read = len(set(ids.flatten().tolist())) * per_expert
            for way in ways:
                t0 = time.perf_counter()
                if way.startswith("one"):  # submitted, as decode's host nodes do (the pool's workers alone)
                    op.submit(x, ids, wts), op.wait()
                elif way.endswith("turn"):
                    op.submit(x[:1], ids[:1], wts[:1]), op.wait()
                    twin.submit(x[1:], ids[1:], wts[1:]), twin.wait()
                else:
                    op.submit(x[:1], ids[:1], wts[:1]), twin.submit(x[1:], ids[1:], wts[1:])
                    op.wait(), twin.wait()
                if step:  # the first step warms up
                    ways[way].append((time.perf_counter() - t0, read))
        for way, runs in ways.items():
            ts = sorted(t for t, _ in runs)
            med = ts[len(ts) // 2]
            gbs = sorted(r / t / 1e9 for t, r in runs)[len(runs) // 2]
            print(f"{kernel:12s} {way:22s} median {med * 1e3:6.2f} ms  best {ts[0] * 1e3:6.2f} ms  "
                  f"{gbs:6.1f} GB/s of experts ({gbs / roof:4.0%} of the roof)")


if __name__ == "__main__":
    main()
