"""What the notebooks share: run a stage as a reader would, show a diff, compare runs, plot them.

A plain module, not a notebook (it has no .ipynb twin). The notebooks import it from their own
folder, which is where Jupyter and VS Code start their kernels. The launching itself is tour.py's:
`plan()` gives the same configurations as the tour and the tests, and `run_job()` runs a command
(or one per node) under a deadline, kills the whole job if it is exceeded (workers included), and
reports any process that outlived the launcher.

Runs go to runs/notebooks/ in the repository (ignored by git), or to $NOTEBOOK_RUNS if it is set
(the tests point it at a temporary directory, one for all the notebooks, so they share stage 01's
reference run: `reference()`). The stages run as the tour runs them (`plan()`, the tour's 5
epochs): where $NOTEBOOK_REUSE names the folder of a `tour.py --out` (the tests set it), a run of
the very same command is taken from there instead of being launched again, and the notebook says so.
"""
from __future__ import annotations

import ast
import difflib
import fcntl
import json
import os
import shlex
import shutil
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tour import (  # noqa: E402  (after the path is set)
    EPOCHS,
    TORCHRUN,
    Run,
    Step,
    load_stage,
    max_abs_diff,
    plan,
    replay_error,
    run_job,
    tolerance,
)

RUNS = Path(os.environ.get("NOTEBOOK_RUNS") or ROOT / "runs" / "notebooks")
REUSE = os.environ.get("NOTEBOOK_REUSE")  # a `tour.py --out` folder whose runs stand for the same commands here
# 2 processes of batch 32 = global batch 64, the tour's EPOCHS (5; the stages train 20 by default)
WORLD, BATCH, DTYPE = 2, 32, "float64"
ATOL = tolerance(DTYPE)  # the tour's: sqrt(eps) of float64 (README.md: "Same weights, up to rounding")
__all__ = ["ATOL", "BATCH", "DTYPE", "EPOCHS", "ROOT", "RUNS", "TORCHRUN", "WORLD", "Run", "Setup", "Step", "compare",
           "held_out_by_01", "load_stage", "max_abs_diff", "plot_runs", "reference", "replay_error", "run", "setup",
           "show", "show_diff", "show_outline", "shown", "tolerance", "with_args"]


def _in_kernel() -> bool:
    """True in Jupyter (or IPython); False when a notebook's .py runs as a plain script."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _markdown(text: str) -> None:
    if _in_kernel():
        from IPython.display import Markdown, display
        display(Markdown(text))
    else:
        print(text)


def show(fig) -> None:
    """Show a figure once, then close it (in Jupyter; as a plain script the pictures are skipped)."""
    import matplotlib.pyplot as plt

    if _in_kernel():
        from IPython.display import display
        display(fig)
    plt.close(fig)


@dataclass(frozen=True)
class Setup:
    gpus: int
    device: str  # what every stage is given: "auto" (the GPUs) with 2 or more GPUs, else "cpu"
    steps: tuple[Step, ...]

    def step(self, stage: str, launcher: str | None = None) -> Step:
        """The tour's configuration of `stage` (stage 04 has two: launcher "torchrun" or "python")."""
        for s in self.steps:
            if s.stage == stage and launcher in (None, s.launcher):
                return s
        raise KeyError(f"no {stage} {launcher or ''} in the plan")


def setup() -> Setup:
    """GPUs where present (two or more, so that every stage can use them), else the CPU with gloo."""
    import torch  # ~2 s: the scripts' own launches pay the same in every process

    gpus = torch.cuda.device_count()
    device = "cpu" if gpus == 1 else "auto"  # auto: the GPUs, or the CPU where there are none (the tour's flag)
    where = f"{gpus} GPUs: nccl" if gpus >= 2 else "the CPU: gloo" + (" (1 GPU is not enough to split)" if gpus else "")
    print(f"torch {torch.__version__} | {where} | world size {WORLD}, batch {BATCH} per process "
          f"= {WORLD * BATCH} global | {EPOCHS} epochs | {DTYPE} | runs in {RUNS}")
    return Setup(gpus, device, tuple(plan(WORLD, BATCH, EPOCHS, device, DTYPE, gpus if gpus >= 2 else 0)))


def with_args(step: Step, **flags: str | int | bool) -> Step:
    """`step` with some flags replaced or added: with_args(step, batch_size=32, epochs=4, no_join=True).

    True adds a flag that takes no value."""
    args = list(step.args)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args += [] if flag in args else [flag]
        elif flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    return replace(step, args=tuple(args))


def shown(cmd: list[str]) -> str:
    """A command as you would type it at the repository's root."""
    torchrun = list(TORCHRUN)
    words = ["torchrun", *cmd[len(torchrun):]] if cmd[:len(torchrun)] == torchrun else list(cmd)
    words = ["python" if w == sys.executable else w for w in words]
    return shlex.join(w.removeprefix(f"{ROOT}/") for w in words)


def _kept_by_the_tour(step: Step) -> Path | None:
    """The folder of a run of this very step that `tour.py --out $NOTEBOOK_REUSE` kept, if any."""
    for record in sorted(Path(REUSE).glob("*/run.json")) if REUSE else []:
        r = json.loads(record.read_text())
        if r.get("step") == step.spec() and r["returncode"] == 0 and not r["survivors"]:
            return record.parent
    return None


def run(what: Step | list[list[str]], name: str, timeout: float = 120.0, env: dict[str, str] | None = None,
        fresh: bool = True, quiet: bool = False, reuse: bool = True) -> Run:
    """Run a step (or one command per node) with its output in RUNS/name; raise if it fails or overruns.

    `fresh` empties RUNS/name first, so a summary is never left over from an earlier run. `reuse`: a step
    the tour ran as it is, in $NOTEBOOK_REUSE, is taken from there (its files copied to RUNS/name).
    """
    out = RUNS / name
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(what, Step):
        cmds, env = what.commands(out=out), {**what.env, **(env or {})}
    else:
        cmds = what
    for i, cmd in enumerate(cmds):
        prefix = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        node = f"    # node {i}, in terminal {i + 1}" if len(cmds) > 1 else ""
        print(f"$ {prefix + ' ' if prefix else ''}{shown(cmd)}{node}")
    kept = _kept_by_the_tour(what) if reuse and isinstance(what, Step) else None
    if kept is not None:
        shutil.copytree(kept, out, dirs_exist_ok=True)
        record = json.loads((kept / "run.json").read_text())
        print(f"(the tour ran this same command: its run in {kept} is reused)")
        result = Run(cmds[0], 0, record["stdout"], record["stderr"], record["seconds"], out)
    else:
        result = run_job(cmds, out, env, timeout=timeout)
    if result.returncode != 0 or result.survivors:
        why = ("it was killed at its time limit" if result.returncode is None else
               f"processes outlived it: {result.survivors}" if result.returncode == 0 else "it failed")
        raise RuntimeError(f"{name}: {why}\n{result.describe()}")
    if not quiet:
        print(result.stdout.rstrip())
    print(f"(exit 0 after {result.seconds:.1f} s)\n")
    return result


def reference(cfg: Setup, quiet: bool = True) -> Run:
    """Stage 01 at the notebooks' settings, which every notebook compares with: run once per RUNS directory.

    The command and what it printed are recorded beside the run's output; a later notebook giving the same
    command reuses the run (and says so) instead of starting it again. Delete RUNS/01_reference to run it afresh.
    """
    step, out = cfg.step("01_single_gpu"), RUNS / "01_reference"
    cmds, record = step.commands(out=out), out / "command.json"
    RUNS.mkdir(parents=True, exist_ok=True)
    with open(RUNS / "01_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another notebook may be making it right now: wait for it
        earlier = json.loads(record.read_text()) if record.exists() and (out / "summary.json").exists() else {}
        if earlier.get("cmds") == cmds:
            print(f"$ {shown(cmds[0])}\n(the same command ran in {out} already, in {earlier['seconds']:.1f} s: "
                  f"reused)")
            if not quiet:
                print(earlier["stdout"].rstrip())
            return Run(cmds[0], 0, earlier["stdout"], "", earlier["seconds"], out)
        result = run(step, "01_reference", quiet=quiet)
        record.write_text(json.dumps({"cmds": cmds, "seconds": result.seconds, "stdout": result.stdout}))
        return result


def show_diff(old_stage: str, new_stage: str, context: int = 1) -> None:
    """`diff -u old/train.py new/train.py`, rendered."""
    old = (ROOT / old_stage / "train.py").read_text().splitlines()
    new = (ROOT / new_stage / "train.py").read_text().splitlines()
    lines = list(difflib.unified_diff(old, new, f"{old_stage}/train.py", f"{new_stage}/train.py", n=context,
                                      lineterm=""))
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
    _markdown(f"**{new_stage}/train.py vs {old_stage}/train.py**: {added} lines added, {removed} removed "
              f"(of {len(new)})\n\n```diff\n" + "\n".join(lines) + "\n```")


def show_outline(stage: str) -> None:
    """The top-level functions and classes of a stage's train.py, with the first line of their docstring; of a GPT
    stage (a folder of files by concern), of each of its files in the order a reader meets them."""
    order = ["dataset.py", "model.py", "grid.py", "parallelize.py", "context_parallel.py", "pipeline.py", "train.py",
             "evaluate.py", "checks.py", "reports.py"]
    files = sorted((ROOT / stage).glob("*.py"), key=lambda p: order.index(p.name) if p.name in order else len(order)) \
        if (ROOT / stage / "model.py").exists() else [ROOT / stage / "train.py"]
    rows = ["| file:line | definition | what it is |", "|---|---|---|"]
    for path in files:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                doc = (ast.get_docstring(node) or "").split("\n")[0]
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                rows.append(f"| {path.name}:{node.lineno} | `{kind} {node.name}` | {doc} |")
    _markdown("\n".join(rows))


def compare(reference: Run, runs: dict[str, Run], ref_label: str = "01 (one process)") -> dict[str, float]:
    """A table of the runs against `reference` (stage 01), as the tour checks them.

    Returns, per run, the larger of its final weights' largest |Δ| from the reference and its epoch
    replay error (each epoch it recorded, replayed with stage 01's code: tour.replay_error).
    """
    ref_model = reference.model
    rows = ["| run | processes | backend/device | global batch | last epoch's loss | held-out accuracy "
            "| max \\|Δw\\| vs 01 | epoch replay | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    diffs = {}
    for label, r in {ref_label: reference, **runs}.items():
        s = r.summary
        final, replay = max_abs_diff(ref_model, r.model), replay_error(s, r.trajectory)
        diffs[label] = max(final, replay)
        rows.append(f"| {label} | {s['world_size']} | {s['backend'] or '-'}/{s['device']} | {s['global_batch']} "
                    f"| {s['losses'][-1]:.4f} | {s['eval_accuracy']:.2%} | {final:.1e} | {replay:.1e} "
                    f"| {r.seconds:.1f} |")
    _markdown("\n".join(rows))
    del diffs[ref_label]
    return diffs


def held_out_by_01(run: Run) -> tuple[float, float, int]:
    """Stage 01's own evaluate() on a run's model.pt, in one process on the CPU: (mean loss, accuracy, samples).

    For the stages where no rank holds the whole model (08, 09, 10): they score the held-out set with the model as it
    is split, and model.pt is the whole model, gathered only for --out. The two must agree.
    """
    import torch

    s01, s = load_stage("01_single_gpu"), run.summary
    dtype = s01.DTYPES[s["dtype"]]
    _, eval_set = s01.make_data(s["seed"], dtype)
    model = s01.Net().to(dtype)
    model.load_state_dict(run.model)  # strict: every weight of stage 01's Net, under its own name
    loss_sum, correct, count = s01.evaluate(model, eval_set, torch.device("cpu"))
    return loss_sum / count, correct / count, count


def plot_runs(reference: Run, runs: dict[str, Run], title: str, ref_label: str = "01, one process"):
    """Per-epoch training loss of each run over stage 01's, and the held-out accuracy and loss."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    ref = reference.summary
    epochs = range(1, len(ref["losses"]) + 1)
    ax.plot(epochs, ref["losses"], color="0.75", lw=7, label=ref_label, zorder=1)
    markers = "ox^sv"
    for i, (label, r) in enumerate(runs.items()):
        s = r.summary
        ax.plot(range(1, len(s["losses"]) + 1), s["losses"], markers[i % len(markers)] + "--", ms=6, lw=1,
                label=label, zorder=2 + i)
    ax.set(xlabel="epoch", ylabel="mean training loss (log scale)", yscale="log", title=title)
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(FormatStrFormatter("%.2g"))
    ax.legend(fontsize=8)
    labels = [ref_label, *runs]
    summaries = [ref, *(r.summary for r in runs.values())]
    accs = [100 * s["eval_accuracy"] for s in summaries]
    bars = bx.bar(range(len(labels)), accs, color=["0.75", *[f"C{i}" for i in range(len(runs))]])
    for bar, s in zip(bars, summaries, strict=True):
        bx.annotate(f"{100 * s['eval_accuracy']:.2f}%\nloss {s['eval_loss']:.4f}", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    bx.set_xticks(range(len(labels)), [textwrap.fill(label, 14) for label in labels], fontsize=8)
    bx.set(ylim=(min(accs) - 5, 101), ylabel="held-out accuracy (%)",
           title=f"held-out set ({ref['eval_count']} samples)")
    fig.tight_layout()
    show(fig)


def strip(paths: list[str]) -> None:
    """Clear what running and saving adds to a notebook (outputs, execution counts, language_info).

    Cell ids stay, so the diff against the committed file is only what you changed.
    """
    import nbformat

    for path in paths:
        nb = nbformat.read(path, as_version=4)
        nb.metadata = nbformat.NotebookNode({k: v for k, v in nb.metadata.items() if k in ("kernelspec", "jupytext")})
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
                cell.metadata.pop("execution", None)
        nbformat.write(nb, path)
        print(f"stripped {path}")


if __name__ == "__main__":  # python notebooks/nbtools.py strip notebooks/*.ipynb
    if sys.argv[1:2] != ["strip"] or not sys.argv[2:]:
        sys.exit("usage: python notebooks/nbtools.py strip NOTEBOOK.ipynb ...")
    strip(sys.argv[2:])
