"""What every stage promises on its own: it learns, reports honestly, and its replicas agree."""
from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS, B, W
from harness import load_stage

# name: (world size, backend)
EXPECTED = {"01": (1, None), "02": (1, None), "03": (W, "gloo"), "04": (W, "gloo"), "04_python": (1, "gloo")}


@pytest.mark.parametrize("name", CONFIGS)
def test_stage_learns_and_reports(runs, name):
    run = runs[name]
    s = run.summary
    assert s["stage"] == CONFIGS[name].stage
    assert (s["world_size"], s["backend"]) == EXPECTED[name]
    assert s["device"] == "cpu"
    assert s["global_batch"] == W * B
    assert s["steps"] == s["epochs"] * 4096 // (W * B)
    assert len(s["losses"]) == s["epochs"]
    # The task has a known answer: the loss must really fall and the held-out set be learnt.
    assert s["losses"][-1] < s["losses"][0] / 10, s["losses"]
    assert s["eval_accuracy"] > 0.95 and s["eval_count"] == 1001
    assert s["seconds"] > 0 and s["samples_per_s"] > 0
    assert s["replica_max_abs_diff"] == 0.0


@pytest.mark.parametrize("name", ["03", "04"])
def test_only_rank_zero_logs(runs, name):
    out = runs[name].stdout
    assert out.count("held-out:") == 1 and out.count("epoch 1/") == 1, out
    assert f"world size {W} | backend gloo" in out


@pytest.mark.parametrize("name", CONFIGS)
def test_saved_model_is_unwrapped_and_loads_into_stage_01(runs, name):
    state = runs[name].model
    assert not any(k.startswith("module.") for k in state)
    model = load_stage("01_single_gpu").Net()
    model.load_state_dict(state)  # strict: same keys, same shapes
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cpu_fallback_is_announced(runs):
    assert "no GPU visible" not in runs["01"].stdout  # --device cpu was asked: nothing to announce
    assert "DataParallel has no devices to split over" in runs["02"].stdout
