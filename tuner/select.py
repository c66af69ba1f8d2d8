"""Which trial becomes the policy: the best feasible one (constrained), or the knee of the feasible Pareto front."""
from __future__ import annotations

import math
from typing import Optional, Sequence


def pareto_front(points: Sequence[tuple[int, float, float]]) -> set[int]:
    """Numbers of the points (number, a, b) that no other point beats in both a and b (both minimised)."""
    front = set()
    for n, a, b in points:
        if not any((a2 <= a and b2 <= b) and (a2 < a or b2 < b) for _, a2, b2 in points):
            front.add(n)
    return front


def knee(points: Sequence[tuple[int, Sequence[float]]], directions: Sequence[str]) -> Optional[int]:
    """The point closest to the utopia point (the best of every objective) after scaling each objective to [0, 1]
    over the given points: the balanced compromise of a Pareto front."""
    if not points:
        return None
    k = len(directions)
    signed = [(n, [v if d == "minimize" else -v for v, d in zip(vals, directions)]) for n, vals in points]
    lo = [min(p[1][i] for p in signed) for i in range(k)]
    hi = [max(p[1][i] for p in signed) for i in range(k)]

    def distance(vals):
        return math.sqrt(sum(((v - lo[i]) / (hi[i] - lo[i]) if hi[i] > lo[i] else 0.0) ** 2
                             for i, v in enumerate(vals)))

    return min(signed, key=lambda p: (distance(p[1]), p[0]))[0]
