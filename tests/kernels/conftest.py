"""Prints the seed and the error levels the kernel tests observed (worst case per kind, variant and weight type)."""
from __future__ import annotations

from tests.kernels.common import ERRORS, seed_note


def pytest_report_header(config):
    return f"kernel tests: {seed_note()}"


def pytest_terminal_summary(terminalreporter):
    if not ERRORS:
        return
    tr = terminalreporter
    tr.section(f"native kernel error levels ({seed_note()})")
    tr.write_line(f"{'kind':<9} {'variant':<12} {'weights':<7} {'calls':>6} {'p95 |err|/|ref|':>16} "
                  f"{'max|err|/max|ref|':>18}")
    for (kind, variant, wtype), (p95, mx, n) in sorted(ERRORS.items()):
        tr.write_line(f"{kind:<9} {variant:<12} {wtype:<7} {n:>6} {p95:>16.2e} {mx:>18.2e}")
