"""The tutorial's central claim: W ranks of batch b compute the training of one process with batch W*b.

Checked as the tour checks it (harness.assert_same_training): every epoch a run recorded replays
with stage 01's own code to within sqrt(eps) of its dtype, and its final weights match stage 01's.
The negative controls show the check is sharp enough to fail: drop set_epoch, shrink the real
batch, change the initial weights, or remove DDP, and the replay (or the replicas) differ by far more; and
tour.py's own verdict, handed the run without set_epoch, fails.
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import CONFIGS, DTYPE, B, W
from harness import (
    Run,
    Step,
    assert_same_training,
    check,
    launch,
    max_abs_diff,
    max_gap,
    mutate,
    replay_error,
    tolerance,
    with_batch,
)

BUG = 1e-3  # a broken stage's epoch replay is off by 1e-1 here; 1e-3 is still 1e5 times the tolerance


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "01"])
def test_same_training_as_stage_01(runs, name):
    assert_same_training(runs[name], runs["01"])


def test_stage_01_replays_itself_exactly(runs):
    # The replay is stage 01's own code on the CPU: for stage 01's CPU run, it must agree to the bit.
    assert replay_error(runs["01"].summary, runs["01"].trajectory) == 0.0


@pytest.mark.parametrize("name", CONFIGS)
def test_trajectory_is_the_run_itself(runs, name):
    """What the replay reads is what the run trained: one state per epoch, in the run's dtype, ending at model.pt."""
    s, trajectory, model = runs[name].summary, runs[name].trajectory, runs[name].model
    assert [t["epoch"] for t in trajectory] == list(range(s["epochs"] + 1))
    assert all(p.dtype.is_floating_point and str(p.dtype) == f"torch.{DTYPE}" for p in trajectory[-1]["params"])
    assert all(m is None for m in trajectory[0]["momentum"]) and all(m is not None for m in trajectory[1]["momentum"])
    assert max_gap(list(model.values()), trajectory[-1]["params"]) == 0.0  # state_dict order = parameters() order


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "01"])
def test_same_losses_and_metric_as_stage_01(runs, name):
    ref, s = runs["01"].summary, runs[name].summary
    assert s["steps"] == ref["steps"] and s["dtype"] == ref["dtype"] == DTYPE
    assert s["losses"] == pytest.approx(ref["losses"], rel=1e-9)
    assert s["eval_accuracy"] == ref["eval_accuracy"]
    assert s["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-9)


def replay_of_mutant(stage: str, old: str, new: str, tmp_path, step: Step | None = None) -> tuple[float, Run]:
    """A copy of `stage` with one edit, launched as the suite does: (its epoch replay error, the run)."""
    path = mutate(stage, old, new, tmp_path / "src")
    run = check(launch(step or CONFIGS[stage[:2]], out=tmp_path / "out", script=path))
    return replay_error(run.summary, run.trajectory), run


@pytest.fixture(scope="module")
def no_set_epoch(tmp_path_factory: pytest.TempPathFactory) -> tuple[float, Run]:
    """Stage 03 without set_epoch: every epoch shuffles as the first did."""
    return replay_of_mutant("03_ddp_spawn", "self.train_loader.sampler.set_epoch(epoch)", "pass",
                            tmp_path_factory.mktemp("no_set_epoch"))


def test_without_set_epoch_the_replay_fails(runs, no_set_epoch):
    replay, run = no_set_epoch
    assert replay > BUG > tolerance(DTYPE)
    assert max_abs_diff(runs["01"].model, run.model) > BUG


@pytest.mark.parametrize("broken", [False, True], ids=["03", "03-without-set-epoch"])
def test_the_tours_verdict_fails_on_a_broken_stage(runs, no_set_epoch, broken, tmp_path, monkeypatch, capsys):
    """tour.main itself, its plan cut to stage 01 and stage 03, handed the runs made above instead of launching
    them again: with the real 03 it says every stage computed stage 01's training and exits 0; with the copy
    without set_epoch it prints the table, says FAILED and exits 1."""
    import tour
    made = {"01_single_gpu": runs["01"], "03_ddp_spawn": no_set_epoch[1] if broken else runs["03"]}
    monkeypatch.setattr(tour, "plan", lambda *args, **kwargs: [CONFIGS["01"], CONFIGS["03"]])
    monkeypatch.setattr(tour, "slurm_missing", lambda: "not in this test")

    def handed_over(cmds: list[list[str]], out: Path, *args, **kwargs) -> Run:
        run = next(run for stage, run in made.items() if f"{stage}/train.py" in " ".join(cmds[0]))
        shutil.copytree(run.out, out, dirs_exist_ok=True)
        return replace(run, out=out)
    monkeypatch.setattr(tour, "run_job", handed_over)
    code = tour.main(["--dtype", DTYPE, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert printed.count("03_ddp_spawn") == 2, printed  # its line as it ran, and its row
    if broken:
        assert code == 1 and "\nFAILED: see above" in printed, printed
    else:
        assert code == 0 and "\nevery stage computed stage 01's training" in printed, printed


def test_a_smaller_real_batch_than_reported_fails(runs, tmp_path):
    # The summary still says global batch 64; the loader really takes 32.
    replay, run = replay_of_mutant("04_ddp_torchrun", "prepare_dataloader(train_set, args.batch_size, rank",
                                   "prepare_dataloader(train_set, args.batch_size // 2, rank", tmp_path,
                                   CONFIGS["04_python"])
    assert run.summary["global_batch"] == runs["01"].summary["global_batch"]
    assert replay > BUG and max_abs_diff(runs["01"].model, run.model) > BUG


def test_other_initial_weights_fail(tmp_path):
    replay, _ = replay_of_mutant("04_ddp_torchrun", "torch.manual_seed(args.seed)  #", "torch.manual_seed(1)  #",
                                 tmp_path, CONFIGS["04_python"])
    assert replay > BUG


def test_a_different_global_batch_gives_different_weights(runs, tmp_path):
    run = check(launch(with_batch(CONFIGS["01"], W * B // 2), out=tmp_path))
    assert max_abs_diff(runs["01"].model, run.model) > BUG


def test_without_ddp_the_replica_check_fails(tmp_path):
    # No gradient all-reduce: each rank steps on its own half of the batch and the replicas drift apart.
    path = mutate("03_ddp_spawn", 'model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)',
                  "pass", tmp_path / "src")
    step = CONFIGS["03"]
    run = launch(Step(step.stage, step.launcher, (*step.args, "--epochs", "1")), out=tmp_path / "out", script=path)
    assert run.returncode != 0 and not run.survivors, run.describe()
    assert "replicas diverged" in run.stderr
    assert run.summary["replica_max_abs_diff"] > BUG
