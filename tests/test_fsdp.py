"""Stage 08: FSDP2 shards everything a rank holds, still computes stage 01's training, and its sharded checkpoints
resume exactly, on any number of ranks (equivalence: test_equivalence.py; bad checkpoints: test_faults.py)."""
from __future__ import annotations

import math
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import CONFIGS, DTYPE, B, W
from harness import (
    Job,
    Run,
    Step,
    assert_same_training,
    attempt_workers,
    check,
    launch,
    load_stage,
    max_abs_diff,
    max_gap,
    mutate,
    replay_error,
    time_limit,
    tolerance,
    with_args,
    with_batch,
)

STAGE = "08_fsdp"
FIRST = 2  # epochs in the checkpoint the resume tests start from: runs["08"] trains the tour's EPOCHS in one go
UNITS = 2  # fully_shard on `body` and on `head`; the root holds no parameter of its own, so it gathers nothing
TOL = tolerance(DTYPE)


def stage_01_shapes() -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in load_stage("01_single_gpu").Net().state_dict().items()}


def test_each_rank_holds_one_shard_of_everything(runs):
    """ZeRO-3's arithmetic: parameters, gradients and momentum, each split in W; together exactly one replica."""
    s = runs["08"].summary
    assert len(s["bytes_per_rank"]) == len(s["shard_shapes"]) == s["world_size"] == W
    full = s["full_bytes"]
    assert full["params"] == sum(map(math.prod, stage_01_shapes().values())) * 8  # float64
    for part in ("params", "grads", "optimizer"):
        held = [b[part] for b in s["bytes_per_rank"]]
        assert sum(held) == full[part], (part, held, full)
        assert held == [full[part] // W] * W, (part, held)  # every dimension 0 here is even: equal halves
    for shapes in s["shard_shapes"]:  # dim-0 sharding: rank r holds rows [r*n/W, (r+1)*n/W) of every parameter
        assert shapes == {k: [v[0] // W, *v[1:]] for k, v in stage_01_shapes().items()}


@pytest.fixture(scope="module")
def no_reshard(runs, tmp_path_factory) -> Run:
    """One epoch with every unit kept gathered from its forward to its backward."""
    out = tmp_path_factory.mktemp("no_reshard")
    return check(launch(with_args(CONFIGS["08"], "--epochs", "1", "--no-reshard-after-forward"), out=out))


def test_collectives_of_one_step(runs, no_reshard):
    """All-gather each unit for its forward, again for its backward unless it stayed gathered; reduce-scatter
    each unit's gradients once. Keeping units gathered saves UNITS all-gathers a step and computes the same."""
    resharded, kept = runs["08"].summary, no_reshard.summary
    assert resharded["reshard_after_forward"] and not kept["reshard_after_forward"]
    assert resharded["collectives_per_step"] == {"allgather": 2 * UNITS, "reduce_scatter": UNITS}
    assert kept["collectives_per_step"] == {"allgather": UNITS, "reduce_scatter": UNITS}
    assert f"{2 * UNITS} allgather, {UNITS} reduce_scatter (reshard_after_forward=True)" in runs["08"].stdout
    assert max_gap(no_reshard.trajectory[1]["params"], runs["08"].trajectory[1]["params"]) <= TOL


def test_gradients_summed_instead_of_averaged_fail(runs, tmp_path):
    """The bug class of pytorch#162338 (gloo's AVG reduce-scatter returned the sum: gradients x W, silently):
    made here with FSDP's own divide factor. The equal-weights check catches it in one epoch."""
    line = "        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)\n"
    path = mutate(STAGE, line, line + "        block.set_gradient_divide_factor(1.0)\n", tmp_path / "src")
    run = check(launch(with_args(CONFIGS["08"], "--epochs", "1"), out=tmp_path / "out", script=path))
    assert replay_error(run.summary, run.trajectory) > 1e-3 > TOL
    assert max_gap(run.trajectory[1]["params"], runs["01"].trajectory[1]["params"]) > 1e-3


# --- sharded checkpoints ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint_after_2_epochs(tmp_path_factory) -> Path:
    """Stage 08 on W ranks stopped after FIRST epochs: the checkpoint directory it left (copy it before use)."""
    tmp = tmp_path_factory.mktemp("checkpoint")
    check(launch(with_args(CONFIGS["08"], "--snapshot", str(tmp / "ck"), "--epochs", str(FIRST))))
    return tmp / "ck"


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "ck"))


def test_every_rank_writes_its_own_shards(checkpoint_after_2_epochs):
    """One file per rank, each holding that rank's piece of every parameter: no rank gathered the model to save."""
    (last,) = checkpoint_after_2_epochs.iterdir()  # the older checkpoints were removed once this one was complete
    assert last.name == f"epoch_{FIRST:04d}"
    files = {f"__{r}_0.distcp" for r in range(W)}
    assert {f.name for f in last.iterdir()} == {".metadata", "progress.json", *files}
    with open(last / ".metadata", "rb") as f:
        metadata = load_stage(STAGE).MetadataUnpickler(f).load()
    for name in stage_01_shapes():
        pieces = [info.relative_path for index, info in metadata.storage_data.items() if index.fqn == f"model.{name}"]
        assert sorted(pieces) == sorted(files), (name, pieces)


def test_resume_reshards_onto_twice_the_ranks(runs, checkpoint_after_2_epochs, tmp_path):
    """Written by 2 ranks of batch 32, resumed by 4 of batch 16 (the same global batch): still stage 01's training."""
    ck = copy_of(checkpoint_after_2_epochs, tmp_path)
    step = with_args(with_batch(replace(CONFIGS["08"], nproc=2 * W), B // 2), "--snapshot", str(ck),
                     "--epochs", str(FIRST + 1))
    run = check(launch(step, out=tmp_path / "out", timeout=time_limit(programs=step.nproc)))
    s = run.summary
    assert f"(written by 2 ranks) after epoch {FIRST}" in run.stdout, run.stdout
    assert (s["world_size"], s["batch_size"], s["global_batch"], s["resumed_from_epoch"]) == \
        (2 * W, B // 2, W * B, FIRST)
    assert s["losses"][:FIRST] == runs["08"].summary["losses"][:FIRST]
    assert replay_error(s, run.trajectory) <= TOL
    assert max_gap(run.trajectory[-1]["params"], runs["01"].trajectory[FIRST + 1]["params"]) <= TOL
    assert [b["params"] for b in s["bytes_per_rank"]] == [s["full_bytes"]["params"] // (2 * W)] * (2 * W)


def test_resume_on_one_process(runs, checkpoint_after_2_epochs, tmp_path):
    """The same checkpoint, resumed by plain `python` (a group of one, batch 64), trained to runs["01"]'s end."""
    ck = copy_of(checkpoint_after_2_epochs, tmp_path)
    epochs = runs["01"].summary["epochs"]
    run = check(launch(Step(STAGE, "python", ("--device", "cpu", "--dtype", DTYPE, "--batch-size", str(W * B),
                                              "--epochs", str(epochs), "--snapshot", str(ck))), out=tmp_path / "out"))
    assert run.summary["resumed_from_epoch"] == FIRST and run.summary["world_size"] == 1
    assert_same_training(run, runs["01"])
    assert [p.name for p in ck.iterdir()] == [f"epoch_{epochs:04d}"]


def _epochs_in(directory: Path) -> int:
    done = [int(p.name.removeprefix("epoch_")) for p in directory.glob("epoch_*") if not p.name.endswith(".tmp")] \
        if directory.exists() else []
    return max(done, default=0)


def test_killed_worker_is_restarted_and_resumes_exactly(runs, tmp_path):
    """SIGKILL to rank 1 after the checkpoint of epoch FIRST: torchrun restarts the group, which ends bit for bit at
    the weights of the uninterrupted run."""
    ck = tmp_path / "ck"
    step = replace(with_args(CONFIGS["08"], "--snapshot", str(ck)), torchrun_args=("--max-restarts=1",))
    kills: list[int] = []

    def killer(job: Job) -> None:  # runs beside the job
        if (pids := attempt_workers(job, step.nproc)) is None:  # found while they start, to kill at once below
            return
        while _epochs_in(ck) < FIRST and not job.ended.is_set():
            time.sleep(0.05)
        if not job.ended.is_set():
            os.kill(pids[1], signal.SIGKILL)
            kills.append(_epochs_in(ck))

    run = check(launch(step, out=tmp_path / "out", timeout=time_limit(programs=1 + 2 * step.nproc),  # agent, 2 attempts
                       during=killer))
    assert len(kills) == 1 and kills[0] >= FIRST, (kills, run.describe())
    assert f"after epoch {kills[0]} (torchrun restart 1)" in run.stdout, run.stdout
    assert run.summary["restart_count"] == 1
    assert run.summary["losses"] == runs["08"].summary["losses"]
    assert max_abs_diff(run.model, runs["08"].model) == 0.0
