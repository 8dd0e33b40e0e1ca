"""The notebooks on real Jupyter kernels: how one runs (execute), and all those selected, two at a time (run_all).

conftest starts run_all in the background once the README commands have ended (conftest.background):
tests/test_notebooks.py checks what it found. Jupyter's, IPython's and matplotlib's own files go to temporary
directories (kernel_env), and the notebooks' runs too ($NOTEBOOK_RUNS): nothing is written to HOME or to the
repository. A failing notebook fails its test naming the cell, its source and the error.
"""
from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from harness import ROOT

NB_DIR = ROOT / "notebooks"

# s: a last resort. Every run a notebook starts has its own limit (nbtools.run: 120 s), which kills the
# whole job; a cell makes at most 4 runs, so those limits come first and leave no orphaned workers.
CELL_TIMEOUT = 600

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


# Read by jupyter_client in this process (where it writes a kernel's connection file) as well as by the kernels: set
# for the whole session once notebooks are selected (conftest.background), before any kernel starts.
PROCESS_VARS = ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR")


def run_all(names: list[str], env: dict[str, str]) -> dict[str, tuple[list[float], float] | str]:
    """Each notebook run on a fresh kernel, two at a time: {name: (seconds per cell, total) or the failure}.

    Two at a time because one leaves a core idle much of the time (its kernel waits for the script it started,
    often a single process). They share one runs directory, as runs/notebooks/ is shared when a reader runs
    them: 01 makes stage 01's reference run and the others reuse it (nbtools.reference waits while it is made).
    """
    def one(name: str) -> tuple[list[float], float] | str:
        start = time.monotonic()
        try:
            cells = execute(NB_DIR / f"{name}.ipynb", env, setup=FORKED_LAUNCHES)
        except NotebookFailed as e:
            return str(e)
        return cells, time.monotonic() - start

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))
