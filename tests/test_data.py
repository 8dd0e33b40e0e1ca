"""The data contract, checked in-process: sampler coverage and order, exact distributed evaluation."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from harness import load_stage

SEED = 0


@pytest.fixture(scope="module")
def s01():
    return load_stage("01_single_gpu")


@pytest.fixture(scope="module")
def s03():
    return load_stage("03_ddp_spawn")


def contract_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def rank_batches(s03, n: int, batch: int, world: int, epoch: int) -> list[list[torch.Tensor]]:
    """Per rank, the list of index batches that rank trains on in `epoch`."""
    index = TensorDataset(torch.arange(n))
    out = []
    for rank in range(world):
        loader = s03.prepare_dataloader(index, batch, rank, world, SEED)
        loader.sampler.set_epoch(epoch)
        out.append([b[0] for b in loader])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_sample_once_per_epoch_and_order_changes(s03, world):
    n = s03.N_TRAIN
    seen = []
    for epoch in range(2):
        per_rank = rank_batches(s03, n, 32, world, epoch)
        flat = torch.cat([torch.cat(batches) for batches in per_rank])
        assert sorted(flat.tolist()) == list(range(n)), "a sample was skipped or seen twice"
        seen.append(torch.cat(per_rank[0]))
    assert not torch.equal(seen[0], seen[1]), "rank 0 sees the same order in epochs 0 and 1"


@pytest.mark.parametrize("world", [2, 4])
def test_step_k_of_the_ranks_is_step_k_at_the_global_batch(s03, world):
    n, b = s03.N_TRAIN, 16
    for epoch in range(2):
        order = contract_order(n, SEED, epoch)
        per_rank = rank_batches(s03, n, b, world, epoch)
        for k, step in enumerate(zip(*per_rank, strict=True)):
            assert sorted(torch.cat(step).tolist()) == sorted(order[k * world * b:(k + 1) * world * b].tolist())


def test_stage_01_follows_the_same_order(s01):
    n = s01.N_TRAIN
    loader = s01.prepare_dataloader(TensorDataset(torch.arange(n)), 64)
    for epoch in range(2):
        loader.sampler.generator.manual_seed(SEED + epoch)  # what Trainer._run_epoch does
        assert torch.equal(torch.cat([b[0] for b in loader]), contract_order(n, SEED, epoch))


def test_data_is_deterministic_and_held_out_split_is_uneven(s01):
    (xa, ya), (xb, yb) = [s01.make_data(SEED)[0].tensors for _ in range(2)]
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(s01.make_data(SEED + 1)[0].tensors[0], xa)
    assert s01.N_EVAL % 2 and s01.N_EVAL % 4 and s01.N_TRAIN % 64 == 0
    # every class occurs: the task is not a constant
    assert torch.bincount(ya, minlength=s01.N_CLASSES).min() > 0.1 * len(ya)


@pytest.mark.parametrize("name", ["03", "04"])
def test_distributed_metric_equals_single_process_metric(runs, s01, name):
    run = runs[name]
    model = s01.Net()
    model.load_state_dict(run.model)
    _, eval_set = s01.make_data(SEED)
    loss_sum, correct, count = s01.evaluate(model, eval_set, torch.device("cpu"))
    s = run.summary
    assert s["eval_count"] == count == s01.N_EVAL  # the sampler's padding was not counted
    assert s["eval_accuracy"] == correct / count
    assert s["eval_loss"] == pytest.approx(loss_sum / count, rel=1e-6)
