"""FP8 block-scaled linear: y = x · (q ⊙ s)ᵀ, q [N, K] FP8 E4M3 with one scale per 128×128 block.

Two ways, chosen by `policy.gpu.fp8_gemm` (an `Fp8Gemm`, handed to the code that multiplies):
- `triton`: a Triton GEMM that reads the FP8 weights directly, converts each tile to BF16 in registers, multiplies
  on the tensor cores with FP32 accumulation and applies the block's scale once per 128-wide K block (post-scaling,
  as the CPU kernels do). Nothing is written besides y.
- `dequant`: expand the weights to the activation dtype (q·s, a full-size temporary; one Triton pass on a GPU),
  then torch's matmul (cuBLAS). Costs a write and a read of the BF16 weights per call, which many rows amortise.
- `auto`: `triton` below `dequant_from_rows` rows of x, `dequant` from there.
Activations stay BF16 either way (no activation quantisation). The Triton kernels need CUDA, Triton, BF16
activations and 128×128 blocks; anything else dequantises with torch ops, which also serves the CPU.

On the CPU, `CpuFp8Gemm` (placement's choice with the native MoE backend) runs the native FP8 GEMM (csrc/gemm.cpp)
over the stored FP8 bytes: no dequantised copy of the weights, one pass over them per call; BF16 weights (lm_head,
the router) go through the same GEMM's BF16 path.

Legend: M rows of x (tokens), N output features, K input features.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from hybrid.kernels.gemm import gemm as cpu_gemm
from hybrid.kernels import mla_decode, triton_device
from hybrid.kernels.decode_attention import decode_attention
from hybrid.kernels.head_gemm import head_gemm
from hybrid.quant import fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BACKENDS = ("triton", "dequant", "auto")


@dataclass(frozen=True)
class Tile:
    """The Triton kernel's tiling: BM x BN outputs per program, BK (64 or 128) of K per step, warps, pipeline
    stages. Written "BMxBNxBK/warps/stages", e.g. "128x128x128/8/3"."""
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int

    @staticmethod
    def parse(spec: str) -> "Tile":
        try:
            dims, warps, stages = spec.split("/")
            bm, bn, bk = (int(v) for v in dims.split("x"))
            tile = Tile(bm, bn, bk, int(warps), int(stages))
        except ValueError:
            raise ValueError(f"a Triton tile is BMxBNxBK/warps/stages (e.g. 128x128x128/8/3), got {spec!r}") from None
        if (bk not in (64, 128) or min(bm, bn) < 16 or tile.stages < 1 or tile.warps < 1
                or any(v & (v - 1) for v in (bm, bn, tile.warps))):
            raise ValueError(f"tile {spec!r}: BK must be 64 or 128, BM, BN (>= 16) and warps powers of two, "
                             "stages >= 1")
        return tile

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}/{self.warps}/{self.stages}"


# (up to this many rows of x, tile) in increasing order: decode-sized, a few hundred; then prefill-sized (None: more)
TILES = ((16, Tile(16, 128, 128, 4, 3)), (256, Tile(64, 128, 128, 4, 3)), (None, Tile(128, 128, 128, 8, 3)))


@dataclass(frozen=True)
class Fp8Gemm:
    """How x goes through FP8 weights: the backend (`policy.gpu.fp8_gemm`), the row count from which `auto`
    dequantises (`policy.gpu.fp8_dequant_rows`) and the Triton tiles by rows of x (TILES' form). The policy's values
    are checked by the schema; the checks here are for direct callers (benchmarks, tests).

    `pad_rows` (the GPU's, policy.decode.batch_invariant): a product of fewer rows than this is computed over this many
    (zeros past the real ones), so that every decode step's GEMMs are the same kernels whatever the batch size —
    cuBLAS picks its kernel (and so each row's order of summation) by shape; within one kernel a row's result
    depends on that row alone. The weights' bytes are read either way; 0: no padding."""
    backend: str = "triton"
    dequant_from_rows: int = 512
    tiles: tuple[tuple[Optional[int], Tile], ...] = TILES
    pad_rows: int = 0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"Fp8Gemm backend (policy.gpu.fp8_gemm) must be one of {BACKENDS}, got {self.backend!r}")
        if self.dequant_from_rows < 1:
            raise ValueError(f"Fp8Gemm dequant_from_rows (policy.gpu.fp8_dequant_rows) must be >= 1, got "
                             f"{self.dequant_from_rows}")
        limits = [limit for limit, _ in self.tiles]
        if not limits or limits[-1] is not None or None in limits[:-1] or limits[:-1] != sorted(set(limits[:-1])):
            raise ValueError(f"Fp8Gemm tiles: row limits increasing, the last one None (more rows), got {limits}")
        if self.pad_rows < 0:
            raise ValueError(f"Fp8Gemm pad_rows must be >= 0, got {self.pad_rows}")

    def _short(self, x: torch.Tensor) -> int:
        """The rows of x when they are to be padded (fewer than pad_rows), else 0."""
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return m if 0 < m < self.pad_rows else 0

    def _padded(self, x: torch.Tensor, m: int) -> torch.Tensor:
        """x's m rows [m, K] followed by zero rows up to pad_rows."""
        xp = x.new_zeros(self.pad_rows, x.shape[-1])
        xp[:m] = x.reshape(m, -1)
        return xp

    @property
    def large_tile(self) -> Tile:
        """The prefill tile: rows past every other tile's limit."""
        return self.tiles[-1][1]

    def with_(self, backend: Optional[str] = None, large_tile: Optional[Tile] = None) -> "Fp8Gemm":
        """This one with another backend and/or prefill tile (benchmarks)."""
        tiles = self.tiles if large_tile is None else self.tiles[:-1] + ((None, large_tile),)
        return dataclasses.replace(self, backend=backend or self.backend, tiles=tiles)

    def uses_large_tile(self, m: int) -> bool:
        """Whether m rows take the prefill tile (more rows than any other tile's limit)."""
        return len(self.tiles) == 1 or m > self.tiles[-2][0]

    def tile_for(self, m: int) -> Tile:
        return next(t for limit, t in self.tiles if limit is None or m <= limit)

    def path(self, x: torch.Tensor, block, m: int) -> str:
        """How m rows of x go through FP8 weights: `triton` (the FP8 GEMM), `dequant` (Triton dequantise + cuBLAS)
        or `torch` (torch ops dequantise: CPU, other dtypes or blocks, no Triton)."""
        if not triton_device.runs(x) or x.dtype != torch.bfloat16 or tuple(block) != (128, 128):
            return "torch"
        if self.backend == "triton" or (self.backend == "auto" and m < self.dequant_from_rows):
            return "triton"
        return "dequant"

    def dense_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [..., K] through a BF16 weight w [N, K] (lm_head, BF16 checkpoints), in x's dtype."""
        m = self._short(x)
        if m:
            return F.linear(self._padded(x, m), w.to(x.dtype))[:m].view(*x.shape[:-1], -1)
        return F.linear(x, w.to(x.dtype))

    def fp32_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x · wᵀ in FP32 arithmetic (the router's scores), FP32 out."""
        m = self._short(x)
        if m:
            return F.linear(self._padded(x.float(), m), w.float())[:m].view(*x.shape[:-1], -1)
        return F.linear(x.float(), w.float())

    def per_head(self, x_BSHI: torch.Tensor, w: torch.Tensor, by_rows: bool) -> torch.Tensor:
        """Per head h: x[:, :, h] · w[h] (`by_rows`: w [H, I, O], contracting over its rows: MLA's key half) or
        x[:, :, h] · w[h]ᵀ (w [H, O, I]: the value half) -> [B, S, H, O] in x's dtype; torch's einsum."""
        b, s = x_BSHI.shape[:2]
        short = self._short(x_BSHI.reshape(b * s, -1))
        if short:  # through pad_rows rows (batch-invariant decode), the real ones kept
            xp = x_BSHI.new_zeros(self.pad_rows, 1, *x_BSHI.shape[2:])
            xp[:short] = x_BSHI.reshape(short, 1, *x_BSHI.shape[2:])
            return self.per_head(xp, w, by_rows)[:short].view(b, s, *xp.shape[2:-1], -1)
        if by_rows:
            return torch.einsum("bshn,hnc->bshc", x_BSHI, w)
        return torch.einsum("bshc,hvc->bshv", x_BSHI, w)

    def attends_from_cache(self, x: torch.Tensor) -> bool:
        """Whether decode attention on x's device reads the cache per sequence (`attend_from_cache`): with
        pad_rows set (batch-invariant decode) where the Triton kernel runs."""
        return bool(self.pad_rows) and mla_decode.available(x.device)

    def attend_from_cache(self, q_lat_BHC, q_pe_BHR, kv_NPC, pe_NPR, table_SM, slots_B, lengths_B, kv_len: int,
                          scale: float) -> torch.Tensor:
        """Each sequence's decode attention over its own cached positions (the paged cache read through the block
        table), in fixed chunks (mla_decode): the latent output [B, H, C] in FP32, whatever the batch around it."""
        return mla_decode.mla_decode(q_lat_BHC, q_pe_BHR, kv_NPC, pe_NPR, table_SM, slots_B, lengths_B, kv_len,
                                     scale)

    def linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block, out=None) -> torch.Tensor:
        """x [..., K] -> [..., N]; `out` (2-D [M, N], rows contiguous) receives it when given."""
        n, k = q.shape
        short = self._short(x)
        if short:  # through pad_rows rows, the real ones kept
            y = self.linear(self._padded(x, short), q, scale, block)[:short]
            return out.copy_(y.view(out.shape)) if out is not None else y.view(*x.shape[:-1], n)
        m = x.numel() // k if k else 0
        how = self.path(x, block, m)
        if how != "triton":
            w = dequantize(q, scale, block, x.dtype) if how == "dequant" else fp8.dequantize(q, scale, block, x.dtype)
            if out is not None and how == "dequant" and out.is_contiguous():
                return torch.mm(x.reshape(m, k), w.t(), out=out)
            y = F.linear(x, w)
            return out.copy_(y.view(out.shape)) if out is not None else y
        _check_layout(q, scale, block)
        x_MK = x.reshape(-1, k)
        if x_MK.stride(-1) != 1:
            x_MK = x_MK.contiguous()
        y_MN = out if out is not None and out.stride(-1) == 1 else torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m:
            t = self.tile_for(m)
            grid = (triton.cdiv(m, t.bm), triton.cdiv(n, t.bn))
            _fp8_block_mm[grid](x_MK, q, scale, y_MN, m, n, k, x_MK.stride(0), q.stride(0), scale.stride(0),
                                y_MN.stride(0), BM=t.bm, BN=t.bn, BK=t.bk, num_warps=t.warps, num_stages=t.stages)
        if out is not None:
            return out if y_MN is out else out.copy_(y_MN)
        return y_MN.view(*x.shape[:-1], n)


DEFAULT_GEMM = Fp8Gemm()  # policy.gpu's defaults


@dataclass(frozen=True)
class CpuFp8Gemm:
    """FP8 weights on the CPU through the native kernels (`kernel`: policy.cpu.kernel), reading the FP8 bytes in
    place on the CPU threads; the kernel accumulates in FP32 and y is rounded once to BF16. It takes BF16
    activations and 128×128 blocks: anything else (float32 models, other blocks, another device) goes through
    `fallback`, torch's dequantising path on the CPU, unchanged.

    `per_head` (MLA's absorbed decode products over the kept BF16 kv_b halves) runs on the native batched-head
    kernel up to `head_max_rows` tokens (decode batches), torch's einsum from there (0: always torch, the path
    before the kernel, kept reachable for comparisons). The kernel was the faster at every count measured, 1 to
    128 rows (DeepSeek-V3's dims, 2 threads, docs/perf/journal.md); the limit keeps larger batches on torch until
    measured.

    Decode attention reads the BF16 cache on the native attention kernel (`attend_from_cache`);
    `native_attention` False keeps torch's einsum over the gathered cache (the path before it, for comparisons:
    docs/perf/cpu-attention.md)."""
    kernel: str = "auto"
    fallback: Fp8Gemm = DEFAULT_GEMM
    head_max_rows: int = 128
    native_attention: bool = True

    def path(self, x: torch.Tensor, block, m: int) -> str:
        """`native` (the CPU FP8 GEMM), else the fallback's way."""
        if x.device.type == "cpu" and x.dtype == torch.bfloat16 and tuple(block) == (128, 128):
            return "native"
        return self.fallback.path(x, block, m)

    def linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block, out=None) -> torch.Tensor:
        """x [..., K] -> [..., N]; `out` (2-D [M, N]) receives it when given."""
        n, k = q.shape
        m = x.numel() // k if k else 0
        if q.dtype != fp8.FP8 or self.path(x, block, m) != "native":
            return self.fallback.linear(x, q, scale, block, out=out)
        y = self._native(x, q, scale)
        if out is not None:
            return out.copy_(y.view(out.shape))
        return y.to(x.dtype)

    def _bf16_native(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16

    def dense_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The native BF16 GEMM for BF16 x and w on the CPU (FP32 accumulation, one rounding), else torch."""
        if not self._bf16_native(x, w):
            return self.fallback.dense_linear(x, w)
        return self._native(x, w, None).to(x.dtype)

    def fp32_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """For BF16 x and w on the CPU, the native BF16 GEMM: each product is exact in FP32 and the sums are
        FP32, as torch's FP32 GEMM over the widened operands, without widening w at every call."""
        if not self._bf16_native(x, w):
            return self.fallback.fp32_linear(x, w)
        return self._native(x, w, None)

    def attends_from_cache(self, x: torch.Tensor) -> bool:
        """Whether decode attention reads the cache per sequence on the native kernel (`attend_from_cache`): BF16
        on the CPU, unless `native_attention` is off."""
        return self.native_attention and x.device.type == "cpu" and x.dtype == torch.bfloat16

    def attend_from_cache(self, q_lat_BHC, q_pe_BHR, kv_NPC, pe_NPR, table_SM, slots_B, lengths_B, kv_len: int,
                          scale: float) -> torch.Tensor:
        """Each sequence's decode attention over its own cached positions (csrc/decode_attention.cpp: the paged
        BF16 cache read in place through the block table, once per step for all heads; fixed chunks merged in
        order, so batch-invariant): the latent output [B, H, C] in FP32. kv_len (the GPU kernel's grid reach) is
        not needed here."""
        return decode_attention(q_lat_BHC, q_pe_BHR, kv_NPC, pe_NPR, table_SM, slots_B, lengths_B, scale,
                                kernel=self.kernel)

    def per_head(self, x_BSHI: torch.Tensor, w: torch.Tensor, by_rows: bool) -> torch.Tensor:
        """As Fp8Gemm.per_head; BF16 x and w on the CPU with at most `head_max_rows` tokens go through the native
        batched-head kernel (FP32 accumulation, one rounding), threaded over heads: torch's batched GEMM with one
        row per head reads the 2 × 16 MiB per layer at about half the memory roof (docs/perf/journal.md)."""
        B, S, H, I = x_BSHI.shape
        if not self._bf16_native(x_BSHI, w) or not 0 < B * S <= self.head_max_rows or w.stride(-1) != 1:
            return self.fallback.per_head(x_BSHI, w, by_rows)
        x_MHI = x_BSHI.reshape(B * S, H, I)
        if x_MHI.stride(-1) != 1:
            x_MHI = x_MHI.contiguous()
        return head_gemm(x_MHI, w, by_rows, kernel=self.kernel).view(B, S, H, -1)

    def _native(self, x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        """x [..., K] · wᵀ -> [..., N] FP32 on the native kernels."""
        n, k = w.shape
        m = x.numel() // k if k else 0
        x_MK = x.reshape(m, k)
        if x_MK.stride(1) != 1 or (m > 1 and x_MK.stride(0) < k):  # the kernel reads rows of K in place
            x_MK = x_MK.contiguous()
        y_MN = cpu_gemm(x_MK, w, scale, kernel=self.kernel) if m else x.new_empty(0, n, dtype=torch.float32)
        return y_MN.view(*x.shape[:-1], n)


def _check_layout(q: torch.Tensor, scale: torch.Tensor, block) -> None:
    n, k = q.shape
    if q.stride(1) != 1 or scale.stride(1) != 1 or tuple(scale.shape) != fp8.scale_shape((n, k), block):
        raise ValueError(f"fp8_linear: weights {tuple(q.shape)} and scales {tuple(scale.shape)} must be row-major "
                         f"with one scale per 128x128 block ({fp8.scale_shape((n, k), block)})")


def dequantize(q: torch.Tensor, scale: torch.Tensor, block, dtype=torch.bfloat16, out=None) -> torch.Tensor:
    """q·s as `dtype` (fp8.dequantize's arithmetic: the product in FP32, then one rounding); one Triton pass on a
    GPU with 128×128 blocks. `out` ([N, K], rows contiguous) receives it when given."""
    if out is not None and tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"dequantize: out is {tuple(out.shape)}, the weights {tuple(q.shape)}")
    if not triton_device.runs(q) or tuple(block) != (128, 128) or (out is not None and out.stride(1) != 1):
        w = fp8.dequantize(q, scale, block, dtype if out is None else out.dtype)
        return w if out is None else out.copy_(w)
    _check_layout(q, scale, block)
    n, k = q.shape
    w = torch.empty(n, k, dtype=dtype, device=q.device) if out is None else out
    if w.numel():
        _fp8_dequant[(triton.cdiv(n, 128), triton.cdiv(k, 128))](q, scale, w, n, k, q.stride(0), scale.stride(0),
                                                                 w.stride(0), num_warps=4)
    return w


def stored_linear(x: torch.Tensor, w: torch.Tensor, scale, block, gemm: Fp8Gemm = DEFAULT_GEMM,
                  out=None) -> torch.Tensor:
    """x through a weight as checkpoints store it: BF16 (`block` None) or FP8 with block scales (through `gemm`)."""
    if block is None:
        y = gemm.dense_linear(x, w)
        return out.copy_(y) if out is not None else y
    return gemm.linear(x, w, scale, block, out=out)


def warm_up(shapes, device, gemm: Fp8Gemm = DEFAULT_GEMM) -> None:
    """Compile the kernel's variants (one per row-tile size of `gemm`) and the dequantise kernel for these weight
    shapes [N, K] now, so that a first prefill does not pay Triton's compilation (seconds) in its time to first
    token."""
    if triton is None or torch.device(device).type != "cuda":
        return
    limits = [limit for limit, _ in gemm.tiles[:-1]]
    rows = limits + [limits[-1] + 1 if limits else 1]  # one row count per tile
    for n, k in shapes:
        q = torch.zeros(n, k, dtype=fp8.FP8, device=device)
        s = torch.ones(-(-n // 128), -(-k // 128), dtype=torch.float32, device=device)
        for way, ms in ((gemm.with_(backend="triton"), rows), (gemm.with_(backend="dequant"), [1])):
            for m in ms:
                way.linear(torch.zeros(m, k, dtype=torch.bfloat16, device=device), q, s, (128, 128))
    torch.cuda.synchronize(device)


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _fp8_block_mm(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, sxm, sqn, ssn, sym,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)  # row offsets can pass 2^31 elements
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):  # a 128-block's scale serves 128 // BK steps
            kk = kb * BK + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            b = tl.load(q_ptr + rn[None, :] * sqn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0.0)
            s = tl.load(s_ptr + (rn // 128) * ssn + (kb * BK) // 128, mask=rn < N, other=0.0)
            acc += tl.dot(a, b.to(tl.bfloat16)) * s[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _fp8_dequant(q_ptr, s_ptr, w_ptr, N, K, sqn, ssn, swn):
        """One 128×128 block per program: w = q·s (FP32 product, one rounding to w's dtype)."""
        bn, bk = tl.program_id(0), tl.program_id(1)
        rn = (bn * 128 + tl.arange(0, 128)).to(tl.int64)
        rk = bk * 128 + tl.arange(0, 128)
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        q = tl.load(q_ptr + rn[:, None] * sqn + rk[None, :], mask=mask, other=0.0)
        s = tl.load(s_ptr + bn.to(tl.int64) * ssn + bk)
        tl.store(w_ptr + rn[:, None] * swn + rk[None, :], (q.to(tl.float32) * s).to(w_ptr.dtype.element_ty),
                 mask=mask)
