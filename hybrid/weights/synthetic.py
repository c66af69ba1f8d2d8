"""Synthetic checkpoints in exactly the published layout (config.json with quantization_config, safetensors shards
plus index, FP8 weights with 128x128 block scales or INT4 experts packed as compressed-tensors does, tokenizer files),
any dimensions, deterministic by seed.

Values come from random bytes (fast enough for real DeepSeek-V3 dimensions): FP8 weights are random valid E4M3
codes, INT4 weights random nibbles, with per-block (per-group) scales sized so every Linear has weights of
RMS ~ 1/sqrt(fan_in).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from hybrid.errors import CheckpointError
from hybrid.locking import locked
from hybrid.model.args import ModelArgs
from hybrid.model.transformer import Transformer
from hybrid.quant import fp8, int4
from hybrid.weights.checkpoint import INDEX, SINGLE, InMemoryCheckpoint
from hybrid.weights.presets import chat_family, hf_config
from hybrid.weights.safetensors_io import TensorSpec, write
from hybrid.weights.tokenizer_files import write_byte_tokenizer

_CODES = torch.arange(256, dtype=torch.uint8)
_VALID = _CODES[(_CODES & 0x7F) != 0x7F]
RMS_CODE = float(_VALID.view(fp8.FP8).float().pow(2).mean().sqrt())
RMS_INT4 = math.sqrt(sum(q * q for q in range(-8, 8)) / 16)
GENERATOR = 3  # in the cached checkpoints' digest: a change to what is generated makes a new directory


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def fp8_codes(rng: np.random.Generator, shape) -> torch.Tensor:
    """Random valid FP8 E4M3 codes of `shape` from `rng`'s raw 64-bit words (the NaN codes moved to a neighbour).
    The raw words, not rng.bytes, and the fix in place: ~2x faster (a benchmark model generates ~80 GB of them)."""
    n = math.prod(shape)
    codes = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
    codes ^= (codes & 0x7F) == 0x7F  # 0x7F / 0xFF are NaN: use the neighbouring code
    return torch.from_numpy(codes).view(fp8.FP8).reshape(shape)


def _bf16_of_rms(rng, shape, rms: float) -> torch.Tensor:
    """Random sign and mantissa, one exponent: values in ±[1, 2)·2^e, RMS ≈ 1.53·2^e."""
    e = round(math.log2(rms / 1.53)) + 127
    bits = np.frombuffer(rng.bytes(2 * math.prod(shape)), dtype=np.uint16)
    bits = (bits & 0x807F) | np.uint16(e << 7)
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16).reshape(shape)


def _make(name: str, shape: tuple, dtype: torch.dtype, weight_shapes: dict, seed: int):
    def make() -> torch.Tensor:
        rng = _rng(seed, name)
        if dtype == fp8.FP8:
            return fp8_codes(rng, shape)
        if name.endswith(int4.TENSORS):
            return _int4_tensor(name, shape, rng, weight_shapes)
        if name.endswith("weight_scale_inv"):
            k = weight_shapes[name.removesuffix("_scale_inv")][1]
            jitter = rng.lognormal(0.0, 0.3, size=shape).astype(np.float32)
            return torch.from_numpy(jitter / (RMS_CODE * math.sqrt(k)))
        if name.endswith("e_score_correction_bias"):
            return torch.from_numpy(rng.normal(0.0, 0.01, size=shape).astype(np.float32))
        if name.endswith("norm.weight"):
            return torch.from_numpy(rng.normal(1.0, 0.05, size=shape).astype(np.float32)).to(torch.bfloat16)
        if name == "model.embed_tokens.weight":
            return _bf16_of_rms(rng, shape, 1.0)
        return _bf16_of_rms(rng, shape, 1.0 / math.sqrt(shape[-1]))
    return make


def _int4_tensor(name: str, shape: tuple, rng: np.random.Generator, weight_shapes: dict) -> torch.Tensor:
    """Random nibbles (a row's padding nibbles zero, as packed), scales for RMS ~ 1/sqrt(K), or the shape (N, K)."""
    n, k = weight_shapes[name.rsplit("_", 1)[0]]  # the unpacked weight's shape, under "<linear>.weight"
    if name.endswith("weight_shape"):
        return torch.tensor([n, k], dtype=torch.int64)
    if name.endswith("weight_scale"):
        jitter = rng.lognormal(0.0, 0.3, size=shape).astype(np.float32)
        return torch.from_numpy(jitter / (RMS_INT4 * math.sqrt(k))).to(torch.bfloat16)
    n_words = math.prod(shape)
    words = torch.from_numpy(rng.bit_generator.random_raw(-(-n_words // 2)).view(np.int32)[:n_words]).reshape(shape)
    if k % int4.PER_WORD:
        words[:, -1] &= (1 << 4 * (k % int4.PER_WORD)) - 1
    return words


def tensor_specs(args: ModelArgs, seed: int) -> list[TensorSpec]:
    with torch.device("meta"):
        model = Transformer(args)
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    shapes.update({f"{n}.weight": (m.out_features, m.in_features) for n, m in model.named_modules()
                   if hasattr(m, "weight_packed")})  # INT4 weights' unpacked shapes
    return [TensorSpec(k, shapes[k], v.dtype, _make(k, shapes[k], v.dtype, shapes, seed)) for k, v in state.items()]


def _shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    shards, current, size = [], [], 0
    for s in specs:
        if current and size + s.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += s.nbytes
    return shards + [current]


def write_checkpoint(dst: Path, spec: dict, seed: int = 0, progress: bool = True) -> Path:
    """Write a generated checkpoint to `dst` (atomically: a partial one never looks complete; under `dst`'s lock, so
    processes writing the same one take turns)."""
    with locked(dst, f"writing {dst}"):
        return _write(dst, spec, seed, progress)


def _write(dst: Path, spec: dict, seed: int, progress: bool) -> Path:
    """write_checkpoint, its lock held: the `.partial` directory is this process's alone."""
    cfg = hf_config(spec)
    args = ModelArgs.from_hf_config(cfg, "synthetic config")
    specs = tensor_specs(args, seed)
    shards = _shards(specs, int(spec.get("max_shard_mb", 4000) * 1e6))
    total = sum(s.nbytes for s in specs)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    free = shutil.disk_usage(tmp).free
    if total > 0.9 * free:
        tmp.rmdir()
        raise CheckpointError(f"{dst}: generating this checkpoint needs {total / 1e9:.1f} GB of disk, only "
                              f"{free / 1e9:.1f} GB is free (fewer layers: model.synthetic.num_hidden_layers=N)")
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {dst.name}", disable=not progress) as bar:
        names = [SINGLE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards):
            write(tmp / name, shard)
            bar.update(sum(s.nbytes for s in shard))
    if len(shards) > 1:
        weight_map = {s.name: n for n, shard in zip(names, shards) for s in shard}
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    write_byte_tokenizer(tmp, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], chat_family(spec))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def in_memory_checkpoint(spec: dict, seed: int = 0, progress: bool = False) -> InMemoryCheckpoint:
    """The same tensors as `write_checkpoint`, kept in memory (no disk)."""
    args = ModelArgs.from_hf_config(hf_config(spec), "synthetic config")
    specs, tensors = tensor_specs(args, seed), {}
    with tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc="generating in memory",
              disable=not progress) as bar:
        for s in specs:
            tensors[s.name] = s.make()
            bar.update(s.nbytes)
    return InMemoryCheckpoint(args, tensors, "<generated in memory>")


def checkpoint_dir(root: Path, name: str, spec: dict, seed: int) -> Path:
    digest = hashlib.sha1(json.dumps([spec, seed, GENERATOR], sort_keys=True).encode()).hexdigest()[:10]
    return root / f"{name}-{digest}"


def ensure_checkpoint(root: Path, name: str, spec: dict, seed: int = 0) -> Path:
    """The generated checkpoint for (spec, seed) under `root`, written on first use. Processes starting together
    generate it once: the first under the directory's lock, the others wait for it and then read it."""
    dst = checkpoint_dir(root, name, spec, seed)
    if (dst / "config.json").exists():  # written last (renamed into place whole)
        return dst
    with locked(dst, f"generating checkpoint '{name}'"):
        if not (dst / "config.json").exists():
            print(f"generating checkpoint '{name}' under {dst}", file=sys.stderr)
            _write(dst, spec, seed, progress=sys.stderr.isatty())
    return dst
