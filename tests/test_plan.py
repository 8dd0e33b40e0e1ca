"""The tour's plan on machines this one is not: no GPU, one GPU, two, three and four GPUs.

plan() takes the GPU count as an argument, so what the tour would launch on a GPU machine is
checked here without one: every run computes the same global batch, and no run asks for more
GPUs than there are (one GPU is the commonest GPU a learner has).
"""
from __future__ import annotations

import pytest

from harness import plan
from tour import parse_args, tour_world

WORLD_BATCH = 32


def flag(step, name: str) -> str:
    return step.args[step.args.index(name) + 1]


def processes(step) -> int:
    if step.launcher == "torchrun":
        return step.nproc * step.nnodes
    return int(flag(step, "--world-size")) if "--world-size" in step.args else 1


def global_batch(step) -> int:
    """Samples per step: the processes' batches, except that 09's tp ranks of a row share theirs (dp = W / tp), and
    so do 10's pipeline stages (dp = W / pp)."""
    shared = int(flag(step, "--tp")) if "--tp" in step.args else int(flag(step, "--pp")) if "--pp" in step.args else 1
    return processes(step) // shared * int(flag(step, "--batch-size"))


def gpus_per_process(step, gpus: int) -> int:
    """How many GPUs one process of `step` takes: 07 takes two when each process can have two."""
    if flag(step, "--device") == "cpu" or gpus == 0:
        return 0
    return 2 if step.stage.startswith("07") and gpus >= 2 * step.nproc else 1


@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 4, 6, 8])
def test_every_run_computes_the_same_global_batch_on_the_gpus_there_are(gpus):
    world = tour_world(gpus)
    assert 4096 % (world * WORLD_BATCH) == 0, "the sampler would pad the last step: not stage 01's training"
    steps = plan(world, WORLD_BATCH, dtype="float64", gpus=gpus)
    assert [s.stage[:2] for s in steps][:2] == ["01", "02"] and {s.stage[:2] for s in steps} >= set("01 03 07".split())
    for step in steps:
        assert global_batch(step) == world * WORLD_BATCH, step
        assert flag(step, "--dtype") == "float64"
        on_node = step.nproc if step.launcher == "torchrun" else processes(step)  # processes sharing a node's GPUs
        assert on_node * gpus_per_process(step, gpus) <= gpus, f"{step} needs more than {gpus} GPU(s)"
        if gpus == 0:
            assert flag(step, "--device") != "cuda", step


def test_one_gpu_runs_single_processes_on_it_and_the_rest_on_the_cpu():
    steps = plan(2, WORLD_BATCH, gpus=1)
    on_gpu = [(s.stage[:2], s.launcher) for s in steps if flag(s, "--device") == "cuda"]
    assert on_gpu == [("01", "python"), ("02", "python"), ("04", "python"), ("04", "torchrun")]
    assert all(processes(s) == 1 for s in steps if flag(s, "--device") == "cuda")
    assert all(processes(s) == 2 and flag(s, "--device") == "cpu" for s in steps if flag(s, "--device") != "cuda")


def test_two_gpus_per_process_for_07_where_there_are_enough():
    seven = {g: next(s for s in plan(g, WORLD_BATCH, gpus=g) if s.stage.startswith("07")) for g in (2, 3, 4)}
    assert (seven[4].nproc, flag(seven[4], "--batch-size")) == (2, "64")  # 2 processes x 2 GPUs
    assert (seven[2].nproc, flag(seven[2], "--batch-size")) == (1, "64")
    assert seven[3].nproc == 3  # an odd count: one GPU per process, both halves on it


def test_the_tour_takes_every_stages_learning_rate_and_seed():
    """`tour.py --lr 0.1 --seed 3`: every run trains at that rate from that seed (the replay reads them back from
    each run's summary), so the verdict can be checked at another learning rate without running stages by hand."""
    args = parse_args(["--lr", "0.1", "--seed", "3"])
    steps = plan(tour_world(0), WORLD_BATCH, lr=args.lr, seed=args.seed, gpus=0)
    assert all((flag(s, "--lr"), flag(s, "--seed")) == ("0.1", "3") for s in steps), steps
    assert all("--lr" not in s.args and "--seed" not in s.args for s in plan(2, WORLD_BATCH, gpus=0))



@pytest.mark.parametrize("flags", [["--lr", "0"], ["--epochs", "0"], ["--batch-size", "-1"], ["--timeout", "nan"]])
def test_a_bad_tour_flag_is_one_line_naming_it(flags, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and err.startswith(f"tour.py: error: argument {flags[0]}: "), err
