"""How long one long prefill attention holds decode's GPU work: `python -m hybrid.bench.attention_hold`.

A stream-loading prefill beside decode (policy.prefill.beside_decode) runs each layer's causal attention over the
whole prompt as one kernel. A kernel whose blocks loop over tiles keeps its SMs until it ends, whatever the stream
priorities say, so a decode step that needs the GPU meanwhile waits. This measures, on random tensors of DeepSeek-V3's
attention shape (128 heads, q/k head dim 192, v 128):
* one causal attention over `--tokens` positions, whole (default backend) and in query chunks two ways: one call per
  chunk with a lower-right causal mask, and two mask-free calls per chunk (the keys before the chunk; the chunk's own
  keys, plain causal) merged by their log-sum-exps (hybrid/kernels/attention.py, what the model's prefill runs with
  policy.prefill.attention_chunk_tokens) — each way's time and its largest difference from the whole;
* a decode-like step (12 small GEMMs) on the highest-priority stream, alone and while each way runs on the lowest:
  how many steps got through, their median and their worst time.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

from hybrid.kernels.attention import causal_in_chunks


def masked_chunks(q, k, v, chunk: int, scale: float) -> torch.Tensor:
    """Causal attention, one call per query chunk with a lower-right causal mask (no cuDNN: the mask takes it out)."""
    from torch.nn.attention.bias import causal_lower_right

    S, outs = q.shape[2], []
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        outs.append(F.scaled_dot_product_attention(q[:, :, s0:s1], k[:, :, :s1], v[:, :, :s1],
                                                   attn_mask=causal_lower_right(s1 - s0, s1), scale=scale))
    return torch.cat(outs, 2)


def _seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--chunks", default="4096,2048", help="query chunk sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="hold measurements per way")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_hold needs a CUDA GPU (it measures GPU kernels holding a priority stream)")
    dev, S, H = torch.device("cuda"), a.tokens, a.heads
    scale = 192 ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(1, H, S, 192, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(1, H, S, 128, device=dev, dtype=torch.bfloat16, generator=g)
    whole = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # noqa: E731
    ref = whole()
    ways = {"whole": whole}
    for c in (int(x) for x in a.chunks.split(",")):
        ways[f"masked {c}"] = lambda c=c: masked_chunks(q, k, v, c, scale)
        ways[f"split {c}"] = lambda c=c: causal_in_chunks(q, k, v, scale, c)  # the model's prefill way
    print(f"causal attention, {H} heads, {S} tokens, head dims 192/128, bf16, {torch.cuda.get_device_name()}")
    for name, fn in ways.items():
        try:
            diff = (fn().float() - ref.float()).abs().max().item()
            print(f"  {name:12s} {_seconds(fn) * 1e3:8.1f} ms   max |diff| vs whole {diff:.2e}")
        except RuntimeError as e:
            print(f"  {name:12s} failed: {str(e).splitlines()[0][:160]}")
            ways[name] = None

    low, high = torch.cuda.Stream.priority_range()
    lo, hi = torch.cuda.Stream(priority=low), torch.cuda.Stream(priority=high)
    w = [torch.randn(7168, 2048, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(6)]
    x1 = torch.randn(1, 7168, device=dev, dtype=torch.bfloat16, generator=g)

    def step():
        y = x1
        for m in w:
            y = (y @ m) @ m.T
        return y

    with torch.cuda.stream(hi):
        alone = _seconds(step, 20)
    print(f"decode-like step alone on the highest-priority stream: {alone * 1e3:.2f} ms")
    for name, fn in ways.items():
        if fn is None:
            continue
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            done = torch.cuda.Event()
            with torch.cuda.stream(lo):
                fn()
                done.record(lo)
            ts = []
            with torch.cuda.stream(hi):
                while not done.query():
                    t0 = time.perf_counter()
                    step()
                    hi.synchronize()
                    ts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            ts.sort()
            if ts:
                print(f"  during {name:12s} {len(ts):4d} steps, median {ts[len(ts) // 2] * 1e3:6.2f} ms, worst "
                      f"{ts[-1] * 1e3:6.1f} ms ({ts[-1] / alone:.0f}x alone)")


if __name__ == "__main__":
    main()
