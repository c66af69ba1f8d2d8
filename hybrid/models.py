"""From the `model` config to a loaded model and its tokenizer: a user's checkpoint directory, or a generated
checkpoint (written under runs/models/ on first use, or kept in memory)."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import torch

from hybrid.config.compose import RUNS_DIR
from hybrid.config.schema import ModelConfig
from hybrid.model.args import ModelArgs
from hybrid.model.transformer import Transformer
from hybrid.tokenizer import Tokenizer
from hybrid.weights.checkpoint import Checkpoint, TensorSource
from hybrid.weights.loader import load_model
from hybrid.weights.presets import chat_family, hf_config
from hybrid.weights.synthetic import ensure_checkpoint, in_memory_checkpoint
from hybrid.weights.tokenizer_files import write_byte_tokenizer


def open_source(cfg: ModelConfig, progress: bool = False) -> tuple[TensorSource, Path]:
    """The tensors and the directory holding the tokenizer files (a bar while a model is generated in memory)."""
    if cfg.path is not None:
        ck = Checkpoint(cfg.path)
        return ck, ck.path
    spec = dict(cfg.synthetic)
    if cfg.in_memory:
        source = in_memory_checkpoint(spec, cfg.seed, progress)
        tok_dir = Path(tempfile.mkdtemp(prefix="hybrid-tokenizer-"))
        atexit.register(shutil.rmtree, tok_dir, True)
        a = source.args
        write_byte_tokenizer(tok_dir, a.vocab_size, a.bos_token_id, a.eos_token_id, chat_family(spec))
        return source, tok_dir
    ck = Checkpoint(ensure_checkpoint(RUNS_DIR / "models", cfg.name, spec, cfg.seed))
    return ck, ck.path


def args_of(cfg: ModelConfig) -> ModelArgs:
    """The model's architecture from its config.json (or the generated checkpoint's), without loading a weight."""
    if cfg.path is not None:
        return ModelArgs.from_file(Path(cfg.path) / "config.json")
    return ModelArgs.from_hf_config(hf_config(dict(cfg.synthetic)), "synthetic config")


def load(cfg: ModelConfig, progress: bool = True) -> tuple[Transformer, Tokenizer]:
    source, tok_dir = open_source(cfg, progress)
    model = load_model(source, getattr(torch, cfg.dtype.value), progress)
    return model, Tokenizer(tok_dir)
