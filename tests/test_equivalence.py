"""The tutorial's central claim: W ranks of batch b reach the weights of one process with batch W*b.

The negative controls show the comparison is sharp enough to fail: drop set_epoch, change the
global batch, or remove DDP, and the weights (or the replicas) differ.
"""
from __future__ import annotations

import pytest

from conftest import CONFIGS, B
from harness import Step, check, launch, max_abs_diff, mutate

ATOL = 1e-5


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "01"])
def test_same_weights_as_stage_01(runs, name):
    diff = max_abs_diff(runs["01"].model, runs[name].model)
    assert diff <= ATOL, f"{name} differs from 01 by {diff:.3g}"


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "01"])
def test_same_losses_and_metric_as_stage_01(runs, name):
    ref, s = runs["01"].summary, runs[name].summary
    assert s["steps"] == ref["steps"]
    assert s["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert s["eval_accuracy"] == ref["eval_accuracy"]
    assert s["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-4)


def test_without_set_epoch_the_weights_differ(runs, tmp_path):
    path = mutate("03_ddp_spawn", "self.train_loader.sampler.set_epoch(epoch)", "pass", tmp_path / "src")
    run = check(launch(CONFIGS["03"], out=tmp_path / "out", script=path))
    assert max_abs_diff(runs["01"].model, run.model) > 1e-3


def test_a_different_global_batch_gives_different_weights(runs, tmp_path):
    run = check(launch(Step("01_single_gpu", "python", ("--device", "cpu", "--batch-size", str(B))), out=tmp_path))
    assert max_abs_diff(runs["01"].model, run.model) > 1e-3


def test_without_ddp_the_replica_check_fails(tmp_path):
    # No gradient all-reduce: each rank steps on its own half of the batch and the replicas drift apart.
    path = mutate("03_ddp_spawn", 'model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)',
                  "pass", tmp_path / "src")
    step = CONFIGS["03"]
    run = launch(Step(step.stage, step.launcher, (*step.args, "--epochs", "1")), out=tmp_path / "out", script=path)
    assert run.returncode != 0 and not run.survivors, run.describe()
    assert "replicas diverged" in run.stderr
    assert run.summary["replica_max_abs_diff"] > 1e-3
