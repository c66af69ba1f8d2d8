"""Running the Triton kernels under Triton's interpreter on the CPU (TRITON_INTERPRET=1, read when a process starts
and its kernels are defined: each check runs in a process of its own). `run(code, *args)` runs `code` so, with
two corrections to the interpreter (Triton 3.9), so that it computes what the GPU computes: it multiplies BF16
`tl.dot` operands as their raw 16-bit integers — here they go in as the FP32 numbers they are (exact: BF16 widens
to FP32 without rounding, as the tensor cores take them; the products are summed in FP32 either way); and it casts
FP32 to BF16 by truncation — here to nearest, ties to even, as the GPU does."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PATCH = textwrap.dedent("""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as _interp

    _dot = _interp.InterpreterBuilder.create_dot

    def _widened(h):
        if h.dtype == tl.bfloat16:
            bits = h.data.view(np.uint16).astype(np.uint32) << 16
            return _interp.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _dot(self, _widened(a), _widened(b), d, input_precision, max_num_imprecise_acc)

    _interp.InterpreterBuilder.create_dot = _create_dot

    _cast = _interp.InterpreterBuilder.cast_impl

    def _cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            nearest = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            return _interp.TensorHandle(np.where(nan, np.uint16(0x7FC0), nearest), dst_type.scalar)
        return _cast(self, src, dst_type)

    _interp.InterpreterBuilder.cast_impl = _cast_impl
""")


# The interpreter's own error when NumPy (>= 2.5) refuses int() of a 1-element array (seen with Triton 3.6)
INDEX_BUG = "only 0-dimensional arrays can be converted to Python scalars"


def run(code: str, *args: str, timeout: int = 600) -> None:
    """Runs `code` under the interpreter; fails the test with its output unless it exits 0 having printed ok."""
    pytest.importorskip("triton", reason="needs Triton (its interpreter runs the kernels on the CPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", PATCH + textwrap.dedent(code), *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=timeout)
    if p.returncode != 0 and INDEX_BUG in p.stderr:
        import numpy
        import triton

        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot take a runtime loop bound under NumPy "
                    f"{numpy.__version__} (its tensors' __index__ calls int() on a 1-element array; later Triton "
                    "squeezes it first)")
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr
