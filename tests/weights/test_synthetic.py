"""Generated checkpoints: readable by the official safetensors library bit for bit, deterministic by seed, the same in
memory as on disk, and the tiny model shaped to exercise what the engine must handle. Plus FP8 block quantisation."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybrid.kernels.scan import fp8_nan_codes
from hybrid.quant import fp8
from hybrid.weights.checkpoint import INDEX, SINGLE, Checkpoint
from hybrid.weights.synthetic import in_memory_checkpoint, write_checkpoint
from tests.conftest import model_spec

MODELS = ["tiny", "tiny_kimi"]


@pytest.fixture(params=MODELS)
def named_dir(request) -> tuple[str, Path]:
    return request.param, request.getfixturevalue({"tiny": "tiny_dir", "tiny_kimi": "kimi_dir"}[request.param])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------ the official reader

def test_safe_open_reads_every_shard_bit_identically(any_dir):
    ck = Checkpoint(any_dir)
    seen: set[str] = set()
    for path in _shards(any_dir):
        with safe_open(path, "pt") as f:
            keys = set(f.keys())
            assert f.metadata() == {"format": "pt"}, path.name
            assert keys == {n for n in ck.names() if Path(ck.where(n)).name == path.name}, path.name
            for name in sorted(keys):
                ours, theirs = ck.tensor(name), f.get_tensor(name)
                assert _same(ours, theirs), (f"{path.name}: {name}: ours {ours.dtype} {tuple(ours.shape)}, "
                                             f"safetensors {theirs.dtype} {tuple(theirs.shape)}")
        assert not keys & seen, f"{path.name} repeats tensors of another shard"
        seen |= keys
    assert seen == ck.names()
    if (any_dir / INDEX).exists():
        total = json.loads((any_dir / INDEX).read_text())["metadata"]["total_size"]
        assert total == sum(ck.tensor(n).nbytes for n in seen)


# --------------------------------------------------------------------------------------------------- determinism

def test_generation_is_deterministic_by_seed(tiny_dir, tmp_path):
    """Seed 0 again gives the session's checkpoint byte for byte; seed 1 changes every tensor, and nothing else."""
    again = write_checkpoint(tmp_path / "seed0", model_spec("tiny"), seed=0, progress=False)
    other = write_checkpoint(tmp_path / "seed1", model_spec("tiny"), seed=1, progress=False)
    try:
        files = sorted(p.name for p in tiny_dir.iterdir())
        assert sorted(p.name for p in again.iterdir()) == files == sorted(p.name for p in other.iterdir())
        for name in files:
            assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), f"seed 0 twice: {name} differs"
        for name in ("config.json", INDEX, "tokenizer.json", "tokenizer_config.json"):
            assert (other / name).read_bytes() == (tiny_dir / name).read_bytes(), f"seed 1: {name} differs"
        a, b = Checkpoint(tiny_dir), Checkpoint(other)
        same = sorted(n for n in a.names() if _same(a.tensor(n), b.tensor(n)))
        assert not same, f"seed 0 and seed 1 give {len(same)} identical tensors, e.g. {same[:3]}"
    finally:
        shutil.rmtree(again), shutil.rmtree(other)


def test_in_memory_equals_written(named_dir):
    name, d = named_dir
    mem, disk = in_memory_checkpoint(model_spec(name), seed=0), Checkpoint(d)
    assert mem.args == disk.args
    assert mem.names() == disk.names()
    differ = sorted(n for n in disk.names() if not _same(mem.tensor(n), disk.tensor(n)))
    assert not differ, f"{name}: {len(differ)} of {len(disk.names())} tensors differ, e.g. {differ[:3]}"


# ----------------------------------------------------------------------------------------- the tiny model's contract

def test_tiny_meets_its_contract(tiny_dir):
    """What tests of the engine rely on the tiny model to exercise (conf/model/tiny.yaml)."""
    ck = Checkpoint(tiny_dir)
    a = ck.args
    layers = range(a.num_hidden_layers)
    dense = [i for i in layers if not a.is_moe_layer(i)]
    moe = [i for i in layers if a.is_moe_layer(i)]
    assert a.num_hidden_layers >= 2 and dense and moe, f"{a.num_hidden_layers} layers: dense {dense}, MoE {moe}"
    names = ck.names()
    for i in dense:
        assert f"model.layers.{i}.mlp.gate_proj.weight" in names, f"dense layer {i} has no MLP"
    for i in moe:
        assert f"model.layers.{i}.mlp.experts.{a.n_routed_experts - 1}.down_proj.weight" in names
        assert f"model.layers.{i}.mlp.shared_experts.down_proj.weight" in names
    assert a.n_routed_experts >= 16, f"{a.n_routed_experts} experts"
    assert a.num_experts_per_tok >= 4, f"top-{a.num_experts_per_tok}"
    assert a.n_group > 1 and a.topk_group < a.n_group, f"{a.n_group} groups, top {a.topk_group} of them"

    fp8_shapes = {n: tuple(ck.tensor(n).shape) for n in names if ck.tensor(n).dtype == fp8.FP8}
    assert fp8_shapes and a.fp8_block == (128, 128)
    ragged_rows = sorted(n for n, s in fp8_shapes.items() if s[0] % 128)
    ragged_cols = sorted(n for n, s in fp8_shapes.items() if s[1] % 128)
    assert ragged_rows and ragged_cols, f"FP8 weights ragged in rows: {len(ragged_rows)}, columns: {len(ragged_cols)}"
    for n in ragged_rows[:1] + ragged_cols[:1]:
        scale = ck.tensor(n + "_scale_inv")
        assert tuple(scale.shape) == fp8.scale_shape(fp8_shapes[n], a.fp8_block), f"{n} {fp8_shapes[n]}"

    assert (tiny_dir / INDEX).exists() and not (tiny_dir / SINGLE).exists()
    weight_map = json.loads((tiny_dir / INDEX).read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 2 and shards == [p.name for p in _shards(tiny_dir)], shards
    assert set(weight_map) == names

    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / f).is_file(), f
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tok.get_vocab_size() <= a.vocab_size
    special = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tok.token_to_id(special["bos_token"]) == a.bos_token_id
    assert tok.token_to_id(special["eos_token"]) == a.eos_token_id


def test_no_nan_codes_and_sane_scales(any_dir):
    ck = Checkpoint(any_dir)
    n_fp8 = 0
    for name in sorted(ck.names()):
        t = ck.tensor(name)
        if t.dtype == fp8.FP8:
            n_fp8 += 1
            assert fp8_nan_codes(t) == 0, f"{name}: {fp8_nan_codes(t)} NaN codes"
            assert not t.float().isnan().any(), name  # independently of fp8_nan_codes
            scale = ck.tensor(name + "_scale_inv")
            assert scale.dtype == torch.float32 and bool((scale > 0).all() and scale.isfinite().all()), name
    assert n_fp8 > 0


# -------------------------------------------------------------------------------------------------- fp8 quantisation

def _ragged_weight(shape=(200, 300), block=(128, 128)) -> torch.Tensor:
    """Normal values, each block at its own magnitude (1e-4 .. 1e4), one block all zeros."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    sn, sk = fp8.scale_shape(shape, block)
    magnitude = 10.0 ** torch.linspace(-4, 4, sn * sk).reshape(sn, sk)
    w = w * fp8.expand_scale(magnitude, shape, block)
    w[block[0]:, 2 * block[1]:] = 0.0  # the bottom-right corner block
    return w


def test_fp8_round_trip_ragged():
    """Bound, per element: |dequant(quant(w)) - w| <= 2^-4 |w| + 2^-10 s, with s = amax/448 the block's scale.

    w/s lies in [-448, 448]. E4M3 has 3 mantissa bits: a normal number (|w/s| >= 2^-6) rounds to nearest with
    relative error <= 2^-4 (half of the 2^-3 spacing relative to its power of two); a subnormal one (spacing 2^-9)
    with absolute error <= 2^-10. Multiplying back by s gives the bound, plus float32 rounding of w/s and q*s
    (2^-24 each; a 2^-20 relative slack covers them). The per-block magnitudes span 8 decades, so one scale for the
    whole matrix would flush the small blocks to zero and break the bound: the scales really are per block.
    """
    shape, block = (200, 300), (128, 128)
    w = _ragged_weight(shape, block)
    q, scale = fp8.quantize(w, block)
    assert q.dtype == fp8.FP8 and tuple(q.shape) == shape
    assert tuple(scale.shape) == fp8.scale_shape(shape, block) == (2, 3)
    assert fp8_nan_codes(q) == 0

    back = fp8.dequantize(q, scale, block, torch.float32)
    s = fp8.expand_scale(scale, shape, block)
    bound = (2.0 ** -4 * w.abs() + 2.0 ** -10 * s) * (1 + 2.0 ** -20)
    err = (back - w).abs()
    worst = int((err / bound).flatten().argmax())
    r, c = divmod(worst, shape[1])
    assert bool((err <= bound).all()), (f"{shape} in {block} blocks: element ({r}, {c}) w={w[r, c]:.3e} "
                                        f"back={back[r, c]:.3e} error {err[r, c]:.3e} > bound {bound[r, c]:.3e}")
    # Looser, scale-free: every error within 2^-4 of its block's amax.
    amax = fp8.expand_scale(scale * fp8.FP8_MAX, shape, block)
    assert bool((err <= 2.0 ** -4 * amax * (1 + 2.0 ** -20)).all())

    # Each non-zero block uses the full range: its largest element is code ±448. The zero block stays exactly zero.
    qf = q.float().abs()
    for i in range(2):
        for j in range(3):
            blk = qf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            want = 0.0 if (i, j) == (1, 2) else fp8.FP8_MAX
            assert blk.max().item() == want, f"block ({i}, {j}): max |code| {blk.max().item()}"
    assert bool((back[128:, 256:] == 0).all())

    # The default output dtype is bfloat16: the float32 result rounded once.
    assert torch.equal(fp8.dequantize(q, scale, block), back.to(torch.bfloat16))


def test_fp8_round_trip_is_exact_on_codes():
    """Weights that already are FP8 codes times a power of two come back exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(fp8.FP8).float()  # all 254 finite values, max 448
    w = codes.repeat(200 * 300 // codes.numel() + 1)[: 200 * 300].reshape(200, 300) * 2.0 ** -5
    for i, j in [(0, 0), (0, 128), (128, 0), (128, 128), (0, 256), (128, 256)]:
        w[i, j] = 448 * 2.0 ** -5  # every block holds the largest code: scale = 2^-5 exactly
    q, scale = fp8.quantize(w, (128, 128))
    assert bool((scale == 2.0 ** -5).all())
    assert torch.equal(fp8.dequantize(q, scale, (128, 128), torch.float32), w)


@pytest.mark.parametrize("n", [1, 7, 4097, (1 << 22) + 13, 3 * (1 << 22) + 5])
def test_fp8_nan_codes_is_exact_at_every_size_and_offset(n):
    """The native scan (threaded from 4 MiB on) counts every 0x7F / 0xFF byte, none else, from any start byte."""
    g = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=g)
    raw[torch.randint(0, n + 3, (50,), generator=g)] = 0x7F  # more of them than chance gives
    raw[-1] = 0xFF
    for skip in (0, 1, 3):  # views starting off any alignment
        codes = raw[skip:skip + n]
        want = int(((codes & 0x7F) == 0x7F).sum())
        assert fp8_nan_codes(codes.view(fp8.FP8)) == want
    assert fp8_nan_codes(raw[:n].view(fp8.FP8).reshape(1, n)[:, ::2]) == int(
        ((raw[:n:2] & 0x7F) == 0x7F).sum()), "a strided view is counted as its elements"
