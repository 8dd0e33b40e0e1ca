"""Session-wide runs: each configuration is launched once, on first use, and serves every test that asks.

A 2-rank launch costs ~10 s here (torch import, first DDP()), so the suite is built around few runs.
The configurations are the tour's plan on gloo/CPU: W ranks of batch B for the distributed stages,
batch W*B for the single-process ones, so all of them should reach the same weights. They run in
float64, as the tour does by default: rounding then stays ~1e-15, far from anything a bug changes.

The suite runs in two pytest-xdist workers (pyproject.toml: `-n 2 --dist loadfile`): much of a
launch leaves a core idle (one process importing torch, stage 01's replay in the test process,
waiting for a timeout), and the other worker fills it. A run is made once for both: the first
worker to ask launches it under a file lock, and the other reads what it recorded. Modules go to
the workers longest first (LONGEST), so that neither is left with a long one at the end.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
from pathlib import Path

import pytest

from harness import Run, check, launch, plan

W, B, DTYPE = 2, 32, "float64"
STEPS = plan(W, B, device="cpu", dtype=DTYPE, gpus=0)
# Names the tests use: the stage's number, plus "_python" for stage 04 run without torchrun.
CONFIGS = {(s.stage[:2] + ("_python" if s.stage.startswith("04") and s.launcher == "python" else "")): s
           for s in STEPS}
# Test modules by the time they take here, longest first (a few minutes to half a minute; the rest are shorter).
LONGEST = ["test_readme_commands", "test_notebooks", "test_faults", "test_equivalence", "test_tensor_parallel",
           "test_fsdp", "test_checkpoint", "test_benchmarks"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (a stable sort: within a module, the order stays the file's)."""
    def rank(item: pytest.Item) -> int:
        name = item.module.__name__.rpartition(".")[2] if item.module else ""
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)
    items.sort(key=rank)


class Runs:
    def __init__(self, root: Path) -> None:
        self._root = root  # shared by the workers of one session
        self._done: dict[str, Run] = {}

    def __getitem__(self, name: str) -> Run:
        if name not in self._done:
            out, record = self._root / f"run_{name}", self._root / f"run_{name}.json"
            with open(self._root / f"run_{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker may be launching it: wait for it
                if record.exists():
                    fields = json.loads(record.read_text())
                    self._done[name] = Run(**{**fields, "out": Path(fields["out"])})
                else:
                    out.mkdir()
                    run = check(launch(CONFIGS[name], out=out))
                    record.write_text(json.dumps({**dataclasses.asdict(run), "out": str(run.out)}))
                    self._done[name] = run
        return self._done[name]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    # Under xdist each worker's base directory is <session's>/popen-gwN: the parent is the session's own.
    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / "session_runs"
    root.mkdir(exist_ok=True)
    return Runs(root)
