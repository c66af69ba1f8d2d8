"""Shared fixtures: tiny generated checkpoints (DeepSeek-V3 and Kimi-K2 shapes) from the project's model configs;
one MLflow store for the tests that check tracking."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from hybrid.config.compose import CONF_DIR
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import write_checkpoint


# Runs (in-process and in subprocesses) track nothing unless a test asks: a fresh MLflow store costs seconds.
os.environ["HYBRID_TRACKING"] = "0"


def model_spec(name: str) -> dict:
    return yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())["synthetic"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", model_spec("tiny"), seed=0, progress=False)


@pytest.fixture(scope="session")
def kimi_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny_kimi", model_spec("tiny_kimi"), seed=0,
                            progress=False)


@pytest.fixture(scope="session")
def kimi_int4_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny_kimi_int4", model_spec("tiny_kimi_int4"), seed=0,
                            progress=False)


@pytest.fixture(scope="session", params=["tiny", "tiny_kimi"])
def any_dir(request, tiny_dir, kimi_dir) -> Path:
    return {"tiny": tiny_dir, "tiny_kimi": kimi_dir}[request.param]


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return load_model(Checkpoint(tiny_dir), torch.float32, progress=False)


@pytest.fixture(scope="session")
def mlflow_runs(tmp_path_factory) -> Path:
    """A runs/ directory whose MLflow store (runs/mlflow.db, created once per session) tracking tests share: run
    with HYBRID_RUNS_DIR=<it> and HYBRID_TRACKING=1, each test under its own tracking.experiment."""
    from hybrid.config.schema import TrackingConfig
    from hybrid.tracking import client

    runs = tmp_path_factory.mktemp("mlflow_runs")
    client(TrackingConfig(uri=f"sqlite:///{runs / 'mlflow.db'}")).search_experiments()  # creates the tables
    return runs
