"""The READMEs' code blocks, and how a block of commands runs: what test_readme_commands.py checks, and
what conftest.py runs once for the whole session (the top README's tour, whose runs the equivalence tests read).

Code blocks in README files are tagged: ```bash for commands, ```text for output, ```python for an
excerpt of the train.py beside the README. A bash block runs as one script from the root of a fresh
copy of the repository (its `runs/` fill up there, not here), with this interpreter first on PATH,
under a time limit. A comment line just before a block can say how:

    <!-- not-run: needs GPUs -->        skipped, with one of the reasons in test_readme_commands.NOT_RUN
    <!-- run: together -->              each command at once, as in two terminals, then wait for all
    <!-- run: as root -->               skipped unless root (network namespaces)
    <!-- run: with slurm -->            skipped where Slurm cannot run (see tour.slurm_missing)
    <!-- expect: <text> -->             the output must contain <text>
    <!-- launches: N (why) -->          the block starts N programs in all (its time limit counts them: see launches())

Several may be combined with ";". The one change made to a command: ports written as 29xxx become
free ports (the same one for the same number within a file), since the tests never use a fixed port. And one to
how it runs: `torchrun` and `python` (`python3`) are launch_shims', which fork `torchrun --standalone
--nproc_per_node=N script` jobs' ranks and `python script.py` from the session's import of torch (tests/forkrun.py)
and hand every other form to torchrun or Python; so is the first launch of each script through each launcher
(run_docs: real_once), so that every script a README launches runs once as a reader starts it.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import forkrun
from harness import FORKRUN, ROOT, Run, free_port, plan, run_job, slurm_missing, startup

DOCS = sorted(p for p in ROOT.rglob("README.md") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))
FENCE = re.compile(r"(?:<!-- (?P<marker>[^>]*?) -->\n)?```(?P<lang>[^\n]*)\n(?P<body>.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    body: str
    marker: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """The block's commands: continuation lines joined, comment-only and blank lines dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.body)
        return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            marker = {}
            for item in (m.group("marker") or "").split(";"):
                key, _, value = item.partition(":")
                if key.strip():
                    marker[key.strip()] = value.strip()
            if "test-command" in marker:  # README.md's test command: .ci/run runs it
                marker["not-run"] = "is the test command itself"
            line = text[:m.start("lang")].count("\n") + 1
            found.append(Block(doc, line, m.group("lang").strip(), m.group("body"), marker))
    return found


BLOCKS = blocks()
COMMANDS = [b for b in BLOCKS if b.lang == "bash"]
# The top README's tour: every stage through its real launcher, its runs kept (--out). It runs once per session
# (conftest.tour): its table is checked as any README output is, and its runs are the suite's `runs`.
TOURS = [b for b in COMMANDS if b.doc == ROOT / "README.md" and "tour.py" in b.body and "not-run" not in b.marker]


def repo_copy(parent: Path) -> Path:
    """A fresh copy of the repository: a block's commands write their runs/ (and notebooks) there.

    Its `.venv` is the environment running these tests (the set-up line's, under .ci/run).
    """
    copy = parent / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", ".*_cache",
                                                               ".ipynb_checkpoints", "slurm-*.out"))
    if sys.prefix != sys.base_prefix:  # a virtual environment: link it whole (its python finds its packages so)
        (copy / ".venv").symlink_to(sys.prefix)
    else:  # run outside one (python3 -m pytest): .venv/bin/python is this interpreter
        python = copy / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        python.chmod(0o755)
    return copy


PORTS: dict[tuple[Path, str], str] = {}


def with_free_ports(block: Block, text: str) -> str:
    def port(m: re.Match) -> str:
        return PORTS.setdefault((block.doc, m.group(0)), str(free_port()))
    return re.sub(r"\b29\d{3}\b", port, text)


def run_block(block: Block, copy: Path, env: dict[str, str] | None = None) -> Run:
    """Run `block` in `copy`; the Run's `out` is `copy`, where the block's files are."""
    bash = ["bash", "-euo", "pipefail", "-c"]
    if "together" in block.marker.get("run", ""):  # as in several terminals: all at once
        cmds = [[*bash, with_free_ports(block, c)] for c in block.commands()]
    else:
        cmds = [[*bash, with_free_ports(block, block.body)]]
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # `python`, `torchrun`: ours
           # READMEs share 2 cores with the tests: one thread per process, as torchrun gives its workers. With torch's
           # default (a thread per core) a lone `python train.py` waits on its descheduled second thread at every
           # op: measured here at 4-12 s an epoch instead of 0.1 s. The results do not depend on it.
           "OMP_NUM_THREADS": "1", **(env or {})}
    return run_job(cmds, copy, env=env, timeout=time_limit(block), cwd=copy)


# A block's time limit: LAUNCH_STARTUPS start-ups of a trivial launch (harness.startup: timed shortly before the
# block, so as slow as the machine is then, one probe serving the tests' limits too) for every program the block
# launches (launches()). Measured here, with other jobs on the 2 cores (a start-up 2-5 s), per launch: the tour's runs
# 7.7 start-ups (213 s), a README's stage runs 4-6, the benchmarks' and tools' quick runs 5-13 (ddp_scaling's, 61 s,
# the most). 40 leaves three times the most, for a machine that gets busier during a block than when it was timed. A
# hang is still ended: the tour (13 launches) gets ~17 minutes where a start-up takes 2 s.
LAUNCH_STARTUPS = 40
LAUNCHER = re.compile(r"(?<![\w-])(?:python3?|torchrun|jupytext)\b")  # a command that starts a program
SBATCH = re.compile(r"(?<![\w-])sbatch\b.*?(\S+\.sbatch)")  # a command that submits a job script
LIMITS: dict[str, str] = {}  # block id: how its limit was made (test_readme_commands says it when one is reached)


def launches(block: Block) -> int:
    """Programs `block` starts: each command line that runs Python (torchrun's workers start at once, so a torchrun
    counts one), one per node for a Slurm job it submits (a torchrun on each, the nodes sharing this machine's cores;
    counted as none before, the Slurm block's job once took 77 s under CI's load, 23 s in the CI before, against a
    limit of 40 x 1 x 2.3 s), and for the tour each of its runs (its plan on the CPU, and the Slurm run). A script
    that launches jobs of its own one after another says how many programs the block starts in all, in its marker
    (`<!-- launches: N (why) -->`; test_readme_commands asks it of every such script): rounding.py's quick run, four
    jobs counted as one launch, was killed at 84 s under CI's load (26 s alone)."""
    if "launches" in block.marker:
        return int(block.marker["launches"].split()[0])
    count = sum(1 for command in block.commands() if LAUNCHER.search(command))
    for command in block.commands():
        if found := SBATCH.search(command):
            nodes = re.search(r"--nodes[= ](\d+)", command) or \
                re.search(r"^#SBATCH --nodes=(\d+)", (ROOT / found.group(1)).read_text(), re.M)
            count += int(nodes.group(1)) if nodes else 1
    if "tour.py" in block.body:
        count += len(plan(2, 32, device="cpu", gpus=0)) + 1
    return max(count, 1)


def time_limit(block: Block) -> float:
    n, (unit, age) = launches(block), startup()
    LIMITS[block.id] = (f"{LAUNCH_STARTUPS} x {n} launch(es) x a start-up of {unit:.1f}s timed {age:.0f}s before "
                        f"the block")
    return LAUNCH_STARTUPS * n * unit


def block_showing(command: str) -> Block:
    """The README bash block that shows `command` as one of its commands (a test reads that block's run).

    Compared word by word: a command continued over several lines (`\\`) counts as one line."""
    words = command.split()
    found = [b for b in COMMANDS if any(c.split() == words for c in b.commands())]
    assert len(found) == 1, f"expected one README block showing {command!r}, found {[b.id for b in found]}"
    return found[0]


def why_skipped(block: Block) -> str | None:
    """Why `block` is not run here (None: it runs)."""
    if "not-run" in block.marker:
        return block.marker["not-run"]
    run_as = block.marker.get("run", "")
    if "as root" in run_as and os.geteuid() != 0:
        return "needs root (network namespaces)"
    if "with slurm" in run_as:
        return slurm_missing()
    return None


# Started first, so that the shorter READMEs fill in beside them (measured here, each alone: the benchmarks' 70 s,
# the hooks recipe's 45 s, stage 03's and 08's 30 s, Slurm's mostly waiting; the others 25 s or less).
LONGEST = [ROOT / "benchmarks" / "README.md", ROOT / "recipes" / "comm_hooks" / "README.md",
           ROOT / "03_ddp_spawn" / "README.md", ROOT / "08_fsdp" / "README.md", ROOT / "slurm" / "README.md"]


# READMEs run at a time. They run beside the test modules, which mostly start one job at a time and keep ~1.45 of
# the 2 cores busy alone: two READMEs fill the rest and last as long as those modules do. With three, the READMEs
# ended first and the last modules ran alone, a core half idle (measured: ~70 core-s idle).
AT_ONCE = 2


# The READMEs show what their commands print on a CPU, and the suite is gloo/CPU: every block runs with the GPUs
# hidden, as the tour does (on a 1-GPU machine, `--nproc_per_node=2` would otherwise be refused by the stages'
# own check). The GPU paths have their own tests: `pytest -m gpu` (tests/test_gpu.py).
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


# READMEs whose commands run through torchrun and python themselves, not the shims: the GPT stages' (the tour runs
# stages 01-10 through their real launchers, with its own flags; nothing else ran 11's and 12's). ~45 CPU-s more.
# The other READMEs' first launch of each script runs through its real launcher too (real_once).
THROUGH_LAUNCHERS = tuple(ROOT / stage / "README.md" for stage in ("11_gpt", "12_context_parallel", "13_pipeline_4d",
                                                                  "14_experts"))


def launch_shims(tmp: Path) -> Path:
    """A folder holding a `torchrun`, a `python` and a `python3` for the READMEs' commands: `torchrun --standalone
    --nproc_per_node=N script args` and `python script.py args` (or python3) run through tests/forkrun.py (forked from
    the session's one import of torch: each such torchrun command cost ~8 CPU-s more through torchrun, and the READMEs
    hold 43; each `python script.py`, the ~2.5 CPU-s of importing torch); any other form (several nodes,
    --max-restarts, `python -c`, `python -m`) is torchrun's or Python's own, and so is a script's first launch where
    the block's environment names a claims folder (forkrun.REAL_ONCE). The tour (every stage, through torchrun
    itself) does not use them, nor does the fault battery."""
    shim = tmp / "launch_shims"
    shim.mkdir()
    for name, form in [("torchrun", "--torchrun"), ("python", "--python"), ("python3", "--python")]:
        (shim / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FORKRUN))} '
                                 f'{form} "$@"\n')
        (shim / name).chmod(0o755)
    return shim


def real_once(tmp: Path, tour: bool) -> Path:
    """The folder where the shims claim each launcher and script they see (forkrun.REAL_ONCE): the first launch of a
    script through a launcher runs through the real one. The tour's (`tour`: it runs in this session) are claimed
    before: it runs them through torchrun and python itself."""
    folder = tmp / "real_once"
    folder.mkdir()
    for step in plan(2, 32, device="cpu", gpus=0) if tour else []:
        (folder / forkrun.real_once_name(step.launcher, f"{step.stage}/train.py")).write_text('"the tour"')
    return folder


def shimmed(command: str) -> tuple[str, str] | None:
    """(launcher, script) of a README command that the shims take (forkrun.shim_form), else None."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # a line of a quoted string that spans lines (`python -c "` ... `"`): the shell's, not ours
        return None
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words or words[0] not in ("torchrun", "python", "python3"):
        return None
    launcher = "torchrun" if words[0] == "torchrun" else "python"
    script = forkrun.shim_form(launcher, words[1:], exists=False)
    return (launcher, script) if script else None


REAL_LAUNCHES: list[Path] = []  # run_docs's real_once folder, for test_readme_commands


def run_docs(blocks: list[Block], tmp: Path, tour: bool = False) -> dict[str, Run | BaseException]:
    """Each block's run, by id: each README's blocks in order in one copy under `tmp`, AT_ONCE READMEs at a time.

    Much of a README's time is spent starting Python and importing torch on one core, or waiting (for a Slurm
    job, a rendezvous): several at a time keep the cores busy. `tour`: the tour runs in this session (real_once).
    """
    docs: dict[Path, list[Block]] = {}
    for block in blocks:
        docs.setdefault(block.doc, []).append(block)
    REAL_LAUNCHES[:] = [real_once(tmp, tour)]
    shims = {**HIDE_GPUS, forkrun.REAL_ONCE: str(REAL_LAUNCHES[0]),
             "PATH": f"{launch_shims(tmp)}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def one_doc(blocks: list[Block]) -> dict[str, Run | BaseException]:
        copy = repo_copy(Path(tempfile.mkdtemp(dir=tmp)))
        done: dict[str, Run | BaseException] = {}
        env = HIDE_GPUS if blocks[0].doc in THROUGH_LAUNCHERS else shims
        for block in blocks:
            try:
                done[block.id] = run_block(block, copy, env)
            except BaseException as e:  # a bug here: reported by the block's own test
                done[block.id] = e
        return done

    order = sorted(docs, key=lambda doc: LONGEST.index(doc) if doc in LONGEST else len(LONGEST))
    # Named after the calling thread (conftest's "background"), so that `pytest --cpu-profile` knows whose they are.
    with ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix=threading.current_thread().name) as pool:
        return {k: v for done in pool.map(one_doc, [docs[d] for d in order]) for k, v in done.items()}
