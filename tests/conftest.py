"""Session-wide runs: the tour's, made once and read by every test that asks.

A 2-rank launch costs ~10 s here (torch import, first DDP()), so the suite is built around few runs.
The runs are the top README's tour command (`tour.py --out runs/tour`), run once per session as written,
in a copy of the repository, with GPUs hidden (the suite is gloo/CPU): test_readme_commands checks its
table, and the folders it keeps are `runs[name]`. They follow the tour's plan: W ranks of batch B for the
distributed stages, batch W*B for the single-process ones, so all of them should reach the same weights;
in float64, the tour's default: rounding then stays ~1e-15, far from anything a bug changes.

The tour starts in the background as the session starts (if a selected test needs it), and the modules that
need no runs (BESIDE_THE_TOUR) go first, meanwhile; the first test that needs one waits for the whole tour.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import Run, Step, check, load_run, plan
from readme_blocks import TOURS, repo_copy, run_block

W, B, DTYPE = 2, 32, "float64"
# The tour's plan here, with --device cpu: the runs the tests launch themselves (a changed copy, more flags).
STEPS = plan(W, B, device="cpu", dtype=DTYPE, gpus=0)
# Names the tests use: the stage's number, plus "_python" for stage 04 run without torchrun.
CONFIGS = {(s.stage[:2] + ("_python" if s.stage.startswith("04") and s.launcher == "python" else "")): s
           for s in STEPS}

assert len(TOURS) == 1, f"README.md should show the tour command once, with --out: {[b.id for b in TOURS]}"
TOUR = TOURS[0]
TOUR_OUT = re.search(r"--out (\S+)", TOUR.body)
assert TOUR_OUT, f"{TOUR.id}: the tour command keeps its runs (--out DIR): the tests read them"
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # the suite is gloo/CPU, on any machine


@dataclass
class Tour:
    run: Run  # the README's command
    out: Path  # its --out: one folder per row of the table

    def row(self, step: Step) -> Run:
        """The run of `step`'s stage and launcher, as the tour recorded it."""
        for folder in sorted(self.out.glob("*/run.json")):
            record, run = load_run(folder.parent)
            if (record["stage"], record["launcher"]) == (step.stage, step.launcher):
                return run
        pytest.fail(f"the tour recorded no run of {step.stage} via {step.launcher} in {self.out}\n"
                    f"{self.run.describe()}")


# Run first, while the tour runs in the background: modules that read none of its runs until their very end
# and time nothing (the container image takes ~2 minutes to build; it and the tour share the cores).
BESIDE_THE_TOUR = ("test_benchmarks.py", "test_collectives.py", "test_containers.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in BESIDE_THE_TOUR)  # stable: otherwise in collected order


def needs_tour(item: pytest.Item) -> bool:
    """A test that reads runs, or the README test of the tour command itself."""
    callspec = getattr(item, "callspec", None)
    return "tour" in item.fixturenames or (callspec is not None and TOUR in callspec.params.values())


def run_tour(copy: Path) -> Tour:
    return Tour(run_block(TOUR, copy, HIDE_GPUS), copy / TOUR_OUT.group(1))


@pytest.fixture(scope="session", autouse=True)
def tour_started(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[Tour] | None]:
    """The tour, started as the session starts if a selected test needs it."""
    if not any(needs_tour(item) for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(run_tour, repo_copy(tmp_path_factory.mktemp("tour")))


@pytest.fixture(scope="session")
def tour(tour_started: Future[Tour] | None, tmp_path_factory: pytest.TempPathFactory) -> Tour:
    if tour_started is None:  # asked for by a test that does not say so in its signature: run it now
        return run_tour(repo_copy(tmp_path_factory.mktemp("tour")))
    return tour_started.result()


class Runs:
    def __init__(self, tour: Tour) -> None:
        self._tour = tour
        self._done: dict[str, Run] = {}

    def __getitem__(self, name: str) -> Run:
        if name not in self._done:
            self._done[name] = check(self._tour.row(CONFIGS[name]))
        return self._done[name]


@pytest.fixture(scope="session")
def runs(tour: Tour) -> Runs:
    return Runs(tour)
