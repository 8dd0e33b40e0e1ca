"""A bad value gets one line on stderr naming the flag, exit 2, no traceback, no hang."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from harness import STAGES, Step, launch

COMMON = {  # args -> the flag the message must name
    ("--batch-size", "0"): "--batch-size",
    ("--epochs", "-1"): "--epochs",
    ("--lr", "nan"): "--lr",
    ("--device", "tpu"): "--device",
    ("--seed", "x"): "--seed",
}
DISTRIBUTED = {("--timeout", "0"): "--timeout"}
SPAWN = {("--world-size", "0"): "--world-size"}
NO_GPU = {("--device", "cuda"): "--device"}


def cases() -> list[tuple[str, tuple[str, ...], str]]:
    out = []
    for stage in STAGES:
        table = dict(COMMON)
        if stage >= "03":
            table |= DISTRIBUTED
        if stage == "03_ddp_spawn":
            table |= SPAWN
        if not torch.cuda.is_available():
            table |= NO_GPU
        out += [(stage, args, flag) for args, flag in table.items()]
        out.append((stage, ("--out", "<file>/sub"), "--out"))
    return out


CASES = cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every case once, two at a time (each is a torch import, ~3 s)."""
    blocker = tmp_path_factory.mktemp("bad") / "a_file"
    blocker.write_text("not a directory")

    def one(case):
        stage, args, _ = case
        args = [a.replace("<file>", str(blocker)) for a in args]
        return launch(Step(stage, "python", tuple(args)), timeout=60)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(one, CASES), strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"{s[:2]}{' '.join(a)}" for s, a, _ in CASES])
def test_bad_value_is_one_clear_line_and_exit_2(results, case):
    stage, _, flag = case
    run = results[case]
    assert run.returncode == 2, run.describe()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in run.stderr, run.describe()
    assert lines[0].startswith(f"{stage}/train.py: error: ")
    assert not run.survivors


def test_bad_value_under_torchrun_fails_fast_with_the_line():
    run = launch(Step("04_ddp_torchrun", "torchrun", ("--batch-size", "0"), nproc=2), timeout=60)
    assert run.returncode != 0 and not run.survivors, run.describe()
    assert "argument --batch-size: must be a positive int, got 0" in run.stderr
