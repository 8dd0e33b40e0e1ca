"""Session-wide runs: the tour's, made once and read by every test that asks.

A 2-rank launch costs ~10 s here (torch import, first DDP()), so the suite is built around few runs.
The runs are the top README's tour command (`tour.py --out runs/tour`), run once per session as written,
in a copy of the repository, with GPUs hidden (the suite is gloo/CPU): test_readme_commands checks its
table, and the folders it keeps are `runs[name]`. They follow the tour's plan: W ranks of batch B for the
distributed stages, batch W*B for the single-process ones, so all of them should reach the same weights;
in float64, the tour's default: rounding then stays ~1e-15, far from anything a bug changes.

Most of the suite's CPU time is spent starting processes (importing torch, the first DDP()), often one or two
at a time: alone, most modules keep the 2 cores 50-70 % busy. So the session runs several things at once. In
the background, from the start: the tour, then every other README command (test_readme_commands checks those),
then the notebooks (test_notebooks checks them); beside them, the container image's build, which mostly waits
(tests/containers.py). In the foreground: first the modules that read no runs (BEFORE_THE_TOUR_ENDS, the fault
battery among them: its bounds are measured under the load it meets), then the others (the first test that needs
a run waits for the whole tour), then the at-scale modules (LATE: their simulations have run since the background
ended, in two workers of the lowest priority, harness.Early, in the idle time the rest leaves), and last (LAST) those
that wait for the README commands or the notebooks.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from containers import build_image, engine_env, engine_missing, remove_everything
from harness import Early, Run, Step, check, forkrun_server, load_run, plan
from notebook_runs import PROCESS_VARS, kernel_env, run_all
from readme_blocks import (
    BLOCKS,
    HIDE_GPUS,
    TOURS,
    Block,
    block_showing,
    repo_copy,
    run_block,
    run_docs,
    why_skipped,
)

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


# Run first, while the tour runs in the background: modules that read none of its runs. The fault battery is one:
# its cases mostly wait (a --timeout, a launcher's grace), and its time bounds are made of what each case configured
# plus start-ups timed among the cases, under whatever load there is (test_faults.Pace), so it shares the cores.
BEFORE_THE_TOUR_ENDS = ("test_faults.py", "test_benchmarks.py", "test_collectives.py", "test_sync_sends.py",
                        "test_gathers.py")
# Run last: they wait for the background's notebooks, and for the README commands (so do the tests marked
# readme_run: they run with the README test). The modules in between, mostly one job at a time, run beside those.
LAST = ("test_notebooks.py", "test_readme_commands.py")
# Run just before LAST: their simulations run as EARLY_JOBS (harness.Early) from the background's end, in the idle
# time the foreground leaves; the later they are asked for, the more of it there has been.
LATE = ("test_at_scale.py", "test_at_scale_plan.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sweep", choices=("covering", "full"), default="covering",
                     help="tests/test_settings.py: the covering table (CI) or the full grid (1,143 launches, 2-3 h; "
                          "the GPT rows 398 more, an hour)")
    parser.addoption("--cpu-profile", action="store_true",
                     help="print the CPU-seconds of every test module and of the background (tests/cpu_profile.py)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--cpu-profile"):
        import cpu_profile
        cpu_profile.start(config)
    config.addinivalue_line("markers", "readme_run(*commands): the test reads the runs of these README commands "
                                       "(conftest.readme_run) instead of launching the same again")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def phase(item: pytest.Item) -> int:
        name = "test_readme_commands.py" if item.get_closest_marker("readme_run") else item.path.name
        return 0 if name in BEFORE_THE_TOUR_ENDS else 3 + LAST.index(name) if name in LAST else 2 if name in LATE \
            else 1
    items.sort(key=phase)  # stable: otherwise in collected order


# Test modules whose EARLY_JOBS run before their tests ask (harness.Early; started when the background ends), by
# module name: those of a selected test that asks for their results (the early_results fixture).
EARLY: dict[str, Early] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items if not session.config.option.collectonly else ():
        if "early_results" in item.fixturenames and item.module.__name__ not in EARLY:
            EARLY[item.module.__name__] = Early(item.module)


def pytest_sessionfinish() -> None:
    for early in EARLY.values():
        early.close()


@pytest.fixture(scope="module")
def early_results(request: pytest.FixtureRequest) -> list:
    """The results of this module's EARLY_JOBS, in their order."""
    return EARLY[request.module.__name__].results()


def needs_tour(item: pytest.Item) -> bool:
    """A test that reads runs, or the README test of the tour command itself."""
    callspec = getattr(item, "callspec", None)
    return "tour" in item.fixturenames or (callspec is not None and TOUR in callspec.params.values())


def readme_blocks_to_run(items: list[pytest.Item]) -> list[Block]:
    """The README blocks that selected tests check or read and that run here (the tour apart: it runs once, first)."""
    chosen = [item.callspec.params["block"] for item in items if item.path.name == "test_readme_commands.py"
              and item.originalname == "test_readme_command_runs_as_written"]
    chosen += [block_showing(command) for item in items for mark in item.iter_markers("readme_run")
               for command in mark.args]
    # Blocks run as root change the machine (05's network namespaces): a README's are run all or none, so that
    # its last undoes what its first set up. (A selection that ran 05's first two alone left host0 and host1
    # behind, and the next session's `ip netns add host0` failed: "File exists".)
    chosen += [b for block in chosen if "as root" in block.marker.get("run", "") for b in BLOCKS
               if b.doc == block.doc and "as root" in b.marker.get("run", "")]
    unique = sorted({block.id: block for block in chosen}.values(), key=lambda b: (str(b.doc), b.line))
    return [block for block in unique if not why_skipped(block) and block not in TOURS]


def run_tour(copy: Path) -> Tour:
    return Tour(run_block(TOUR, copy, HIDE_GPUS), copy / TOUR_OUT.group(1))


@dataclass
class Background:
    """What runs beside the tests (None: not needed by the selection): the tour, then the other README commands,
    then the notebooks; beside them the container image's build, in the engine's environment `engine`."""
    tour: Future[Tour] | None
    readmes: Future[dict[str, Run | BaseException]] | None
    image: Future[str] | None = None
    engine: dict[str, str] = field(default_factory=dict)
    notebooks: Future[dict[str, tuple[list[float], float] | str]] | None = None
    jupyter: dict[str, str] = field(default_factory=dict)  # the kernels' variables (notebook_runs.kernel_env)

    def wait(self) -> None:
        """Until all have ended (their failures are reported by the tests that read them)."""
        for future in (self.tour, self.readmes, self.image, self.notebooks):
            if future is not None:
                future.exception()


@pytest.fixture(scope="session", autouse=True)
def forked_launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session's forkrun server (harness.forkrun_server), for every launch that tests/forkrun.py runs."""
    with forkrun_server(tmp_path_factory.mktemp("forkrun")) as unserved:
        yield
        UNSERVED.extend(unserved.read_text().splitlines() if unserved.exists() else [])


# Launches the server did not serve (each: the variables its environment differs in), said at the session's end: a
# test that leaves a variable in the session's environment makes every later launch import torch itself, silently
# (inductor's _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR once did, after an in-process compile: ~100 CPU-s).
UNSERVED: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    if UNSERVED:
        counts = Counter(UNSERVED).most_common()
        launches = f"{len(UNSERVED)} launch{'es' if len(UNSERVED) > 1 else ''}"
        terminalreporter.write_line(f"forkrun: {launches} imported torch themselves (their environment "
                                    f"differs from the server's in: {'; '.join(f'{k} ({n})' for k, n in counts)})")


@pytest.fixture(scope="session", autouse=True)
def background(forked_launches: None, request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    items = request.session.items
    blocks = readme_blocks_to_run(items)
    tour_copy = repo_copy(tmp_path_factory.mktemp("tour")) if any(needs_tour(item) for item in items) else None
    readme_tmp = tmp_path_factory.mktemp("readme") if blocks else None
    build = any(item.path.name == "test_containers.py" for item in items) and engine_missing() is None
    engine = engine_env(tmp_path_factory.mktemp("engine")) if build else {}
    notebooks = [item.callspec.params["name"] for item in items if item.path.name == "test_notebooks.py"
                 and item.originalname == "test_notebook_runs_top_to_bottom"]
    kernels = notebooks or any("jupyter_env" in item.fixturenames for item in items)  # test_notebooks' own kernel
    jupyter = kernel_env(tmp_path_factory.mktemp("jupyter")) if kernels else {}
    if notebooks and tour_copy is None:  # they take the tour's runs of their commands (run_notebooks)
        tour_copy = repo_copy(tmp_path_factory.mktemp("tour"))
    # The tour, the README commands and the notebooks one after the other (each keeps the 2 cores busy alone, or
    # fills what the modules in the foreground, mostly one job at a time, leave idle); the build beside.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="background") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-build") as builder, \
            pytest.MonkeyPatch.context() as mp:
        for var in PROCESS_VARS if kernels else ():  # before any kernel starts; the launches ignore them
            mp.setenv(var, jupyter[var])
        tour = pool.submit(run_tour, tour_copy) if tour_copy else None
        readmes = pool.submit(run_docs, blocks, readme_tmp, tour_copy is not None) if blocks else None
        ran = pool.submit(run_notebooks, notebooks, jupyter, tour) if notebooks else None
        # The EARLY_JOBS as the background ends (the tour, the README commands, the notebooks run in turn): from
        # then on the foreground alone leaves a core idle a third of the time (2026-11-30's CI, sampled)
        last = ran or readmes or tour
        for early in EARLY.values():
            if last is None:
                early.start()
            else:
                last.add_done_callback(lambda _, early=early: early.start())
        try:
            yield Background(tour=tour, readmes=readmes,
                             image=builder.submit(build_image, engine, tmp_path_factory.mktemp("image"))
                             if build else None, engine=engine, notebooks=ran, jupyter=jupyter)
        finally:
            if build:  # after the build has ended, whatever happened to it or to the test
                builder.shutdown(wait=True)
                remove_everything(engine)


def run_notebooks(names: list[str], env: dict[str, str], tour: Future[Tour] | None) -> dict:
    """notebook_runs.run_all. The notebooks run each stage as the tour does, so a run of the very same command is
    taken from the session's tour (NOTEBOOK_REUSE, nbtools.run), not launched again: ~10 launches. The tour ran
    with the GPUs hidden, so only where none is visible to the kernels either."""
    import torch
    if tour is not None and not torch.cuda.is_available():
        env = {**env, "NOTEBOOK_REUSE": str(tour.result().out)}
    return run_all(names, env)


@pytest.fixture(scope="session")
def tour(background: Background, tmp_path_factory: pytest.TempPathFactory) -> Tour:
    if background.tour is None:  # asked for by a test that does not say so in its signature: run it now
        return run_tour(repo_copy(tmp_path_factory.mktemp("tour")))
    return background.tour.result()


@pytest.fixture(scope="session")
def readme_runs(background: Background) -> dict[str, Run | BaseException]:
    """Each README block's run, by block id: test_readme_commands checks them."""
    assert background.readmes is not None, "no README block was selected to run at the start of the session"
    return background.readmes.result()


def readme_run(readme_runs: dict[str, Run | BaseException], command: str) -> Run:
    """The run of a README command, from the run of the block that shows it: its `out` is the command's --out in
    the copy the block ran in (its stdout, the whole block's). A test that reads it instead of launching the same
    command again carries the marker readme_run(command): the block then runs in the background, and the test
    after the README commands."""
    block = block_showing(command)
    assert block.id in readme_runs, f"{block.id} did not run: mark the test with pytest.mark.readme_run({command!r})"
    run = readme_runs[block.id]
    if isinstance(run, BaseException):
        raise run
    out = re.search(r"--out (\S+)", command)
    return replace(check(run), out=run.out / out.group(1) if out else run.out)


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
