"""What a profiled run's timeline says: a Chrome trace from torch.profiler (`bench=prefill bench.trace=true`)
summarised per GPU stream — busy time, the longest gaps in the GPU's compute and in its host-to-device copies, and
the longest blocking CUDA runtime calls on the host (who waited, for how long, when).

    python -m hybrid.bench.timeline runs/bench/prefill-<time>.trace.json.gz

Times are milliseconds from the first recorded event.
"""
from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
BLOCKING = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc")


def load(path) -> list[dict]:
    path = Path(path)
    raw = gzip.open(path, "rt") if path.suffix == ".gz" else open(path)
    with raw as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def union(intervals) -> list[tuple[float, float]]:
    """Overlapping [start, end) intervals merged, in order."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def gaps(merged, least: float) -> list[tuple[float, float]]:
    """(start, length) of the idle stretches of at least `least` between merged intervals, longest first."""
    found = [(e0, s1 - e0) for (_, e0), (s1, _) in zip(merged, merged[1:]) if s1 - e0 >= least]
    return sorted(found, key=lambda g: -g[1])


def _busy(merged) -> float:
    return sum(e - s for s, e in merged)


def summarise(events: list[dict], min_gap_us: float = 500.0, top: int = 8) -> dict:
    t0 = min((e["ts"] for e in events), default=0.0)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    span = (max((e["ts"] + e["dur"] for e in events), default=t0) - t0) / 1e3

    def iv(es):
        return union((e["ts"], e["ts"] + e["dur"]) for e in es)

    streams = defaultdict(list)
    for e in gpu:
        streams[str(e.get("args", {}).get("stream", e.get("tid")))].append(e)
    per_stream = {s: {"busy_ms": _busy(iv(es)) / 1e3, "events": len(es),
                      "kinds": sorted({e["cat"] for e in es})} for s, es in streams.items()}
    compute, h2d = iv(e for e in gpu if e["cat"] == "kernel"), iv(
        e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"])
    both = union(compute + h2d)
    overlap = _busy(compute) + _busy(h2d) - _busy(both)

    def ms(g):
        return [{"at_ms": round((s - t0) / 1e3, 2), "ms": round(d / 1e3, 2)} for s, d in g[:top]]

    host = sorted((e for e in events if e.get("cat") == "cuda_runtime" and any(b in e["name"] for b in BLOCKING)
                   and e["dur"] >= min_gap_us), key=lambda e: -e["dur"])
    return {
        "span_ms": round(span, 2),
        "compute_busy_ms": round(_busy(compute) / 1e3, 2),
        "h2d_busy_ms": round(_busy(h2d) / 1e3, 2),
        "compute_h2d_overlap_ms": round(overlap / 1e3, 2),
        "compute_first_last_ms": [round((compute[0][0] - t0) / 1e3, 2), round((compute[-1][1] - t0) / 1e3, 2)]
        if compute else None,
        "h2d_first_last_ms": [round((h2d[0][0] - t0) / 1e3, 2), round((h2d[-1][1] - t0) / 1e3, 2)] if h2d else None,
        "compute_gaps": ms(gaps(compute, min_gap_us)),
        "h2d_gaps": ms(gaps(h2d, min_gap_us)),
        "streams": per_stream,
        "blocking_host_calls": [{"name": e["name"], "thread": e.get("tid"), "at_ms": round((e["ts"] - t0) / 1e3, 2),
                                 "ms": round(e["dur"] / 1e3, 2)} for e in host[:top]],
    }


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        events = load(args[0])
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read a Chrome trace from {args[0]}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summarise(events), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
