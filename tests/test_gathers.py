"""A sharded stage without --out never gathers the whole model: every all-gather it makes is one its layers need.

FSDP2 (08) gathers each unit's shards for that unit's forward and backward, on c10d's all-gather; tensor
parallelism (09) joins the classes' slices in each forward (a functional all-gather, and its backward). Anything
else that gathers a parameter whole, `DTensor.full_tensor()` in a per-epoch record or a state dict gathered for
evaluation, is a functional all-gather outside those counts: the thing FSDP exists to avoid, and what a learner
who copies the lesson into a model that does not fit one device would pay for in memory. The stages run wrapped
by tests/count_collectives.py (the profiler counts every collective; the stages carry no hook), without --out:
- 08 makes no functional all-gather at all;
- 09 makes exactly tp's own: one per training step and one per evaluation batch;
and a copy of 08 that records its trajectory without --out, as every stage did before, fails the first.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from harness import ROOT, TORCHRUN, check, launch_commands, mutate, time_limit

W, BATCH, EPOCHS = 2, 512, 2  # few steps: 4,096 / (2 x 512) = 4 an epoch in 08, 8 in 09 (dp 1 x tp 2)
GATHER = "_c10d_functional::all_gather_into_tensor"  # DTensor's: tp's joins, and any full_tensor()
RECORD_ALWAYS = ("trajectory = Trajectory(trainer) if args.out is not None else None",
                 "trajectory = Trajectory(trainer)")  # the recorder made whether or not --out asks for it


def counted(script: Path, out: Path, *args: str) -> tuple[dict, str]:
    """Rank 0's collectives, {op: calls}, of one run without --out, and what it printed."""
    out.mkdir(parents=True)
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={W}", str(ROOT / "tests" / "count_collectives.py"),
           str(out), str(script), "--device", "cpu", "--epochs", str(EPOCHS), "--batch-size", str(BATCH), *args]
    run = check(launch_commands([cmd], timeout=time_limit(programs=W)))
    return json.loads((out / "rank0.json").read_text()), run.stdout


def steps_of(stdout: str) -> int:
    return EPOCHS * int(re.search(r"(\d+) steps/epoch", stdout).group(1))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> tuple[dict, str]:
    return counted(ROOT / "08_fsdp" / "train.py", tmp_path_factory.mktemp("fsdp") / "counts")


def test_fsdp_without_out_gathers_only_its_units(fsdp):
    counts, stdout = fsdp
    assert counts.get("c10d::_allgather_base_", 0) > 0, f"FSDP's own gathers were not seen: {counts}"
    assert GATHER not in counts, f"08 gathered parameters whole ({counts[GATHER]} times) without --out"


def test_tensor_parallel_without_out_gathers_only_what_tp_joins(tmp_path):
    counts, stdout = counted(ROOT / "09_tensor_parallel" / "train.py", tmp_path / "counts", "--tp", "2")
    per_step = int(re.search(r"tp: (\d+) allgather", stdout).group(1))
    evaluation = math.ceil(1001 / 256)  # dp 1: every held-out batch through the tp model, one join each
    # The stage counts its first step under a CommDebugMode of its own, which calls each op once more: +1 step.
    assert counts.get(GATHER, 0) == per_step * (steps_of(stdout) + 1) + evaluation, counts


def test_a_stage_that_records_without_out_is_caught(tmp_path, fsdp):
    broken = mutate("08_fsdp", *RECORD_ALWAYS, tmp_path / "copy")
    counts, _ = counted(broken, tmp_path / "counts")
    assert counts.get(GATHER, 0) > 0  # the per-epoch record: every parameter and its momentum gathered whole
    assert counts.get("c10d::_allgather_base_") == fsdp[0]["c10d::_allgather_base_"]  # FSDP's own, unchanged
