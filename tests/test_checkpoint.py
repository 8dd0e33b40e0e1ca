"""Stage 06: resume is exact, and killed workers are survived (bad snapshots: test_faults.py)."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS
from harness import (
    Job,
    Step,
    assert_same_training,
    attempt_workers,
    check,
    launch,
    load_stage,
    max_abs_diff,
    time_limit,
    with_args,
)

STAGE = "06_checkpoint"
FIRST = 2  # epochs in the snapshot: runs["06"] trains the tour's 5 in one go


@pytest.fixture(scope="module")
def snapshot_after_2_epochs(tmp_path_factory) -> bytes:
    """Stage 06 stopped after FIRST of the epochs of runs["06"]: the snapshot it left."""
    tmp = tmp_path_factory.mktemp("snapshot")
    first = check(launch(with_args(CONFIGS["06"], "--snapshot", str(tmp / "s.pt"), "--epochs", str(FIRST)), out=tmp))
    assert "resumed" not in first.stdout
    return (tmp / "s.pt").read_bytes()


def test_resume_is_exact(runs, snapshot_after_2_epochs, tmp_path):
    full = runs["06"]  # the tour's epochs, uninterrupted
    snapshot = tmp_path / "snapshot.pt"
    snapshot.write_bytes(snapshot_after_2_epochs)
    second = check(launch(with_args(CONFIGS["06"], "--snapshot", str(snapshot)), out=tmp_path / "b"))
    assert "resumed from" in second.stdout and f"after epoch {FIRST}" in second.stdout
    assert second.summary["resumed_from_epoch"] == FIRST
    assert second.summary["losses"] == full.summary["losses"]  # the first FIRST come from the snapshot
    assert second.summary["steps"] == full.summary["steps"]
    assert max_abs_diff(second.model, full.model) == 0.0
    for resumed, uninterrupted in zip(second.trajectory, full.trajectory[FIRST:], strict=True):  # the very states
        assert resumed["epoch"] == uninterrupted["epoch"]
        assert all(map(torch.equal, resumed["params"] + resumed["momentum"],
                       uninterrupted["params"] + uninterrupted["momentum"]))


def test_a_finished_snapshot_says_there_is_nothing_to_train(snapshot_after_2_epochs, tmp_path):
    """Resumed at (or past) --epochs, the run trains nothing: it says so in one line, with the --epochs that trains
    more, instead of ending silently as if it had trained. (One process of batch 64: the snapshot's global batch.)"""
    snapshot = tmp_path / "s.pt"
    snapshot.write_bytes(snapshot_after_2_epochs)
    args = ("--device", "cpu", "--dtype", "float64", "--batch-size", "64", "--epochs", str(FIRST),
            "--snapshot", str(snapshot))
    run = check(launch(Step(STAGE, "python", args)))
    assert f"after epoch {FIRST}" in run.stdout and f"epoch {FIRST + 1}/" not in run.stdout, run.stdout
    told = [line for line in run.stdout.splitlines() if line.startswith("nothing to train")]
    assert len(told) == 1 and f"--epochs is {FIRST}" in told[0] and f"pass --epochs {FIRST + 10}" in told[0], \
        run.stdout
    assert snapshot.read_bytes() == snapshot_after_2_epochs  # nothing trained, nothing saved


def _epochs_in(snapshot: Path) -> int:
    try:
        return torch.load(snapshot, weights_only=True)["epochs_run"]
    except Exception:  # not written yet (the rename is atomic, so never half-written)
        return 0


def _version(snapshot: Path) -> tuple[int, int] | None:
    """Which file the snapshot path names now: each save renames a new file onto it. One stat, so the killer sees a
    new snapshot within a poll however loaded the machine is."""
    try:
        st = snapshot.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


KILLED = (1, 0, 1)  # the rank killed in each of the first 3 attempts: alternating
LONG = 10  # the killed job's epochs: the 3 killed attempts need to save 1 each; the other 7 are the kills' slack


def test_killed_workers_are_restarted_and_resume_exactly(tmp_path):
    """Three SIGKILLs, each once the attempt has saved a new snapshot, alternating ranks: the job still ends at the
    weights of the same job uninterrupted."""
    whole = check(launch(with_args(CONFIGS["06"], "--epochs", str(LONG)), out=tmp_path / "whole"))
    snapshot = tmp_path / "snapshot.pt"
    step = with_args(CONFIGS["06"], "--epochs", str(LONG), "--snapshot", str(snapshot))
    step = replace(step, torchrun_args=("--max-restarts=3",))
    kills: list[tuple[int, int]] = []  # (epochs in the snapshot, rank killed)
    errors: list[str] = []

    def killer(job: Job) -> None:  # runs beside the job
        earlier: set[int] = set()  # the workers of the attempts killed so far
        for rank in KILLED:
            # Found while they start, not once the snapshot is there: whatever the scan takes then, the job trains on
            # (a CI run's kill meant for epoch 3 landed at epoch 8).
            if (pids := attempt_workers(job, step.nproc, earlier)) is None:
                errors.append(f"the job ended before attempt {len(kills) + 1} had {step.nproc} workers")
                return
            # The old attempt's workers are gone before the new ones start: the snapshot is what it resumes from,
            # or already one it saved; kill once it has saved (another) one.
            resumed_from = _version(snapshot)
            while _version(snapshot) == resumed_from:
                if job.ended.is_set():
                    errors.append(f"the job ended before attempt {len(kills) + 1} saved a snapshot")
                    return
                time.sleep(0.02)
            os.kill(pids[rank], signal.SIGKILL)
            kills.append((_epochs_in(snapshot), rank))
            earlier |= set(pids.values())

    # torchrun's agent, and the ranks of the first attempt and of the 3 restarts
    run = check(launch(step, out=tmp_path / "out", timeout=time_limit(programs=1 + 4 * step.nproc), during=killer))
    assert not errors and len(kills) == 3, f"{errors} {kills}\n{run.describe()}"
    assert run.stdout.count("resumed from") == 3, run.stdout
    assert "(torchrun restart 3)" in run.stdout
    assert run.summary["restart_count"] == 3
    assert len(run.summary["losses"]) == LONG and run.summary["losses"] == whole.summary["losses"]
    assert max_abs_diff(run.model, whole.model) == 0.0


def test_snapshot_model_loads_into_stage_01(tmp_path):
    snapshot = tmp_path / "s.pt"
    check(launch(Step(STAGE, "python", ("--device", "cpu", "--epochs", "1", "--snapshot", str(snapshot)))))
    state = torch.load(snapshot, weights_only=True)
    load_stage("01_single_gpu").Net().load_state_dict(state["model"])
    assert state["epochs_run"] == 1 and len(state["losses"]) == 1
    assert not list(tmp_path.glob("*.tmp")), "the temporary file of the atomic save was left behind"


def test_stage_07_resumes_from_a_stage_06_snapshot(runs, snapshot_after_2_epochs, tmp_path):
    """The split model has the same state_dict keys, so 06's snapshot format carries over."""
    snapshot = tmp_path / "snapshot.pt"
    snapshot.write_bytes(snapshot_after_2_epochs)
    run = check(launch(with_args(CONFIGS["07"], "--snapshot", str(snapshot)), out=tmp_path / "out"))
    assert f"after epoch {FIRST}" in run.stdout and run.summary["resumed_from_epoch"] == FIRST
    assert run.summary["losses"][:FIRST] == runs["06"].summary["losses"][:FIRST]
    assert run.trajectory[0]["epoch"] == FIRST  # the replay checks the epochs 07 trained itself
    assert_same_training(run, runs["01"])
