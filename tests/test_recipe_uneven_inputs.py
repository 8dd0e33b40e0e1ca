"""Recipe uneven_inputs: ranks with different numbers of batches, trained to the end under Join.

Claims: the sampler gives every rank a contiguous, unpadded shard of each epoch's order (stage 01's),
so the ranks' batch counts really differ; with Join the job finishes, the replicas end identical and
every step is exactly this arithmetic (checked by simulating it in float64 with stage 01's model):
the active ranks' mean-loss gradients are summed (a joined rank adds zeros) and divided by the world
size W (--divide-by world, torch's default) or by the number of active ranks (--divide-by active),
then SGD with momentum 0.9 steps, and the momentum is the same on every rank; the epoch's loss is the
mean over the samples really seen. Without Join the job fails at once with gloo's mismatch error and
the stage's one-line hint, and never hangs.
"""
from __future__ import annotations

import argparse
import itertools
import math
import re
import time

import pytest
import torch
import torch.nn.functional as F

from harness import (
    Job,
    Run,
    Step,
    check,
    launch,
    load_stage,
    max_abs_diff,
    max_gap,
    programs,
    restore_state,
    state_gap,
    time_limit,
)

RECIPE = "recipes/uneven_inputs"
W, B, EPOCHS, SKEW = 2, 32, 3, 1.0  # rank 1 gets twice rank 0's samples: 43 and 86 batches per epoch
ARGS = ("--device", "cpu", "--dtype", "float64", "--batch-size", str(B), "--epochs", str(EPOCHS), "--skew", str(SKEW))
EXACT = 1e-12  # float64: one epoch's rounding here is ~1e-15; the other divisor is off by ~1e-2


@pytest.fixture(scope="module")
def joined(tmp_path_factory) -> dict[str, Run]:
    """One run per divisor, each launched once, on first use."""
    class Runs(dict):
        def __missing__(self, divide_by: str) -> Run:
            step = Step(RECIPE, "torchrun", (*ARGS, "--divide-by", divide_by), nproc=W)
            self[divide_by] = check(launch(step, out=tmp_path_factory.mktemp(f"join_{divide_by}")))
            return self[divide_by]

    return Runs()


def shard_bounds(n: int, world_size: int, skew: float) -> list[int]:
    """Where each rank's shard starts, from the closed form of sum(1 + skew*i for i < r) (not the recipe's code)."""
    total = world_size + skew * world_size * (world_size - 1) / 2
    return [round(n * (r + skew * r * (r - 1) / 2) / total) for r in range(world_size + 1)]


def order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("skew", [0.0, 0.5, 1.0, 3.0])
def test_the_sampler_cuts_each_epoch_into_uneven_shards_without_padding(world_size, skew):
    recipe, n, seed = load_stage(RECIPE), 4096, 7
    bounds = shard_bounds(n, world_size, skew)
    for epoch in (0, 1):
        shards = []
        for rank in range(world_size):
            sampler = recipe.UnevenSampler(n, rank, world_size, seed, skew)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
            assert len(sampler) == len(shards[-1]) == bounds[rank + 1] - bounds[rank]
        # Concatenated, the shards are the epoch's order itself: each sample once, nothing padded or dropped.
        assert sum(shards, []) == order(n, seed, epoch).tolist()
        sizes = [len(s) for s in shards]
        if skew == 0:
            assert max(sizes) - min(sizes) <= 1
        elif world_size > 1:  # the last rank has the most: 1 + skew*(W-1) times the first's
            assert sizes == sorted(sizes)
            assert sizes[-1] / sizes[0] == pytest.approx(1 + skew * (world_size - 1), rel=1e-2)


def simulate_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_set, epoch: int,
                   seed: int, divide_by: str) -> float:
    """One epoch of W ranks on uneven shards, in this process: the arithmetic the recipe claims; returns its loss."""
    bounds = shard_bounds(len(train_set), W, SKEW)
    perm = order(len(train_set), seed, epoch)
    batches = [perm[bounds[r]:bounds[r + 1]].split(B) for r in range(W)]  # the last one of each rank may be short
    loss_sum, count = 0.0, 0
    for k in range(max(len(b) for b in batches)):
        active = [r for r in range(W) if k < len(batches[r])]  # the others have joined: they add zeros
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in active:
            x, y = train_set[batches[r][k]]
            loss = F.cross_entropy(model(x), y)  # the rank's own mean over its batch
            for t, g in zip(total, torch.autograd.grad(loss, list(model.parameters())), strict=True):
                t += g
            loss_sum, count = loss_sum + loss.item() * len(y), count + len(y)
        divisor = W if divide_by == "world" else len(active)
        for p, t in zip(model.parameters(), total, strict=True):
            p.grad = t / divisor
        optimizer.step()  # torch.optim.SGD, momentum 0.9, as stage 01 builds it
    assert count == len(train_set)
    return loss_sum / count


def simulation_error(run: Run, divide_by: str) -> tuple[float, list[float]]:
    """Replay each recorded epoch from the run's state before it: (largest |difference| in weights or momentum,
    the simulated epoch losses)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and 30x faster beside other jobs on 2 cores
    try:
        return _simulation_error(run, divide_by)
    finally:
        torch.set_num_threads(threads)


def _simulation_error(run: Run, divide_by: str) -> tuple[float, list[float]]:
    s, trajectory = run.summary, run.trajectory
    s01 = load_stage("01_single_gpu")
    args = argparse.Namespace(seed=s["seed"], lr=s["lr"], dtype=s["dtype"], batch_size=B)
    train_set, _, model, optimizer = s01.load_train_objs(args, torch.device("cpu"))
    params = list(model.parameters())
    worst, losses = max_gap(params, trajectory[0]["params"]), []  # starts at stage 01's initial weights
    for before, after in itertools.pairwise(trajectory):
        restore_state(params, optimizer, before)
        losses.append(simulate_epoch(model, optimizer, train_set, before["epoch"], s["seed"], divide_by))
        worst = max(worst, state_gap(params, optimizer, after))
    return worst, losses


def test_with_join_the_uneven_job_finishes_and_learns(joined):
    run = joined["world"]
    s = run.summary
    bounds = shard_bounds(4096, W, SKEW)
    sizes = [bounds[r + 1] - bounds[r] for r in range(W)]
    assert s["samples_per_rank"] == sizes == [1365, 2731]
    assert s["batches_per_rank"] == [[math.ceil(n / B) for n in sizes]] * EPOCHS == [[43, 86]] * EPOCHS
    assert s["steps"] == EPOCHS * 86 and s["join"] is True and s["divide_by"] == "world"
    assert s["replica_max_abs_diff"] == 0.0  # Join's final broadcast and the momentum copy: one model
    assert all(a > b for a, b in itertools.pairwise(s["losses"])), s["losses"]
    assert s["losses"][-1] < s["losses"][0] / 4 and s["eval_accuracy"] > 0.9
    assert s["eval_count"] == 1001  # evaluation unchanged: every held-out sample once
    assert run.stdout.count("epoch 1/") == 1  # rank 0 alone logs


@pytest.mark.parametrize("divide_by", ["world", "active"])
def test_each_step_averages_the_active_ranks_gradients_as_claimed(joined, divide_by):
    run = joined[divide_by]
    assert run.summary["divide_by"] == divide_by
    error, losses = simulation_error(run, divide_by)
    assert error <= EXACT, f"--divide-by {divide_by}: the run is {error:.2e} from the claimed arithmetic"
    # The epoch's loss: the mean over the 4096 samples really seen, not over len(loader) x W batches.
    assert run.summary["losses"] == pytest.approx(losses, rel=EXACT, abs=0)
    other = "active" if divide_by == "world" else "world"
    wrong, _ = simulation_error(run, other)
    assert wrong > 1e-4, f"the simulation cannot tell the divisors apart ({wrong:.2e})"


def test_the_two_divisors_train_differently(joined):
    gap = max_abs_diff(joined["world"].model, joined["active"].model)
    assert gap > 1e-3, f"--divide-by world and active end {gap:.2e} apart"


class Started:
    """Passed to launch(during=...): when the job printed its first line (the processes are up)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, job: Job) -> None:
        while not job.ended.is_set():
            if "world size" in job.output():
                self.at = time.monotonic() - job.start
                return
            time.sleep(0.02)


def test_without_join_the_job_fails_at_once_and_never_hangs(tmp_path):
    timeout = 5.0
    started = Started()
    step = Step(RECIPE, "torchrun", (*ARGS, "--no-join", "--timeout", str(timeout), "--epochs", "2"), nproc=W)
    run = launch(step, out=tmp_path, timeout=time_limit(programs(step), waits=timeout), during=started)
    assert run.returncode not in (0, None) and not run.survivors, run.describe()
    assert not (tmp_path / "summary.json").exists()
    # Rank 0 ran out of batches and called the loss all_reduce (4 numbers) while rank 1's backward sent a gradient
    # bucket (4996 numbers) under the same sequence number: gloo refuses the oversized message and aborts rank 0...
    assert "Is there a distributed collective mismatch in your code?" in run.stderr, run.describe()
    # ...and rank 1, waiting in that gradient all-reduce, gets the stage's one-line hint, unless torchrun, seeing
    # rank 0 gone, stopped it first (a race: under load CI saw torchrun's SIGTERM report for rank 1 instead).
    hint = load_stage(RECIPE).explain_peer_failure(RuntimeError("Connection reset by peer"), timeout)
    stopped = re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -15 ", run.stderr)
    assert f"[{RECIPE}] rank 1: {hint}" in run.stderr or stopped, run.describe()
    assert started.at is not None, run.describe()
    # Past its start the job may wait --timeout at most, plus its exits: fewer than two start-ups (the launcher's and
    # its workers' imports and group, which this very job just took started.at to do), whatever the machine's pace.
    margin = 2 * started.at
    assert run.seconds - started.at < timeout + margin, \
        f"ended {run.seconds - started.at:.1f}s after it started ({started.at:.1f}s), past {timeout} + {margin:.1f}s"
