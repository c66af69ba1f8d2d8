"""Optional GPU kernels that have a torch form beside them: compiled once at start-up, and where that fails (a
Triton or driver mismatch) left off with a warning — the torch forms then run, slower, with the same results."""
from __future__ import annotations

import warnings


def compiled(what: str, warm_up) -> bool:
    """Run `warm_up` (compiles and runs the kernels once); False, having warned, if it raised."""
    try:
        warm_up()
        return True
    except Exception as e:  # Triton's compile errors have no common base class
        warnings.warn(f"{what}: the Triton kernels failed to compile or run ({type(e).__name__}: {e}); "
                      "the torch forms run instead", stacklevel=3)
        return False
