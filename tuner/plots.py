"""The study's plots (matplotlib, Agg): optimisation history and parameter importances (Optuna's), and the Pareto
front of TTFT against TPOT over every measured trial, whatever the objective (ours: it marks infeasible trials, the
front and the chosen trial)."""
from __future__ import annotations

import warnings
from typing import Any, Optional

from tuner.select import pareto_front


def figures(study, measured: list, chosen: Optional[int], limits: dict[str, float], objective_names: list[str]
            ) -> dict[str, Any]:
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
    fig = pareto_figure(measured, chosen, limits)
    if fig is not None:
        out["pareto_front"] = fig
    return out


def pareto_figure(measured: list, chosen: Optional[int], limits: dict[str, float]):
    """measured: (number, ttft_s, tpot_s, feasible) of every trial with both figures."""
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
    if "ttft_s" in limits and any(m[1] > limits["ttft_s"] for m in measured):
        ax.axvline(limits["ttft_s"], color="gray", ls="--", lw=0.8, label="TTFT limit")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("TTFT against TPOT, every measured trial")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a plot that cannot be drawn yet (too few trials) is skipped
        return None
