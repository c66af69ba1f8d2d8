"""The Pareto front of a set of points (the study's plots mark it; the pareto objective picks its best goodput)."""
from __future__ import annotations

from typing import Sequence


def pareto_front(points: Sequence[tuple[int, float, float]]) -> set[int]:
    """Numbers of the points (number, a, b) that no other point beats in both a and b (both minimised)."""
    front = set()
    for n, a, b in points:
        if not any((a2 <= a and b2 <= b) and (a2 < a or b2 < b) for _, a2, b2 in points):
            front.add(n)
    return front
