"""The teaching notebooks: one per stage, each .ipynb in step with its .py twin, each running top to bottom.

Pairs are compared with jupytext's own comparison (cells, sources, metadata), not by file times.
Notebooks run on a real Jupyter kernel (nbclient + ipykernel, the `python3` kernelspec of this
interpreter) with their working directory in notebooks/, where Jupyter and VS Code start them, so
their paths work the same for a reader. Jupyter's, IPython's and matplotlib's own files go to
temporary directories, and the notebooks' runs too ($NOTEBOOK_RUNS): nothing is written to HOME or
to the repository. A failing notebook fails its test naming the cell, its source and the error.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupytext.compare import NotebookDifference, compare_notebooks
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from harness import ROOT, STAGES, selected

NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(p.stem for p in NB_DIR.glob("*.ipynb"))
HELPERS = {"nbtools.py"}  # plain modules the notebooks import: no .ipynb twin
# s: a last resort. Every run a notebook starts has its own limit (nbtools.run: 120 s), which kills the
# whole job; a cell makes at most 4 runs, so those limits come first and leave no orphaned workers.
CELL_TIMEOUT = 600
TEXT_FORMAT = "py:percent"


# Run on each kernel before the notebook's cells: the notebook's launches through harness.served, as the other tests'
# (forked from the session's one import of torch: a torchrun job ~8 CPU-s less). A reader's kernel runs torchrun.
FORKED_LAUNCHES = f"""\
import sys as _sys
_sys.path.insert(0, {str(ROOT / "tests")!r})
import harness as _harness, nbtools as _nbtools
_sys.path.remove({str(ROOT / "tests")!r})  # the repository's root stays, where harness and nbtools put it
_harness.fork_launches(_nbtools)
del _sys, _harness, _nbtools
"""


class NotebookFailed(AssertionError):
    pass


def check_pair(ipynb: Path, text: Path) -> None:
    """Raise NotebookDifference unless the .ipynb and its percent .py hold the same notebook."""
    compare_notebooks(jupytext.read(text, fmt=TEXT_FORMAT), jupytext.read(ipynb), fmt=TEXT_FORMAT)


def kernel_env(tmp: Path) -> dict[str, str]:
    """Variables for a kernel (and for jupyter_client, which writes the connection file) that keep HOME clean."""
    dirs = {var: tmp / name for var, name in [("JUPYTER_CONFIG_DIR", "jupyter_config"),
                                              ("JUPYTER_DATA_DIR", "jupyter_data"),
                                              ("JUPYTER_RUNTIME_DIR", "jupyter_runtime"),
                                              ("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "matplotlib"),
                                              ("NOTEBOOK_RUNS", "runs")]}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {**{k: str(v) for k, v in dirs.items()}, "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"}


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # tracebacks come coloured


def _line_in_twin(twin: Path, source: str) -> int | None:
    """Where a code cell starts in the percent .py twin (its `# %%` marker is followed by the source)."""
    text = twin.read_text() if twin.exists() else ""
    at = text.find(f"# %%\n{source}") if source.strip() else -1
    return text.count("\n", 0, at) + 2 if at >= 0 else None


def execute(path: Path, env: dict[str, str], cwd: Path | None = None, setup: str = "") -> list[float]:
    """Run every cell of the notebook at `path` on a fresh kernel (after `setup`, if any); return each cell's seconds.

    On the first failing cell raise NotebookFailed naming the cell (its index among all cells, and
    its line in the .py twin if there is one), its source and the error.
    """
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd or path.parent)}})
    twin = path.with_suffix(".py")
    seconds = []
    with client.setup_kernel(env={**os.environ, **env}):
        if setup:
            try:
                client.execute_cell(nbformat.v4.new_code_cell(setup), 0)
            except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
                raise NotebookFailed(f"{path.name}: the set-up before its cells failed:\n{_plain(str(e))}") from None
        for index, cell in enumerate(nb.cells):
            start = time.monotonic()
            try:
                client.execute_cell(cell, index)
            except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
                line = _line_in_twin(twin, cell.source)
                where = f" ({twin.name} line {line})" if line else ""
                # nbclient's message repeats the source, then the cell's printed output and the traceback
                detail = _plain(str(e)).split(f"------------------\n{cell.source}\n------------------\n", 1)[-1]
                raise NotebookFailed(
                    f"{path.name}: cell {index}{where} failed after {time.monotonic() - start:.1f}s "
                    f"({type(e).__name__}):\n--- cell {index} ---\n{cell.source}\n--- its output and error ---\n"
                    f"{detail.strip()[-6000:]}") from None
            seconds.append(time.monotonic() - start)
    return seconds


@pytest.fixture(scope="session")
def jupyter_env(tmp_path_factory: pytest.TempPathFactory):
    """Kernel variables; the same set in this process, where jupyter_client writes the connection files."""
    env = kernel_env(tmp_path_factory.mktemp("jupyter"))
    with pytest.MonkeyPatch.context() as mp:
        for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
            mp.setenv(var, env[var])
        yield env


def test_a_notebook_for_every_stage():
    """One per stage, named like its folder; a notebook may also walk through something else (ddp_by_hand)."""
    assert set(STAGES) <= set(NOTEBOOKS), f"no notebook for {sorted(set(STAGES) - set(NOTEBOOKS))}"


def test_every_notebook_has_its_twin():
    """Each .ipynb has a .py and each .py (but the helpers) an .ipynb: a half-added pair is caught here."""
    ipynbs = {p.stem for p in NB_DIR.glob("*.ipynb")}
    texts = {p.stem for p in NB_DIR.glob("*.py") if p.name not in HELPERS}
    assert ipynbs == texts, f"without a .py: {sorted(ipynbs - texts)}; without an .ipynb: {sorted(texts - ipynbs)}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_pair_in_sync(name):
    try:
        check_pair(NB_DIR / f"{name}.ipynb", NB_DIR / f"{name}.py")
        return
    except NotebookDifference as e:
        difference = str(e)
    pytest.fail(f"notebooks/{name}.ipynb and notebooks/{name}.py differ. After editing one, run "
                f"`jupytext --sync notebooks/{name}.py`: it takes the cells from the newer file.\n"
                f"(below, - is the .ipynb and + the .py)\n{difference}", pytrace=False)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_no_outputs(name):
    """Outputs are stripped (see notebooks/README.md): the CI run makes them, timings and all, every time."""
    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, (f"notebooks/{name}.ipynb carries outputs in cells {dirty}: clear them with "
                       f"`python notebooks/nbtools.py strip notebooks/{name}.ipynb` (see notebooks/README.md)")


def test_pair_check_catches_an_edit_on_either_side(tmp_path):
    """The checker itself: a .py edited without its .ipynb fails, and so does the reverse."""
    name = NOTEBOOKS[0]
    for side in ("py", "ipynb"):
        copy = tmp_path / side
        copy.mkdir()
        for suffix in ("py", "ipynb"):
            shutil.copy(NB_DIR / f"{name}.{suffix}", copy / f"{name}.{suffix}")
        check_pair(copy / f"{name}.ipynb", copy / f"{name}.py")  # the copies agree...
        if side == "py":
            path = copy / f"{name}.py"
            path.write_text(path.read_text() + "\n# %%\nprint('added to the .py only')\n")
        else:
            nb = nbformat.read(copy / f"{name}.ipynb", as_version=4)
            code = next(c for c in nb.cells if c.cell_type == "code")
            code.source += "\nprint('added to the .ipynb only')"
            nbformat.write(nb, copy / f"{name}.ipynb")
        with pytest.raises(NotebookDifference):  # ...until one side is edited alone
            check_pair(copy / f"{name}.ipynb", copy / f"{name}.py")


def test_a_failing_cell_is_named(tmp_path, jupyter_env):
    """The executor itself: a broken notebook fails with the cell's index, its source and the error."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# broken on purpose"),
                                         nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("y = x + 1\nraise ValueError(f'boom {y}')"),
                                         nbformat.v4.new_code_cell("print('never reached')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    jupytext.write(nb, path.with_suffix(".py"), fmt=TEXT_FORMAT)  # a twin, to be pointed into
    with pytest.raises(NotebookFailed) as failure:
        execute(path, jupyter_env)
    message = str(failure.value)
    line = next(n for n, text in enumerate(path.with_suffix(".py").read_text().splitlines(), 1) if text == "y = x + 1")
    assert f"broken.ipynb: cell 2 (broken.py line {line})" in message, message
    assert "raise ValueError(f'boom {y}')" in message, message
    assert "ValueError: boom 2" in message and "never reached" not in message, message


@pytest.fixture(scope="module")
def executions(request, jupyter_env, tour) -> dict[str, tuple[list[float], float] | str]:
    """Every selected notebook run on a fresh kernel, two at a time: {name: (seconds per cell, total) or the failure}.

    Two at a time because one leaves a core idle much of the time (its kernel waits for the script it started,
    often a single process). They share one runs directory, as runs/notebooks/ is shared when a reader runs
    them: 01 makes stage 01's reference run and the others reuse it (nbtools.reference waits while it is made).
    The notebooks run each stage as the tour does, so a run of the very same command is taken from the suite's
    tour (NOTEBOOK_REUSE, nbtools.run), not launched again: ~10 launches. The tour ran with the GPUs hidden, so
    only where none is visible to the kernels either. The rest run forked (FORKED_LAUNCHES): test_notebooks.py
    took 331 CPU-s before, 215 after, alone on 2 AMD EPYC cores (`pytest --cpu-profile`, 2026-11-27).
    """
    chosen = selected(request, "test_notebook_runs_top_to_bottom", "name")
    import torch
    if not torch.cuda.is_available():
        jupyter_env = {**jupyter_env, "NOTEBOOK_REUSE": str(tour.out)}

    def one(name: str) -> tuple[list[float], float] | str:
        start = time.monotonic()
        try:
            cells = execute(NB_DIR / f"{name}.ipynb", jupyter_env, setup=FORKED_LAUNCHES)
        except NotebookFailed as e:
            return str(e)
        return cells, time.monotonic() - start

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(chosen, pool.map(one, chosen), strict=True))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, executions):
    """Headless, on a real kernel, in notebooks/ as a reader would; the runs go to a temporary directory."""
    outcome = executions[name]
    if isinstance(outcome, str):
        pytest.fail(outcome, pytrace=False)  # the cell, its source, its output and error: no test traceback
    cells, total = outcome
    slowest = max(range(len(cells)), key=cells.__getitem__)
    # Printed, not bounded: a notebook's wall time is the machine's and its load's (ddp_by_hand's took 127 s in a
    # suite run beside other work, against a flat 120 s bound); a hang is still ended by every run's own limit
    # (nbtools.run) and by CELL_TIMEOUT.
    print(f"{name}: {total:.1f}s (slowest: cell {slowest}, {cells[slowest]:.1f}s)")
