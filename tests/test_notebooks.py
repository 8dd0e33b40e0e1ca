"""The teaching notebooks: one per stage, each .ipynb in step with its .py twin, each running top to bottom.

Pairs are compared with jupytext's own comparison (cells, sources, metadata), not by file times.
Notebooks run on a real Jupyter kernel (nbclient + ipykernel, the `python3` kernelspec of this
interpreter) with their working directory in notebooks/, where Jupyter and VS Code start them, so
their paths work the same for a reader. Jupyter's, IPython's and matplotlib's own files go to
temporary directories, and the notebooks' runs too ($NOTEBOOK_RUNS): nothing is written to HOME or
to the repository. A failing notebook fails its test naming the cell, its source and the error.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import jupytext
import nbformat
import pytest
from jupytext.compare import NotebookDifference, compare_notebooks

from harness import STAGES
from notebook_runs import NB_DIR, NotebookFailed, execute

NOTEBOOKS = sorted(p.stem for p in NB_DIR.glob("*.ipynb"))
HELPERS = {"nbtools.py"}  # plain modules the notebooks import: no .ipynb twin
TEXT_FORMAT = "py:percent"


def check_pair(ipynb: Path, text: Path) -> None:
    """Raise NotebookDifference unless the .ipynb and its percent .py hold the same notebook."""
    compare_notebooks(jupytext.read(text, fmt=TEXT_FORMAT), jupytext.read(ipynb), fmt=TEXT_FORMAT)


@pytest.fixture(scope="session")
def jupyter_env(background) -> dict[str, str]:
    """Kernel variables; the same set in this process, where jupyter_client writes the connection files (for the
    whole session: conftest.background)."""
    assert background.jupyter, "conftest.background set no kernel variables: no test asking for them was selected?"
    return background.jupyter


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
def executions(background) -> dict[str, tuple[list[float], float] | str]:
    """Every selected notebook's run (notebook_runs.run_all), made in the background once the README commands had
    ended (conftest.background): the modules before this one mostly start one job at a time, and the kernels fill
    the cores they leave idle."""
    assert background.notebooks is not None, "conftest.background started no notebook: none was selected?"
    return background.notebooks.result()


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
