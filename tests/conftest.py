"""Session-wide runs: each configuration is launched once, on first use, and serves every test that asks.

A 2-rank launch costs ~10 s here (torch import, first DDP()), so the suite is built around few runs.
The configurations are the tour's plan on gloo/CPU: W ranks of batch B for the distributed stages,
batch W*B for the single-process ones, so all of them should reach the same weights. They run in
float64, as the tour does by default: rounding then stays ~1e-15, far from anything a bug changes.
"""
from __future__ import annotations

import pytest

from harness import Run, check, launch, plan

W, B, DTYPE = 2, 32, "float64"
STEPS = plan(W, B, device="cpu", dtype=DTYPE, gpus=0)
# Names the tests use: the stage's number, plus "_python" for stage 04 run without torchrun.
CONFIGS = {(s.stage[:2] + ("_python" if s.stage.startswith("04") and s.launcher == "python" else "")): s
           for s in STEPS}


class Runs:
    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._done: dict[str, Run] = {}

    def __getitem__(self, name: str) -> Run:
        if name not in self._done:
            self._done[name] = check(launch(CONFIGS[name], out=self._tmp.mktemp(f"run_{name}")))
        return self._done[name]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)
