"""A Hugging Face checkpoint directory: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Tensors are served by name as memory-mapped views."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from hybrid.errors import CheckpointError
from hybrid.model.args import ModelArgs
from hybrid.weights.safetensors_io import SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class TensorSource(Protocol):
    args: ModelArgs

    def names(self) -> set[str]: ...
    def tensor(self, name: str) -> torch.Tensor: ...
    def where(self, name: str) -> str: ...


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        self.args = ModelArgs.from_file(self.path / "config.json")
        self._files: dict[str, SafetensorsFile] = {}
        self._weight_map = self._read_weight_map()
        self._listing = INDEX if (self.path / INDEX).exists() else SINGLE  # the file that lists the tensors

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: corrupt index ({type(e).__name__}: {e})")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: corrupt index (weight_map is not a mapping of tensor to shard)")
            for shard in set(weight_map.values()):
                if not (self.path / shard).exists():
                    raise CheckpointError(f"{self.path / shard}: shard listed in {INDEX} not found")
            return weight_map
        if (self.path / SINGLE).exists():
            return {name: SINGLE for name in self._file(SINGLE).keys()}
        raise CheckpointError(f"{self.path}: no {SINGLE} or {INDEX}")

    def _file(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            self._files[shard] = SafetensorsFile(self.path / shard)
        return self._files[shard]

    def names(self) -> set[str]:
        return set(self._weight_map)

    def where(self, name: str) -> str:
        return str(self.path / self._weight_map.get(name, self._listing))

    def tensor(self, name: str) -> torch.Tensor:
        f = self._file(self._weight_map[name])
        if name not in f.entries:
            raise CheckpointError(f"{f.path}: tensor {name!r} listed in {INDEX} is not in this shard")
        return f.tensor(name)


class InMemoryCheckpoint:
    """Tensors already in memory (a generated model that skipped the disk)."""

    def __init__(self, args: ModelArgs, tensors: dict[str, torch.Tensor], label: str = "<in memory>"):
        self.args, self._tensors, self.label = args, tensors, label

    def names(self) -> set[str]:
        return set(self._tensors)

    def where(self, name: str) -> str:
        return self.label

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]
