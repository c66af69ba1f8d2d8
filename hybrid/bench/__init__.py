"""Benchmarks: each reports achieved figures against a bound measured in the same run (`mode=bench bench=NAME`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from hybrid.bench.records import Record


def _kernels(settings) -> list[Record]:
    from hybrid.bench.kernels import run

    return run(settings)


def _slo(settings) -> list[Record]:
    from hybrid.bench.slo import run

    return run(settings)


def _decode(settings) -> list[Record]:
    from hybrid.bench.decode import run

    return run(settings)


def _prefill(settings) -> list[Record]:
    from hybrid.bench.prefill import run

    return run(settings)


def _gpu_gemm(settings) -> list[Record]:
    from hybrid.bench.gpu_gemm import run

    return run(settings)


def _serve(settings) -> list[Record]:
    from hybrid.bench.serve import run

    return run(settings)


def _concurrency(settings) -> list[Record]:
    from hybrid.bench.concurrency import run

    return run(settings)


BENCHES: dict[str, Callable] = {"kernels": _kernels, "slo": _slo, "decode": _decode, "prefill": _prefill,
                                "gpu_gemm": _gpu_gemm, "serve": _serve, "concurrency": _concurrency}


def plot_bench(name: str, records: list[Record], json_path) -> Optional[Path]:
    """A PNG beside the JSON, for the benchmarks that draw one."""
    png = Path(json_path).with_suffix(".png")
    if name == "prefill":
        from hybrid.bench.prefill import plot

        plot(records, png)
        return png
    if name == "concurrency":
        from hybrid.bench.concurrency_plot import plot

        return plot(records, png)
    if name == "kernels":
        from hybrid.bench.kernels import plot

        return plot(records, png)
    if name == "serve":  # a multi-turn workload's
        from hybrid.bench.sessions import plot

        return plot(records, png)
    return None


def run_bench(settings) -> list[Record]:
    """The benchmark settings.bench names (hybrid/config/bench.py checked the name and its keys)."""
    return BENCHES[settings.bench.name](settings)
