"""Test helpers on top of tour.py's launcher: the tests run stages exactly as the tour and a reader do.

Every launch runs in its own process group with a time limit (the job is killed and the test
fails instead of hanging), never on a fixed port (stage 03 picks a free one; torchrun runs
--standalone, which binds port 0), and reports processes that outlived the launcher.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tour import (  # noqa: E402
    ROOT,
    TORCHRUN,
    Run,
    Step,
    free_port,
    max_abs_diff,
    plan,
    run_command,
    run_job,
    run_slurm_command,
    slurm_missing,
)

STAGES = sorted(p.parent.name for p in ROOT.glob("[0-9][0-9]_*/train.py"))
__all__ = ["ROOT", "STAGES", "TORCHRUN", "Run", "Step", "check", "free_port", "launch", "launch_commands",
           "load_stage", "max_abs_diff", "mutate", "plan", "run_command", "run_job", "run_slurm_command",
           "slurm_missing"]


def launch(step: Step, out: Path | None = None, script: Path | None = None, timeout: float = 120.0,
           env: dict[str, str] | None = None) -> Run:
    """Run `step` (or a modified copy of its script); fail the test if it outlives `timeout`."""
    return launch_commands(step.commands(out, script), out, {**step.env, **(env or {})}, timeout)


def launch_commands(cmds: list[list[str]], out: Path | None = None, env: dict[str, str] | None = None,
                    timeout: float = 120.0) -> Run:
    """Run one command per node; fail the test if the job outlives `timeout` (it is killed, workers too)."""
    run = run_job(cmds, out, env, timeout)
    if run.returncode is None:
        pytest.fail(f"timed out after {timeout:.0f}s (job killed)\n{run.describe()}")
    return run


def check(run: Run) -> Run:
    """Fail with the job's output unless it exited 0 and left no process behind."""
    assert run.returncode == 0 and not run.survivors, run.describe()
    return run


def mutate(stage: str, old: str, new: str, dest: Path) -> Path:
    """Copy a stage's script with one edit (the stages are self-contained, so the copy runs anywhere)."""
    text = (ROOT / stage / "train.py").read_text()
    assert text.count(old) == 1, f"{stage}: expected exactly one {old!r} to replace"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "train.py"
    path.write_text(text.replace(old, new))
    return path


@functools.cache
def load_stage(stage: str) -> ModuleType:
    """Import a stage's train.py as a module (its work is in functions, so importing runs nothing)."""
    spec = importlib.util.spec_from_file_location(f"stage_{stage}", ROOT / stage / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect.getsource() finds classes through sys.modules
    spec.loader.exec_module(module)
    return module
