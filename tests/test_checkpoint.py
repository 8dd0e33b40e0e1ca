"""Stage 06: resume is exact, a killed worker is survived, and a bad snapshot is refused without harm."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import CONFIGS
from harness import Step, check, launch, load_stage, max_abs_diff

STAGE = "06_checkpoint"


def with_args(step: Step, *args: str, **changes) -> Step:
    return replace(step, args=(*step.args, *args), **changes)


@pytest.fixture(scope="module")
def snapshot_after_8_epochs(tmp_path_factory) -> bytes:
    """Stage 06 stopped after 8 of the 20 epochs of runs["06"]: the snapshot it left."""
    tmp = tmp_path_factory.mktemp("snapshot8")
    first = check(launch(with_args(CONFIGS["06"], "--snapshot", str(tmp / "s.pt"), "--epochs", "8"), out=tmp))
    assert "resumed" not in first.stdout
    return (tmp / "s.pt").read_bytes()


def test_resume_is_exact(runs, snapshot_after_8_epochs, tmp_path):
    full = runs["06"]  # 20 epochs, uninterrupted
    snapshot = tmp_path / "snapshot.pt"
    snapshot.write_bytes(snapshot_after_8_epochs)
    second = check(launch(with_args(CONFIGS["06"], "--snapshot", str(snapshot)), out=tmp_path / "b"))
    assert "resumed from" in second.stdout and "after epoch 8" in second.stdout
    assert second.summary["resumed_from_epoch"] == 8
    assert second.summary["losses"] == full.summary["losses"]  # the first 8 come from the snapshot
    assert second.summary["steps"] == full.summary["steps"]
    assert max_abs_diff(second.model, full.model) == 0.0


def _workers(marker: str) -> dict[int, int]:
    """{global rank: pid} of the training processes whose command line holds `marker` (not the torchrun agent)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmd and b"torch.distributed.run" not in cmd:
            rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(proc.name)
    return found


def _epochs_in(snapshot: Path) -> int:
    try:
        return torch.load(snapshot, weights_only=True)["epochs_run"]
    except Exception:  # not written yet (the rename is atomic, so never half-written)
        return 0


def test_killed_workers_are_restarted_and_resume_exactly(runs, tmp_path):
    """Three SIGKILLs, each after a new snapshot, alternating ranks: the job still ends at the same weights."""
    snapshot = tmp_path / "snapshot.pt"
    step = with_args(CONFIGS["06"], "--snapshot", str(snapshot))
    step = replace(step, torchrun_args=("--max-restarts=3",))
    kills: list[tuple[int, int]] = []  # (epochs in the snapshot, rank killed)
    errors: list[str] = []

    def killer() -> None:
        deadline = time.monotonic() + 150
        for target, rank in [(2, 1), (6, 0), (10, 1)]:
            while _epochs_in(snapshot) < target:  # mid-training: after this attempt saved a new epoch
                if time.monotonic() > deadline:
                    errors.append(f"snapshot never reached epoch {target}")
                    return
                time.sleep(0.05)
            workers = _workers(str(snapshot))
            if rank not in workers:
                errors.append(f"no worker of rank {rank} at epoch {target}: {workers}")
                return
            os.kill(workers[rank], signal.SIGKILL)
            kills.append((_epochs_in(snapshot), rank))

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    run = check(launch(step, out=tmp_path / "out", timeout=240))
    thread.join(timeout=5)
    assert not errors and len(kills) == 3, (errors, kills, run.describe())
    assert run.stdout.count("resumed from") == 3, run.stdout
    assert "(torchrun restart 3)" in run.stdout
    assert run.summary["restart_count"] == 3
    assert run.summary["losses"] == runs["06"].summary["losses"]
    assert max_abs_diff(run.model, runs["06"].model) == 0.0


@pytest.fixture(scope="module")
def bad_snapshots(tmp_path_factory):
    """Each kind of bad file, and the result of starting stage 06 on it (plain python: one process)."""
    tmp = tmp_path_factory.mktemp("bad_snapshots")
    marker = tmp / "payload_ran"
    good = tmp / "good.pt"
    check(launch(Step(STAGE, "python", ("--device", "cpu", "--epochs", "1", "--snapshot", str(good)))))
    files = {
        "truncated": good.read_bytes()[: len(good.read_bytes()) // 2],
        "not_torch": b"this is not a snapshot\n",
        "foreign": None,  # a plain state_dict (stage 01's model.pt shape): a torch file, not a snapshot
        "payload": None,  # a pickle whose loading would run code
        "other_model": None,  # shaped like a snapshot, but of another network
    }
    paths = {}
    for kind, data in files.items():
        paths[kind] = tmp / f"{kind}.pt"
        if data is not None:
            paths[kind].write_bytes(data)
    torch.save(load_stage("01_single_gpu").Net().state_dict(), paths["foreign"])
    torch.save({"model": Payload(str(marker))}, paths["payload"])
    other = torch.load(good, weights_only=True)
    other["model"] = {"layer.weight": torch.zeros(3, 3), "layer.bias": "not a tensor"}
    torch.save(other, paths["other_model"])
    before = {kind: p.read_bytes() for kind, p in paths.items()}

    def start(kind: str):
        return launch(Step(STAGE, "python", ("--device", "cpu", "--epochs", "2", "--snapshot", str(paths[kind]))),
                      timeout=60)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(files, pool.map(start, files), strict=True))
    return results, paths, before, marker


class Payload:
    """Unpickling this would create a file: proof that the code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("kind", ["truncated", "not_torch", "foreign", "payload", "other_model"])
def test_bad_snapshot_is_refused_in_one_line_and_left_alone(bad_snapshots, kind):
    results, paths, before, marker = bad_snapshots
    run = results[kind]
    assert run.returncode == 2 and not run.survivors, run.describe()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "argument --snapshot" in lines[0] and str(paths[kind]) in lines[0], run.describe()
    assert paths[kind].read_bytes() == before[kind], "a refused snapshot was overwritten"
    assert not marker.exists(), "the pickle payload ran"


def test_snapshot_model_loads_into_stage_01(tmp_path):
    snapshot = tmp_path / "s.pt"
    check(launch(Step(STAGE, "python", ("--device", "cpu", "--epochs", "1", "--snapshot", str(snapshot)))))
    state = torch.load(snapshot, weights_only=True)
    load_stage("01_single_gpu").Net().load_state_dict(state["model"])
    assert state["epochs_run"] == 1 and len(state["losses"]) == 1
    assert not list(tmp_path.glob("*.tmp")), "the temporary file of the atomic save was left behind"


def test_stage_07_resumes_from_a_stage_06_snapshot(runs, snapshot_after_8_epochs, tmp_path):
    """The split model has the same state_dict keys, so 06's snapshot format carries over."""
    snapshot = tmp_path / "snapshot.pt"
    snapshot.write_bytes(snapshot_after_8_epochs)
    run = check(launch(with_args(CONFIGS["07"], "--snapshot", str(snapshot)), out=tmp_path / "out"))
    assert "after epoch 8" in run.stdout and run.summary["resumed_from_epoch"] == 8
    assert run.summary["losses"][:8] == runs["06"].summary["losses"][:8]
    assert max_abs_diff(run.model, runs["01"].model) <= 1e-5
