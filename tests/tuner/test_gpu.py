"""The tuner on a GPU (skipped without CUDA): the GPU profile's space, the cutoff measured as the crossover of the two
prefill paths, and two trials on one trial worker — the second changes hot experts, graphs mode and batch cap
around the model the first loaded."""
from __future__ import annotations

import pytest
import torch

from tests.tuner.conftest import env_for, load, tune

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_two_gpu_trials_on_one_worker(conf, tuner_runs, tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    p = tune("+hw=h200_xeon16", "policy.adapt_to_hardware=true", "model=tiny", "workload.requests=6",
             "workload.prompt_tokens=[8,200]", "workload.output_tokens=[2,8]", "workload.concurrency=2",
             "tuner.n_trials=2", f"tuner.storage={storage}", "tuner.study_name=gpu",
             "tuner.spaces.gpu.gpu.experts_per_layer.choices=[0,4]",
             "tuner.enqueue=[{gpu.experts_per_layer: 4, decode.cuda_graphs: segments, decode.batch_cap: 2}]",
             env=env_for(conf, tuner_runs), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "cutoff: policy.prefill.slp_cutoff_tokens=" in p.stdout, p.stdout
    trials = load(storage, "gpu").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], p.stdout
    assert [t.user_attrs["model"] for t in trials] == ["reused", "reused"], "the crossover's worker kept the model"
    assert trials[1].params["gpu.experts_per_layer"] == 4
    assert "prefill.slp_cutoff_tokens" not in trials[0].params, "measured, not sampled"
    study = load(storage, "gpu")
    cross = study.user_attrs["crossover"]
    assert cross["lengths"][0] == 8 and cross["lengths"][-1] == 200 and len(cross["slp"]) == len(cross["cpu"])
    assert f"slp_cutoff_tokens: {cross['cutoff']}" in (conf / "policy" / "h200_xeon16.yaml").read_text()
