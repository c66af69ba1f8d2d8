"""Tuners starting together on a fresh storage (sqlite, and PostgreSQL where pgserver starts one): the tables and
the study are created once, and the first trials (the current policy, tuner.enqueue) are enqueued once each.
Spawned processes import this module to find `_open`: its imports stay light."""
from __future__ import annotations

import pytest

from tests.at_once import at_once


def _open(cfg, url: str, space: dict) -> int:
    from tuner.storage import open_study

    return len(open_study(cfg, "together", url, space, ["maximize"], 2).get_trials(deepcopy=False))


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_study_opened_once_by_tuners_starting_together(kind, conf, tmp_path, request):
    import optuna

    from hybrid.kernels.dispatch import available
    from tests.tuner.conftest import NO_RELOAD, database
    from tuner import space as sp

    url = f"sqlite:///{tmp_path / 'tuner.db'}" if kind == "sqlite" else database(request.getfixturevalue("postgres"))
    cfg = _tune_cfg(conf, *NO_RELOAD, "tuner.enqueue=[{cpu: {gemm_tile_tokens: 8}}, {cpu: {gemm_tile_tokens: 16}}]")
    space = sp.resolve(cfg, False, 2, available())
    results = at_once(_open, 3, cfg, url, space, warm=["tuner.storage"])
    assert all(status == "ok" for status, _ in results), "\n".join(str(v) for _, v in results)
    trials = optuna.load_study(study_name="together", storage=url).get_trials()
    assert [t.state.name for t in trials] == ["WAITING"] * 3, "the current policy and two enqueued points, once each"
    assert len({tuple(sorted(t.system_attrs["fixed_params"].items())) for t in trials}) == 3


def _tune_cfg(conf, *overrides: str):
    """conf/tune.yaml composed as `python -m tuner +hw=cpu_only <overrides>` composes it."""
    from hydra import compose, initialize_config_dir

    from hybrid.config.compose import to_settings
    from hybrid.config.schema import register as register_engine
    from tuner.config import register as register_tuner

    register_tuner()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return to_settings(compose(config_name="tune", overrides=["+hw=cpu_only", *overrides]))
    finally:
        register_engine()
