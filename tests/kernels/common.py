"""Shared helpers for the native-kernel tests: seeds, random FP8/BF16 weights, error metrics, the error record.

Every run draws fresh inputs: the session seed comes from os.urandom unless HYBRID_TEST_SEED is set, and every
assertion message carries it ("rerun with HYBRID_TEST_SEED=<seed>") so a failure can be reproduced exactly.
"""
from __future__ import annotations

import os
import zlib
from collections import defaultdict

import numpy as np
import torch

from hybrid.quant import fp8

SEED = int(os.environ.get("HYBRID_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
BLOCK = (128, 128)
FP8 = fp8.FP8

# Codes decoded without the usual exponent path: E4M3 subnormals (m * 2^-9) and the two zeros.
SUBNORMAL_CODES = list(range(0x01, 0x08)) + list(range(0x81, 0x88))
ZERO_CODES = [0x00, 0x80]
VALID_CODES = [c for c in range(256) if (c & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN

# (kind, variant, weight type) -> [worst p95 of |err|/|ref|, worst max|err|/max|ref|, calls], printed at the end.
ERRORS: dict = defaultdict(lambda: [0.0, 0.0, 0])


def seed_note() -> str:
    return f"seed={SEED} (rerun with HYBRID_TEST_SEED={SEED})"


def rng_for(*key) -> np.random.Generator:
    """A generator for one test case: the session seed plus the case's own key."""
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def fp8_codes(rng: np.random.Generator, shape, codes=None) -> torch.Tensor:
    """Random valid E4M3 codes (as hybrid.weights.synthetic.fp8_codes: NaN codes moved to a neighbour), or codes
    drawn from `codes` only."""
    if codes is None:
        c = rng.integers(0, 256, size=shape, dtype=np.uint8)
        c[(c & 0x7F) == 0x7F] ^= 1
    else:
        c = np.asarray(codes, dtype=np.uint8)[rng.integers(0, len(codes), size=shape)]
    return torch.from_numpy(c).view(FP8)


def block_scales(rng: np.random.Generator, shape, lo: float = -3.0, hi: float = 1.0) -> torch.Tensor:
    """Positive fp32 block scales, log-uniform over 10^lo .. 10^hi."""
    return torch.from_numpy((10.0 ** rng.uniform(lo, hi, size=fp8.scale_shape(tuple(shape), BLOCK)))
                            .astype(np.float32))


def bf16(rng: np.random.Generator, shape, std: float = 1.0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * std).astype(np.float32)).to(torch.bfloat16)


def dense64(w: torch.Tensor, scale) -> torch.Tensor:
    """The weight as the kernels must see it, in float64: FP8 through fp8.dequantize (its q*s product is formed in
    fp32, exact to 2^-24 relative, far below every tolerance here), BF16 as is."""
    if w.dtype == FP8:
        return fp8.dequantize(w, scale, BLOCK, torch.float64)
    return w.to(torch.float64)


def rel_errors(out: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor | None = None) -> tuple[float, float]:
    """(p95 over elements of |err|/|ref| (0/0 counts as 0), max|err| / max|ref|). `terms`: each element's sum of
    absolute products (a dot product's Σ|x·w|), the denominator of the p95 instead of |ref|: where the products
    cancel, |ref| can lie far below the fp32 rounding of the terms that any summation order carries."""
    err = (out.to(torch.float64) - ref).abs().flatten()
    mag = (ref if terms is None else terms).abs().flatten()
    rel = torch.where(mag > 0, err / mag.clamp_min(1e-300), torch.where(err > 0, float("inf"), 0.0))
    p95 = float(torch.quantile(rel, 0.95)) if rel.numel() > 1 else float(rel.max())
    top = float(mag.max())
    mx = float(err.max()) / top if top > 0 else (0.0 if float(err.max()) == 0 else float("inf"))
    return p95, mx


def record(kind: str, variant: str, wtype: str, p95: float, mx: float) -> None:
    r = ERRORS[(kind, variant, wtype)]
    r[0], r[1], r[2] = max(r[0], p95), max(r[1], mx), r[2] + 1
