"""The timeline summary of a profiled run: a Chrome trace as torch.profiler writes it, read back and summarised."""
from __future__ import annotations

import gzip
import json

import torch

from hybrid.bench import timeline


def _x(cat, name, ts, dur, tid=7, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": args}


def test_union_and_gaps():
    merged = timeline.union([(5, 8), (0, 2), (1, 3), (10, 12), (12, 13)])
    assert merged == [(0, 3), (5, 8), (10, 13)]
    assert timeline.gaps(merged, 2) == [(3, 2), (8, 2)] and timeline.gaps(merged, 2.5) == []


def test_a_trace_with_a_stalled_copy_stream_is_summarised(tmp_path):
    events = [
        _x("kernel", "attention", 1000, 4000, stream=7),           # 1-5 ms compute
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000, 1000, tid=9, stream=9),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 4000, 1000, tid=9, stream=9),  # 2 ms idle before it
        _x("kernel", "expert", 7000, 1000, stream=7),              # 2 ms compute gap before it
        _x("cuda_runtime", "cudaMemcpyAsync", 1500, 3000, tid=1),  # the host blocked 3 ms
        _x("cuda_runtime", "cudaLaunchKernel", 1200, 10, tid=1),
        {"ph": "i", "name": "marker", "ts": 0},                    # not a duration event: ignored
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = timeline.summarise(timeline.load(path))
    assert s["span_ms"] == 7.0 and s["compute_busy_ms"] == 5.0 and s["h2d_busy_ms"] == 2.0
    assert s["compute_h2d_overlap_ms"] == 2.0
    assert s["compute_gaps"] == [{"at_ms": 4.0, "ms": 2.0}] and s["h2d_gaps"] == [{"at_ms": 1.0, "ms": 2.0}]
    assert s["blocking_host_calls"] == [{"name": "cudaMemcpyAsync", "thread": 1, "at_ms": 0.5, "ms": 3.0}]
    assert s["streams"]["9"]["events"] == 2 and s["streams"]["7"]["busy_ms"] == 5.0


def test_a_real_profiler_trace_loads_and_a_bad_file_is_refused(tmp_path, capsys):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "cpu.trace.json"
    prof.export_chrome_trace(str(path))
    assert timeline.main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["span_ms"] > 0
    (tmp_path / "bad.json").write_text("{not json")
    assert timeline.main([str(tmp_path / "bad.json")]) == 1
    assert "cannot read a Chrome trace" in capsys.readouterr().err
    assert timeline.main([]) == 2  # usage
