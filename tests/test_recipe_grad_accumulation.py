"""Recipe grad_accumulation: K micro-batches per optimizer step, gradients all-reduced once per step.

Claims: 2 ranks x 2 micro-batches of 16 compute stage 01's training at batch 64; DDP all-reduces the
gradients once per optimizer step (counted by the recipe's communication hook, in bytes too); without
no_sync the weights are the same and the traffic is exactly K times larger.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import readme_run
from harness import (
    Run,
    Step,
    assert_same_training,
    check,
    gradient_bytes,
    launch,
    load_stage,
    max_gap,
    replay_error,
    tolerance,
)
from tour import EPOCHS  # runs["01"]'s

RECIPE = "recipes/grad_accumulation"
W, B, K = 2, 16, 2  # global batch W*K*B = 64: stage 01's batch in runs["01"]
ARGS = ("--device", "cpu", "--dtype", "float64", "--batch-size", str(B), "--accumulate", str(K),
        "--epochs", str(EPOCHS))
SYNCED_EPOCHS = 3  # the comparison run needs only a few epochs: it is checked against the trajectory's epoch 3
# The README's run without no_sync: the test reads what it made (conftest.readme_run) rather than launch it again.
SYNCED_RUN = (f"torchrun --standalone --nproc_per_node={W} {RECIPE}/train.py --batch-size {B} --accumulate {K} "
              f"--epochs {SYNCED_EPOCHS} --dtype float64 --sync-every-micro-batch --out runs/accumulate_sync")


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory) -> Run:
    return check(launch(Step(RECIPE, "torchrun", ARGS, nproc=W), out=tmp_path_factory.mktemp("accumulated")))


@pytest.fixture(scope="module")
def synced(readme_runs) -> Run:
    return readme_run(readme_runs, SYNCED_RUN)


def test_accumulation_computes_stage_01_at_the_global_batch(runs, accumulated):
    s, ref = accumulated.summary, runs["01"].summary
    assert s["global_batch"] == W * K * B == ref["global_batch"]  # what the replay trains stage 01 at
    assert s["steps"] == ref["steps"] and s["micro_steps"] == K * s["steps"]
    assert_same_training(accumulated, runs["01"])
    assert s["losses"] == pytest.approx(ref["losses"], rel=1e-9)
    assert s["eval_accuracy"] == ref["eval_accuracy"]


def test_gradients_are_all_reduced_once_per_optimizer_step(accumulated):
    s = accumulated.summary
    # One bucket: the model's 40 KB of gradients fit DDP's first bucket (1 MB), so one all-reduce per sync.
    assert s["allreduces"] == s["steps"], f"{s['allreduces']} all-reduces for {s['steps']} optimizer steps"
    assert s["bytes_allreduced"] == s["steps"] * gradient_bytes()
    assert accumulated.stdout.count(f"gradient all-reduces: {s['allreduces']} (") == 1  # rank 0 alone prints it


@pytest.mark.readme_run(SYNCED_RUN)
def test_without_no_sync_same_weights_and_k_times_the_traffic(accumulated, synced):
    a, s = accumulated.summary, synced.summary
    assert s["sync_every_micro_batch"] and not a["sync_every_micro_batch"]
    # Same weights as the accumulated run after as many epochs (the sums of averages round differently: ~1e-16).
    gap = max_gap(list(synced.model.values()), accumulated.trajectory[SYNCED_EPOCHS]["params"])
    assert gap <= tolerance("float64"), f"weights differ from the no_sync run by {gap:.2e}"
    assert replay_error(s, synced.trajectory) <= tolerance("float64")
    assert s["allreduces"] == K * s["steps"] and s["bytes_allreduced"] == K * s["steps"] * gradient_bytes()
    # Per optimizer step, exactly K times what no_sync sends.
    assert s["allreduces"] * a["steps"] == K * a["allreduces"] * s["steps"]
    assert s["bytes_allreduced"] * a["steps"] == K * a["bytes_allreduced"] * s["steps"]


@pytest.mark.parametrize("world,k", [(2, 2), (2, 4), (4, 2)])
def test_k_micro_batches_of_the_ranks_are_stage_01s_batch(world, k):
    """Rank r's micro-batch j holds positions r + W*(j*b + i) of the epoch's permutation, i < b: so micro-batches
    sK..sK+K-1 of all W ranks hold positions sWKb .. (s+1)WKb - 1, stage 01's step s at batch W*K*b."""
    recipe, s01 = load_stage(RECIPE), load_stage("01_single_gpu")
    index = TensorDataset(torch.arange(recipe.N_TRAIN))
    reference = s01.prepare_dataloader(index, world * k * B)
    for epoch in range(2):
        reference.sampler.generator.manual_seed(epoch)  # seed 0 + epoch, as stage 01's Trainer does
        steps = [batch[0] for batch in reference]
        per_rank = []
        for rank in range(world):
            loader = recipe.prepare_dataloader(index, B, rank, world, 0)
            loader.sampler.set_epoch(epoch)
            micro = [batch[0] for batch in loader]
            assert len(micro) % k == 0
            per_rank.append([torch.cat(micro[i:i + k]) for i in range(0, len(micro), k)])  # as Trainer groups them
        assert len(per_rank[0]) == len(steps)
        for step, ranks in zip(steps, zip(*per_rank, strict=True), strict=True):
            assert sorted(torch.cat(ranks).tolist()) == sorted(step.tolist())
