"""The study's plots (matplotlib, Agg), kept on its parent MLflow run: optimisation history and parameter importances
(Optuna's); the objective against each knob; the Pareto front of TTFT against TPOT (p90 under a workload) over
every measured trial, whatever the objective (ours: it marks infeasible trials, the front and the chosen trial).
The crossover of the two prefill paths is drawn by hybrid/bench/prefill.py."""
from __future__ import annotations

import warnings
from typing import Any, Optional

from tuner.select import pareto_front


def figures(study, measured: list, chosen: Optional[int], limits: dict[str, float], objective_names: list[str],
            pair: tuple[str, str]) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import optuna
    import optuna.visualization.matplotlib as ov

    out: dict[str, Any] = {}
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's matplotlib backend is "experimental"
        if complete:
            for i, name in enumerate(objective_names):
                target = None if len(objective_names) == 1 else (lambda t, i=i: t.values[i])
                ax = _try(lambda: ov.plot_optimization_history(study, target=target, target_name=name))
                if ax is not None:
                    ax.figure.tight_layout()
                    out[f"optimization_history{'' if len(objective_names) == 1 else '_' + name}"] = ax.figure
        if len(complete) >= 2:
            target = None if len(objective_names) == 1 else (lambda t: t.values[0])
            ax = _try(lambda: ov.plot_param_importances(study, target=target, target_name=objective_names[0]))
            if ax is not None:
                ax.figure.tight_layout()
                out["param_importances"] = ax.figure
    fig = pareto_figure(measured, chosen, limits, pair)
    if fig is not None:
        out["pareto_front"] = fig
    fig = knobs_figure(complete, chosen, objective_names[0])
    if fig is not None:
        out["objective_vs_knobs"] = fig
    return out


def knobs_figure(trials: list, chosen: Optional[int], name: str):
    """The first objective against each knob of the complete trials, one panel per knob (categorical values in
    their order of appearance, null as "auto"); infeasible trials greyed, the chosen one ringed."""
    import matplotlib.pyplot as plt

    knobs = sorted({k for t in trials for k in t.params})
    if not trials or not knobs:
        return None
    cols = min(3, len(knobs))
    rows = (len(knobs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, knob in zip(axes.flat, knobs):
        values = [t.params.get(knob) for t in trials]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        labels = [] if numeric else list(dict.fromkeys("auto" if v is None else str(v) for v in values))
        xs = values if numeric else [labels.index("auto" if v is None else str(v)) for v in values]
        for t, x in zip(trials, xs):
            ok = all(c <= 0 for c in t.constraints.values())
            ax.scatter([x], [t.values[0]], c="tab:blue" if ok else "lightgray", marker="o" if ok else "x", zorder=2)
            if t.number == chosen:
                ax.scatter([x], [t.values[0]], s=160, facecolors="none", edgecolors="k", zorder=3)
        if labels:
            ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(knob)
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(knobs):]:
        ax.set_visible(False)
    fig.suptitle(f"{name} against each knob (ringed: the written policy)", fontsize=9)
    fig.tight_layout()
    return fig


def pareto_figure(measured: list, chosen: Optional[int], limits: dict[str, float],
                  pair: tuple[str, str] = ("ttft_s", "tpot_s")):
    """measured: (number, TTFT, TPOT, feasible) of every trial with both figures (`pair`: their metric names)."""
    import matplotlib.pyplot as plt

    if not measured:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.5))
    feas = [m for m in measured if m[3]]
    infeas = [m for m in measured if not m[3]]
    front = pareto_front([(m[0], m[1], m[2]) for m in feas])
    if feas:
        ax.scatter([m[1] for m in feas], [m[2] * 1e3 for m in feas], c="tab:blue", label="feasible", zorder=2)
    if infeas:
        ax.scatter([m[1] for m in infeas], [m[2] * 1e3 for m in infeas], c="lightgray", marker="x",
                   label="infeasible", zorder=2)
    if front:
        pts = sorted((m[1], m[2]) for m in feas if m[0] in front)
        ax.step([p[0] for p in pts], [p[1] * 1e3 for p in pts], where="post", c="tab:red", lw=1,
                label="Pareto front", zorder=1)
    for m in measured:
        ax.annotate(str(m[0]), (m[1], m[2] * 1e3), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if chosen is not None:
        pick = next((m for m in measured if m[0] == chosen), None)
        if pick:
            ax.scatter([pick[1]], [pick[2] * 1e3], s=160, facecolors="none", edgecolors="k", label="written policy",
                       zorder=3)
    if pair[0] in limits and any(m[1] > limits[pair[0]] for m in measured):
        ax.axvline(limits[pair[0]], color="gray", ls="--", lw=0.8, label="TTFT limit")
    if pair[1] in limits and any(m[2] > limits[pair[1]] for m in measured):
        ax.axhline(limits[pair[1]] * 1e3, color="gray", ls=":", lw=0.8, label="TPOT limit")
    ax.set_xlabel(f"{pair[0]} (s)")
    ax.set_ylabel(f"{pair[1]} (ms)")
    ax.set_title("TTFT against TPOT, every measured trial")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a plot that cannot be drawn yet (too few trials) is skipped
        return None
