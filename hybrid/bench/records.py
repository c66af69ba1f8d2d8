"""The record format every benchmark (and the tuner) uses: one JSON object per measurement with at least
name, value and unit; where they apply bound, fraction_of_bound, the shape (m, n, k) and weight_dtype."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from hybrid.locking import unique_path


class Records(list):
    """A benchmark's records and what the run was configured as (`context`, e.g. the engine's resolved plan), which
    goes into the JSON beside them and into the MLflow run."""

    def __init__(self, records=(), context: Optional[dict] = None):
        super().__init__(records)
        self.context = dict(context or {})


@dataclass
class Record:
    name: str
    value: float
    unit: str
    bound: Optional[float] = None  # the same quantity's bound, measured in the same run
    m: Optional[int] = None
    n: Optional[int] = None
    k: Optional[int] = None
    weight_dtype: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def fraction_of_bound(self) -> Optional[float]:
        return self.value / self.bound if self.bound else None

    def as_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        if self.bound:
            d["fraction_of_bound"] = self.fraction_of_bound
        return {**d, **self.extra}


def save(records: list[Record], directory: Path, bench: str, context: dict[str, Any]) -> Path:
    """The records as JSON under `directory`, named by the bench and the second (`-2`, ... when another process
    saved in the same second)."""
    path = unique_path(directory, f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}", ".json")
    path.write_text(json.dumps({"bench": bench, **context, "records": [r.as_json() for r in records]}, indent=1))
    return path


def table(records: list[Record]) -> str:
    rows = [("name", "m", "n", "k", "dtype", "value", "bound", "of bound", "notes")]
    for r in records:
        notes = ", ".join(f"{k}={_fmt(v)}" for k, v in r.extra.items())
        frac = f"{r.fraction_of_bound:.0%}" if r.bound else ""
        rows.append((r.name, _fmt(r.m), _fmt(r.n), _fmt(r.k), r.weight_dtype or "", f"{_fmt(r.value)} {r.unit}",
                     _fmt(r.bound), frac, notes))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def save_log_plot(fig, ax, png: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """A one-panel log-log plot finished (labels, grid, legend) and written to png; the figure closed."""
    import matplotlib.pyplot as plt

    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
