"""Build the model from a checkpoint: every expected tensor present, of the right shape and dtype, scales matching
their weights, no NaN codes in FP8 weights, INT4 weights' recorded shapes their own. Tensors are assigned, not copied:
the model's weights are the checkpoint's memory-mapped pages."""
from __future__ import annotations

import re

import torch
from tqdm import tqdm

from hybrid.errors import CheckpointError
from hybrid.kernels.scan import fp8_nan_codes
from hybrid.model.transformer import Transformer
from hybrid.quant import fp8, int4
from hybrid.weights.checkpoint import TensorSource

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def load_model(source: TensorSource, dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> Transformer:
    with torch.device("meta"):
        model = Transformer(source.args, dtype)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    _check_names(source, expected)
    total = sum(source.tensor(n).nbytes for n in expected) if progress else None
    state = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not progress) as bar:
        for name, (shape, dtype_) in expected.items():
            state[name] = _checked(source, name, shape, dtype_)
            bar.update(state[name].nbytes)
    model.load_state_dict(state, assign=True, strict=True)
    _check_int4_shapes(source, model)
    return model.eval()


def _check_names(source: TensorSource, expected: dict) -> None:
    available = source.names()
    missing = sorted(set(expected) - available)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source.where(missing[0])}: missing tensor {missing[0]!r}{more}")
    n_layers = source.args.num_hidden_layers
    extra = sorted(n for n in available - set(expected) if not _is_skipped_layer(n, n_layers))
    if extra:
        raise CheckpointError(f"{source.where(extra[0])}: unexpected tensor {extra[0]!r} "
                              f"({len(extra)} unexpected in all): the checkpoint does not match its config.json")


def _is_skipped_layer(name: str, n_layers: int) -> bool:
    """Layers past num_hidden_layers are multi-token-prediction modules, which inference skips."""
    m = LAYER.match(name)
    return bool(m) and int(m.group(1)) >= n_layers


def _dtype_ok(name: str, actual: torch.dtype, expected: torch.dtype) -> bool:
    """FP8 weights and their F32 scales exactly, INT4 packed words int32 and shapes any int; other tensors (norms,
    embeddings, router, INT4 scales) any float dtype."""
    if name.endswith("weight_shape"):
        return actual in int4.SHAPE_DTYPES
    if expected in (fp8.FP8, torch.int32) or name.endswith("weight_scale_inv"):
        return actual == expected
    return actual in FLOATS


def _check_int4_shapes(source: TensorSource, model: Transformer) -> None:
    for name, m in model.named_modules():
        if hasattr(m, "weight_packed") and m.weight_shape.tolist() != [m.out_features, m.in_features]:
            raise CheckpointError(f"{source.where(name + '.weight_shape')}: tensor {name + '.weight_shape'!r} records "
                                  f"{m.weight_shape.tolist()} where [{m.out_features}, {m.in_features}] is expected")


def _checked(source: TensorSource, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    t = source.tensor(name)
    where = f"{source.where(name)}: tensor {name!r}"
    if not _dtype_ok(name, t.dtype, dtype):
        raise CheckpointError(f"{where}: dtype {t.dtype} where {dtype} is expected")
    if tuple(t.shape) != shape:
        kind = "scale shape mismatch" if name.endswith(("weight_scale_inv", "weight_scale")) else "wrong shape"
        raise CheckpointError(f"{where}: {kind}: {list(t.shape)} where {list(shape)} is expected")
    if t.dtype == fp8.FP8:
        bad = fp8_nan_codes(t)
        if bad:
            raise CheckpointError(f"{where}: {bad} NaN codes (0x7F/0xFF) in FP8 weights")
    return t
