"""Bad checkpoints fail with a CheckpointError (or UnsupportedArchitecture) that names the file and the tensor.

Each case copies the session's tiny checkpoint (4 shards + model.safetensors.index.json), damages the copy, and
checks the error raised by `Checkpoint(dir)` or `load_model(Checkpoint(dir))`. Shards are rewritten with the official
`safetensors.torch` writer, the index kept consistent with them (weight_map and metadata.total_size).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid.errors import CheckpointError, UnsupportedArchitecture
from hybrid.model.args import ModelArgs
from hybrid.weights.checkpoint import INDEX, SINGLE, Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import write_checkpoint
from tests.conftest import model_spec

FP8_W = "model.layers.1.mlp.experts.3.up_proj.weight"  # (96, 256) FP8, in a middle shard
DENSE_W = "model.layers.0.mlp.down_proj.weight"  # (256, 320) FP8: a ragged 128x128 block grid (2, 3)
NORM = "model.layers.0.input_layernorm.weight"  # (256,) BF16


# ---------------------------------------------------------------------------------------------------- helpers

def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def _index(d: Path) -> dict:
    return json.loads((d / INDEX).read_text())


def _write_index(d: Path, index: dict) -> None:
    (d / INDEX).write_text(json.dumps(index, indent=2))


def _shard_of(d: Path, name: str) -> str:
    return _index(d)["weight_map"][name] if (d / INDEX).exists() else SINGLE


def _data_bytes(path: Path) -> int:
    """Bytes of tensor data in one shard (what the index's metadata.total_size sums)."""
    _, header = _header(path)
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")


def _edit_shard(d: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load one shard with the official reader, let `edit` change its dict of tensors, write it back with the
    official writer, and bring the index (weight_map, total_size) in line with what the shard now holds."""
    path = d / shard
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    before = set(tensors)
    edit(tensors)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(path)
    if (d / INDEX).exists():
        index = _index(d)
        for name in before - set(tensors):
            del index["weight_map"][name]
        for name in set(tensors) - before:
            index["weight_map"][name] = shard
        index["metadata"]["total_size"] = sum(_data_bytes(d / s) for s in set(index["weight_map"].values()))
        _write_index(d, index)


def _set_tensor(d: Path, name: str, value: torch.Tensor | None, shard: str | None = None) -> str:
    """Replace (or add, or with None delete) one tensor; returns the shard that held / now holds it."""
    shard = shard or _shard_of(d, name)

    def edit(tensors):
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    _edit_shard(d, shard, edit)
    return shard


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _write_config(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _load(d: Path):
    return load_model(Checkpoint(d), progress=False)


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def _assert_names(err: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(err.value)
    for p in parts:
        assert p in msg, f"error message does not name {p!r}: {msg}"


@pytest.fixture
def copy_of(tmp_path):
    """Copy a checkpoint into tmp_path; the copies are removed afterwards (pytest keeps the temporary folders of
    three runs: 60-odd damaged copies of 3.4 MB each, per run, otherwise)."""
    made = []

    def copy(src: Path) -> Path:
        made.append(_copy(src, tmp_path))
        return made[-1]
    yield copy
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ck(tiny_dir, copy_of) -> Path:
    """A private copy of the tiny (sharded) checkpoint, to damage."""
    return copy_of(tiny_dir)


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory) -> Path:
    """The tiny model as one model.safetensors, no index."""
    spec = {**model_spec("tiny"), "max_shard_mb": 10_000}
    d = write_checkpoint(tmp_path_factory.mktemp("single") / "tiny_single", spec, seed=0, progress=False)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["sharded", "single"])
def any_ck(request, tiny_dir, single_dir, copy_of) -> Path:
    return copy_of({"sharded": tiny_dir, "single": single_dir}[request.param])


# ---------------------------------------------------------------------------------------------- the baseline

def test_fixtures_load(any_ck):
    assert (any_ck / INDEX).exists() != (any_ck / SINGLE).exists()
    model = _load(any_ck)
    assert len(model.model.layers) == 3


def test_rewritten_shard_still_loads(ck):
    """The helpers themselves: a shard round-tripped through the official writer loads unchanged."""
    shard = _shard_of(ck, FP8_W)
    _edit_shard(ck, shard, lambda tensors: None)
    assert torch.equal(Checkpoint(ck).tensor(FP8_W).view(torch.uint8), load_file(ck / shard)[FP8_W].view(torch.uint8))
    _load(ck)


# ---------------------------------------------------------------------------------------------- tensor errors

def test_missing_tensor(any_ck):
    listing = INDEX if (any_ck / INDEX).exists() else SINGLE
    _set_tensor(any_ck, FP8_W, None)
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        _load(any_ck)
    # The file that should have listed it: the index of a sharded checkpoint, else the one model.safetensors.
    _assert_names(e, str(any_ck / listing), repr(FP8_W))


def test_missing_tensors_counted(ck):
    """Several missing: the first named, the rest counted."""
    index = _index(ck)
    gone = sorted(n for n in index["weight_map"] if n.startswith("model.layers.2.mlp.experts.7."))
    shard = index["weight_map"][gone[0]]
    assert all(index["weight_map"][n] == shard for n in gone), "expert 7 of layer 2 spans shards; pick another"
    _edit_shard(ck, shard, lambda tensors: [tensors.pop(n) for n in gone])
    with pytest.raises(CheckpointError, match=rf"and {len(gone) - 1} more") as e:
        _load(ck)
    _assert_names(e, str(ck / INDEX), repr(gone[0]))


@pytest.mark.parametrize("name, shape", [
    (NORM, (255,)),
    (FP8_W, (96, 128)),
    ("model.embed_tokens.weight", (321, 256)),
    ("lm_head.weight", (256, 320)),  # transposed
])
def test_wrong_shape(ck, name, shape):
    dtype = Checkpoint(ck).tensor(name).dtype
    shard = _set_tensor(ck, name, torch.zeros(shape, dtype=torch.float32).to(dtype))
    with pytest.raises(CheckpointError, match="wrong shape") as e:
        _load(ck)
    _assert_names(e, str(ck / shard), repr(name), str(list(shape)))


@pytest.mark.parametrize("name, dtype", [
    (FP8_W, torch.bfloat16),  # an FP8 weight stored dequantised
    (FP8_W, torch.float8_e5m2),  # the other FP8 format
    (NORM, torch.int64),
    (FP8_W + "_scale_inv", torch.bfloat16),  # scales must be F32
])
def test_wrong_dtype(ck, name, dtype):
    shape = tuple(Checkpoint(ck).tensor(name).shape)
    shard = _set_tensor(ck, name, torch.ones(shape, dtype=torch.float32).to(dtype))
    with pytest.raises(CheckpointError, match="dtype") as e:
        _load(ck)
    _assert_names(e, str(ck / shard), repr(name), str(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_in_another_float_dtype_loads(ck, dtype):
    """Norms, embeddings and the router may be any float dtype (some conversions store them in F32)."""
    _set_tensor(ck, NORM, Checkpoint(ck).tensor(NORM).to(dtype))
    model = _load(ck)
    assert model.model.layers[0].input_layernorm.weight.dtype == dtype


@pytest.mark.parametrize("shape", [(2, 2), (3, 3), (1, 3), (3, 2)])
def test_scale_shape_mismatch(ck, shape):
    """DENSE_W is 256x320: ceil-divided by 128 that is a (2, 3) grid of block scales; anything else is refused."""
    name = DENSE_W + "_scale_inv"
    assert tuple(Checkpoint(ck).tensor(name).shape) == (2, 3)
    shard = _set_tensor(ck, name, torch.ones(shape, dtype=torch.float32))
    with pytest.raises(CheckpointError, match="scale shape mismatch") as e:
        _load(ck)
    _assert_names(e, str(ck / shard), repr(name), str(list(shape)), "[2, 3]")


def test_nan_codes_in_fp8_weight(ck):
    w = Checkpoint(ck).tensor(FP8_W).clone()
    codes = w.view(torch.uint8)
    codes[0, 0], codes[5, 7], codes[95, 255] = 0x7F, 0xFF, 0x7F
    shard = _set_tensor(ck, FP8_W, w)
    with pytest.raises(CheckpointError, match="NaN codes") as e:
        _load(ck)
    _assert_names(e, str(ck / shard), repr(FP8_W), "3 NaN codes")


def test_unexpected_extra_tensor(ck):
    name = "model.layers.0.mlp.extra_proj.weight"  # a layer the model has, a tensor it does not
    shard = _set_tensor(ck, name, torch.zeros(4, 4, dtype=torch.bfloat16), shard=_shard_of(ck, NORM))
    with pytest.raises(CheckpointError, match="unexpected tensor") as e:
        _load(ck)
    _assert_names(e, str(ck / shard), repr(name), "1 unexpected")


def test_unexpected_tensors_in_every_shard_name_the_right_file(ck):
    """With extras in several shards, the file named is the one holding the tensor named (the first by name)."""
    shards = sorted(set(_index(ck)["weight_map"].values()))
    extras = {f"model.extra_{chr(ord('z') - i)}.weight": shard for i, shard in enumerate(shards)}
    for name, shard in extras.items():
        _set_tensor(ck, name, torch.zeros(2, dtype=torch.bfloat16), shard=shard)
    with pytest.raises(CheckpointError, match="unexpected tensor") as e:
        _load(ck)
    first = min(extras)
    _assert_names(e, f"{len(extras)} unexpected", repr(first), str(ck / extras[first]))


@pytest.mark.parametrize("layer", [3, 61])
def test_mtp_layers_are_skipped(ck, layer):
    """Layers >= num_hidden_layers (3) are multi-token-prediction modules: present in releases, ignored silently."""
    assert Checkpoint(ck).args.num_hidden_layers == 3
    p = f"model.layers.{layer}."
    mtp = {
        p + "enorm.weight": torch.ones(256, dtype=torch.bfloat16),
        p + "hnorm.weight": torch.ones(256, dtype=torch.bfloat16),
        p + "eh_proj.weight": torch.zeros(256, 512, dtype=torch.float8_e4m3fn),
        p + "eh_proj.weight_scale_inv": torch.ones(2, 4),
        p + "embed_tokens.weight": torch.zeros(320, 256, dtype=torch.bfloat16),
        p + "shared_head.norm.weight": torch.ones(256, dtype=torch.bfloat16),
        p + "shared_head.head.weight": torch.zeros(320, 256, dtype=torch.bfloat16),
        p + "mlp.experts.0.up_proj.weight": torch.zeros(96, 256, dtype=torch.float8_e4m3fn),
        p + "mlp.experts.0.up_proj.weight_scale_inv": torch.ones(1, 2),
    }
    shard = sorted(set(_index(ck)["weight_map"].values()))[-1]
    _edit_shard(ck, shard, lambda tensors: tensors.update(mtp))
    assert set(mtp) <= Checkpoint(ck).names()
    model = _load(ck)
    assert len(model.model.layers) == 3
    assert not any(k.startswith(p) for k in model.state_dict())


# ------------------------------------------------------------------------------------------ file-level errors

def _last_tensor(path: Path) -> str:
    """The tensor whose data ends the file."""
    _, header = _header(path)
    header.pop("__metadata__", None)
    return max(header, key=lambda k: header[k]["data_offsets"][1])


@pytest.mark.parametrize("cut", [1, 100, 4096])
def test_truncated_shard_data(ck, cut):
    shard = _shard_of(ck, FP8_W)
    path = ck / shard
    last = _last_tensor(path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-cut])
    with pytest.raises(CheckpointError, match="truncated") as e:
        _load(ck)
    n, header = _header(path)
    data_size = len(raw) - cut - 8 - n
    short = {k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > data_size}
    assert last in short
    named = [k for k in short if repr(k) in str(e.value)]
    assert named, f"cut {cut} bytes: none of the {len(short)} cut tensors named: {e.value}"
    _assert_names(e, str(path))


@pytest.mark.parametrize("keep", ["half the header", "5 bytes", "0 bytes"])
def test_truncated_shard_header(ck, keep):
    shard = _shard_of(ck, FP8_W)
    path = ck / shard
    n, _ = _header(path)
    size = {"half the header": 8 + n // 2, "5 bytes": 5, "0 bytes": 0}[keep]
    path.write_bytes(path.read_bytes()[:size])
    with pytest.raises(CheckpointError, match="truncated") as e:
        _load(ck)
    _assert_names(e, str(path))


def _garbage_length(raw: bytes, n: int) -> bytes:
    return b"\xde\xad\xbe\xef\xde\xad\xbe\xef" + raw[8:]


def _garbage_json(raw: bytes, n: int) -> bytes:
    return raw[:8] + bytes((i * 37 + 11) % 256 for i in range(n)) + raw[8 + n:]


def _ascii_not_json(raw: bytes, n: int) -> bytes:
    return raw[:8] + (b"not json! " * n)[:n] + raw[8 + n:]


def _json_list(raw: bytes, n: int) -> bytes:
    return raw[:8] + b"[1, 2, 3]".ljust(n) + raw[8 + n:]


@pytest.mark.parametrize("damage, expect", [
    (_garbage_length, "corrupt or truncated safetensors header"),
    (_garbage_json, "corrupt safetensors header"),
    (_ascii_not_json, "not JSON"),
    (_json_list, "not a JSON object"),
], ids=["garbage length", "garbage bytes", "ascii not JSON", "JSON not an object"])
def test_corrupt_header(ck, damage, expect):
    path = ck / _shard_of(ck, FP8_W)
    raw = path.read_bytes()
    n, _ = _header(path)
    path.write_bytes(damage(raw, n))
    with pytest.raises(CheckpointError, match=expect) as e:
        _load(ck)
    _assert_names(e, str(path))


@pytest.mark.parametrize("field, value, expect", [
    ("dtype", "F8_E4M3FNUZ", "corrupt header entry"),
    ("shape", [96, 255], "do not match its shape"),
    ("data_offsets", "0-100", "corrupt header entry"),
])
def test_corrupt_header_entry(ck, field, value, expect):
    """A well-formed JSON header with one bad entry: the tensor is named."""
    path = ck / _shard_of(ck, FP8_W)
    raw = path.read_bytes()
    n, header = _header(path)
    header[FP8_W][field] = value
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    with pytest.raises(CheckpointError, match=expect) as e:
        _load(ck)
    _assert_names(e, str(path), repr(FP8_W))


def test_index_lists_missing_shard(ck):
    shard = _shard_of(ck, FP8_W)
    (ck / shard).unlink()
    with pytest.raises(CheckpointError, match="not found") as e:
        Checkpoint(ck)
    _assert_names(e, str(ck / shard), INDEX)


def test_index_entry_points_at_wrong_shard(ck):
    index = _index(ck)
    right = index["weight_map"][FP8_W]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != right)
    index["weight_map"][FP8_W] = wrong
    _write_index(ck, index)
    with pytest.raises(CheckpointError, match="is not in this shard") as e:
        _load(ck)
    _assert_names(e, str(ck / wrong), repr(FP8_W), INDEX)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": [1, 2]}'],
                         ids=["not JSON", "no weight_map", "weight_map a list"])
def test_corrupt_index(ck, text):
    (ck / INDEX).write_text(text)
    with pytest.raises(CheckpointError, match="corrupt index") as e:
        Checkpoint(ck)
    _assert_names(e, str(ck / INDEX))


def test_no_weights_at_all(ck):
    (ck / INDEX).unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors") as e:
        Checkpoint(ck)
    _assert_names(e, str(ck))


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory") as e:
        Checkpoint(tmp_path / "nowhere")
    _assert_names(e, str(tmp_path / "nowhere"))


# --------------------------------------------------------------------------------------------- config errors

def test_missing_config(ck):
    (ck / "config.json").unlink()
    with pytest.raises(CheckpointError, match="not found") as e:
        Checkpoint(ck)
    _assert_names(e, str(ck / "config.json"))


def test_config_not_json(ck):
    (ck / "config.json").write_text('{"model_type": "deepseek_v3",')
    with pytest.raises(CheckpointError, match="not valid JSON") as e:
        Checkpoint(ck)
    _assert_names(e, str(ck / "config.json"))


def test_unsupported_architecture(ck):
    cfg = _config(ck)
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    _write_config(ck, cfg)
    with pytest.raises(UnsupportedArchitecture, match="unsupported architecture") as e:
        Checkpoint(ck)
    _assert_names(e, str(ck / "config.json"), "llama", "LlamaForCausalLM")


@pytest.mark.parametrize("field, value", [
    ("scoring_func", "softmax"),  # DeepSeek-V2's routing
    ("topk_method", "group_limited_greedy"),
])
def test_unsupported_routing(ck, field, value):
    cfg = _config(ck)
    cfg[field] = value
    _write_config(ck, cfg)
    with pytest.raises(UnsupportedArchitecture, match=field) as e:
        Checkpoint(ck)
    _assert_names(e, str(ck / "config.json"), repr(value))


@pytest.mark.parametrize("field", [
    "topk_method", "scoring_func", "n_group", "topk_group", "n_routed_experts", "num_experts_per_tok",
    "routed_scaling_factor", "norm_topk_prob",
])
def test_missing_routing_field(ck, field):
    """A release-form config.json (rope_theta + rope_scaling) must spell out its routing: nothing is defaulted."""
    cfg = _config(ck)
    assert "rope_parameters" not in cfg and field in cfg
    del cfg[field]
    _write_config(ck, cfg)
    with pytest.raises(CheckpointError, match=field) as e:
        Checkpoint(ck)
    assert not isinstance(e.value, UnsupportedArchitecture), str(e.value)
    _assert_names(e, str(ck / "config.json"), "missing")


# ----------------------------------------------------------------------------- transformers-5 config.json form

def _transformers_form(release: dict, drop: tuple[str, ...] = ()) -> dict:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in release.items() if k not in drop}).to_dict()
    # What transformers 5 writes: the rope settings folded into rope_parameters, rope_theta with them.
    assert "rope_parameters" in cfg and "rope_scaling" not in cfg and "rope_theta" not in cfg, sorted(cfg)
    assert cfg["rope_parameters"]["rope_theta"] == release["rope_theta"]
    return cfg


@pytest.mark.parametrize("drop", [(), ("scoring_func", "topk_method")], ids=["as written", "no routing fields"])
def test_transformers5_config_gives_same_args(any_dir, copy_of, drop):
    """transformers 5 rewrites config.json (rope_parameters; it keeps scoring_func / topk_method only when given,
    and stamps its own model_type): the args must be those of the release form."""
    d = copy_of(any_dir)
    release = _config(d)
    cfg = _transformers_form(release, drop)
    for k in drop:
        assert k not in cfg
    _write_config(d, cfg)
    got = Checkpoint(d).args
    want = Checkpoint(any_dir).args
    assert got == dataclasses.replace(want, model_type=cfg["model_type"])
    assert got.rope.is_yarn and got.rope == want.rope
    load_model(Checkpoint(d), progress=False)


def test_rope_theta_only_in_rope_parameters(ck):
    """Hand-made variant: release form, but rope_theta and the YaRN settings only inside rope_parameters."""
    release = _config(ck)
    cfg = {k: v for k, v in release.items() if k not in ("rope_theta", "rope_scaling")}
    cfg["rope_parameters"] = {**release["rope_scaling"], "rope_type": "yarn", "rope_theta": release["rope_theta"]}
    _write_config(ck, cfg)
    assert Checkpoint(ck).args == ModelArgs.from_hf_config(release)


def test_rope_theta_missing_everywhere(ck):
    cfg = _config(ck)
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {**cfg.pop("rope_scaling"), "rope_type": "yarn"}
    _write_config(ck, cfg)
    with pytest.raises(CheckpointError, match="rope_theta is missing") as e:
        Checkpoint(ck)
    _assert_names(e, str(ck / "config.json"))
