"""Test helpers on top of tour.py's launcher: the tests run stages as the tour and a reader do.

Every launch runs in its own process group with a time limit (the job is killed and the test
fails instead of hanging), never on a fixed port (stage 03 picks a free one; torchrun runs
--standalone, which binds port 0; forkrun takes a free one), and reports processes that outlived the launcher.
One difference, for the suite's time: a single-node `torchrun --standalone` job, or a `python script` one, that
no test watches runs forked from the session's one import of torch (tests/forkrun.py, see forked(), served() and
forkrun_server()): the same script, environment and ranks, without a start-up per launch, with one intra-op thread
unless the test sets OMP_NUM_THREADS (CONTRIBUTING, "Where the time goes"); torchrun itself runs in the tour and
the fault battery, and for the READMEs' other forms.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

import forkrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tour import (  # noqa: E402
    ROOT,
    TORCHRUN,
    Job,
    Run,
    Step,
    clean_env,
    free_port,
    import_script,
    load_run,
    load_stage,
    max_abs_diff,
    max_gap,
    plan,
    print_stacks,
    replay_error,
    restore_state,
    run_command,
    run_job,
    run_slurm_command,
    slurm_missing,
    state_gap,
    tolerance,
)

STAGES = sorted(p.parent.name for p in ROOT.glob("[0-9][0-9]_*/train.py"))
# The GPT stages: each a folder of files by concern (model.py, dataset.py, ... train.py) that import each other.
FOLDER_STAGES = sorted(p.parent.name for p in ROOT.glob("[0-9][0-9]_*/model.py"))
# recipes/<name>/train.py: stage 04 with one everyday technique added (recipes/README.md).
RECIPES = sorted(f"recipes/{p.parent.name}" for p in ROOT.glob("recipes/*/train.py"))
__all__ = ["ROOT", "FOLDER_STAGES", "RECIPES", "STAGES", "TORCHRUN", "Fault", "Job", "Run", "Step",
           "assert_same_training", "check", "clean_env", "forked_ranks", "free_port", "gradient_bytes", "group_of_one",
           "launch", "launch_commands", "load_copy", "load_run", "load_stage", "max_abs_diff", "max_gap", "mutate",
           "mutated", "plan", "print_stacks", "programs", "replay_error", "restore_state", "run_chains",
           "run_command", "run_job", "run_slurm_command", "selected", "slurm_missing", "state_gap", "tolerance",
           "with_args", "with_batch", "workers"]


# Single-node torchrun and `python script` launches are run by tests/forkrun.py (forked from the session's import of
# torch), unless a test watches the job (`during`: a fault to inject) or the module tests torchrun itself
# (test_faults turns this off: its torchrun jobs run through torchrun; `python script` launches are forked still).
FORK_RANKS = True
FORKRUN = ROOT / "tests" / "forkrun.py"


def forked(cmds: list[list[str]]) -> list[list[str]]:
    """`cmds` with `torchrun --standalone --nproc_per_node=N script args` as forkrun's `N PORT script args` and
    `python script args` as its `python script args`; any other command (several nodes, more launcher flags such as
    --max-restarts, `python -c`) as it is."""
    head = [*TORCHRUN, "--standalone"]
    if len(cmds) != 1:
        return cmds
    if len(cmds[0]) > 1 and cmds[0][0] == sys.executable and cmds[0][1].endswith(".py"):  # `python script args`
        return [[sys.executable, str(FORKRUN), forkrun.PYTHON, *cmds[0][1:]]]
    if not FORK_RANKS or cmds[0][:len(head)] != head:
        return cmds
    nproc, *rest = cmds[0][len(head):]
    if not nproc.startswith("--nproc_per_node=") or not rest or rest[0].startswith("-"):
        return cmds
    return [[sys.executable, str(FORKRUN), nproc.split("=", 1)[1], str(free_port()), *rest]]


def served(cmds: list[list[str]], env: dict[str, str] | None) -> tuple[list[list[str]], dict[str, str] | None]:
    """forked(cmds), and the environment to run them in: a forked launch gets one intra-op thread unless the caller
    says otherwise (what torchrun gives its workers, what the tests' shared cores want, and the thread count the
    session's server imported torch with: a launch with another is not served)."""
    launched = forked(cmds)
    return launched, env if launched == cmds else {"OMP_NUM_THREADS": "1", **(env or {})}


def fork_launches(module: ModuleType) -> None:
    """`module.run_job` (tour.run_job, as notebooks/nbtools.py imports it) through served(): a notebook's kernel runs
    this before the notebook (tests/test_notebooks.py), so its launches go the way the tests' do; what the notebook
    prints of each command is unchanged."""
    run_job = module.run_job

    def run_served(cmds: list[list[str]], out: Path | None = None, env: dict[str, str] | None = None, *args, **kwargs):
        cmds, env = served(cmds, env)
        return run_job(cmds, out, env, *args, **kwargs)
    module.run_job = run_served


@contextlib.contextmanager
def forkrun_server(folder: Path) -> Iterator[Path]:
    """The session's forkrun server (tests/forkrun.py --serve): every forked launch whose environment is the
    session's is forked from it, so torch is imported once per session instead of once per launch. Yields the file
    where each launch it did not serve writes the variables that kept it out, one line each."""
    import subprocess
    path = str(folder / "socket")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(forkrun.SERVER, path)  # before the server starts: its environment is what launches must have
        with open(folder / "server.log", "wb") as log:
            server = subprocess.Popen([sys.executable, str(FORKRUN), "--serve", path], env=clean_env(),
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        try:
            yield Path(f"{path}.unserved")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)  # the server, and any leader or rank still running
            server.wait()


def programs(step: Step) -> int:
    """The processes a launch of `step` starts (time_limit's `programs`): on each node torchrun's agent and its
    workers; a `python script`, and the processes it starts with mp.spawn (--world-size)."""
    if step.launcher == "python":
        return 1 + (int(step.args[step.args.index("--world-size") + 1]) if "--world-size" in step.args else 0)
    return step.nnodes * (1 + step.nproc)


def launch(step: Step, out: Path | None = None, script: Path | None = None, timeout: float | None = None,
           env: dict[str, str] | None = None, during: Callable[[Job], None] | None = None) -> Run:
    """Run `step` (or a modified copy of its script); fail the test if it outlives `timeout` (by default the time
    limit of its processes: time_limit(programs(step)))."""
    timeout = time_limit(programs=programs(step)) if timeout is None else timeout
    return launch_commands(step.commands(out, script), out, {**step.env, **(env or {})}, timeout=timeout,
                           during=during)


def launch_commands(cmds: list[list[str]], out: Path | None = None, env: dict[str, str] | None = None, *,
                    timeout: float, during: Callable[[Job], None] | None = None) -> Run:
    """Run one command per node; fail the test if the job outlives `timeout` (it is killed, workers too): a
    time_limit() of what the commands start and wait for."""
    if during is None:
        cmds, env = served(cmds, env)
    run = run_job(cmds, out, env, timeout, during=during)
    if run.returncode is None:
        how = f": {timeout.how}" if isinstance(timeout, Limit) else ""
        pytest.fail(f"timed out after {timeout:.0f}s{how} (job killed)\n{run.describe()}")
    return run


def workers(job: Job) -> dict[int, int]:
    """{rank: pid} of the job's training processes (not torchrun's agent, not multiprocessing's helpers).

    torchrun's workers carry RANK in their environment. mp.spawn's do not: they are numbered in the
    order they were started, which is the order of their pids.
    """
    found, spawned = {}, []
    for pid in job.members():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")), None)
        if b"torch.distributed.run" in cmd:
            continue
        if rank is not None:
            found[int(rank)] = pid
        elif any(b"spawn_main" in c for c in cmd):
            spawned.append(pid)
    return found or dict(enumerate(sorted(spawned)))


def attempt_workers(job: Job, nproc: int, earlier: set[int] = frozenset()) -> dict[int, int] | None:
    """{rank: pid} of an attempt's `nproc` workers (none of them in `earlier`, the pids of the attempts before), found
    while they start; None if the job ends first. A scan reads three files of every process on the machine: a killer
    that scans once the training has reached its point kills that much later, so it scans before and then only waits."""
    while len(pids := {r: p for r, p in workers(job).items() if p not in earlier}) < nproc:
        if job.ended.is_set():
            return None
        time.sleep(0.05)
    return pids


class Fault:
    """Send `signum` to the worker of `rank` once the job has printed `after`; remember when it was sent.

    Passed to launch(during=...): it runs beside the job. Injected from outside, so the stages carry no test hooks.
    """

    def __init__(self, signum: int, rank: int = 1, after: str = "epoch 1/", limit: float = 120.0) -> None:
        self.signum, self.rank, self.after, self.limit = signum, rank, after, limit
        self.sent_at: float | None = None  # seconds after the job started
        self.error: str | None = None

    def __call__(self, job: Job) -> None:
        while time.monotonic() < job.start + self.limit and not job.ended.is_set():
            if self.after in job.output():
                pid = workers(job).get(self.rank)
                if pid is None:
                    self.error = f"no worker of rank {self.rank} among {workers(job)}"
                    return
                os.kill(pid, self.signum)
                self.sent_at = time.monotonic() - job.start
                return
            time.sleep(0.02)
        self.error = f"the job never printed {self.after!r} while it ran"

    def seconds_to_end(self, run: Run) -> float:
        """From the fault to the end of the job (every process gone)."""
        assert self.sent_at is not None, f"{self.error}\n{run.describe()}"
        return run.seconds - self.sent_at


def with_args(step: Step, *args: str, **changes) -> Step:
    """`step` with more arguments (a later flag wins over an earlier one), and any other field changed."""
    return replace(step, args=(*step.args, *args), **changes)


def with_batch(step: Step, batch: int) -> Step:
    """`step` with another --batch-size."""
    args = list(step.args)
    args[args.index("--batch-size") + 1] = str(batch)
    return replace(step, args=tuple(args))


def selected(request: pytest.FixtureRequest, test: str, param: str) -> list:
    """The `param` of each selected item of `test` in the requesting module: what a module-wide fixture runs at once."""
    return [item.callspec.params[param] for item in request.session.items
            if item.originalname == test and item.module is request.module]


def check(run: Run) -> Run:
    """Fail with the job's output unless it exited 0 and left no process behind."""
    assert run.returncode == 0 and not run.survivors, run.describe()
    return run


def assert_same_training(run: Run, reference: Run) -> None:
    """The tutorial's claim, checked as the tour checks it: `run` computed stage 01's training.

    Every recorded epoch replays with stage 01's code to within sqrt(eps) of the run's dtype, and
    the final weights are within it of `reference` (stage 01 at the same global batch). In float64
    at the suite's settings (the tour's 5 epochs, lr 0.05) the final gap is ~1e-15: 1e7 below the tolerance,
    and no bug stays under it (the negative controls in test_equivalence.py differ by > 1e-3).
    """
    s = run.summary
    tol, replay = tolerance(s["dtype"]), replay_error(s, run.trajectory)
    final = max_abs_diff(reference.model, run.model)
    assert replay <= tol and final <= tol, \
        f"{s['stage']}: epoch replay {replay:.2e}, final |Δw| vs 01 {final:.2e}; tolerance {tol:.1e} ({s['dtype']})"


def edited(path: Path, edits: list[tuple[str, str]]) -> str:
    """`path`'s text with each (old, new) made; AssertionError naming an `old` that is not there exactly once."""
    text = path.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{path.relative_to(ROOT)}: expected exactly one {old!r} to replace"
        text = text.replace(old, new)
    return text


def mutate(stage: str, old: str, new: str, dest: Path) -> Path:
    """Copy a stage's script with one edit (the stages are self-contained, so the copy runs anywhere); the copy's
    train.py. A GPT stage is a folder of files: all are copied, and the one that holds `old` is edited."""
    return mutated(stage, [(old, new)], dest)


def mutated(stage: str, edits: list[tuple[str, str]], dest: Path) -> Path:
    """mutate() with several edits, each made in the one file of the stage that holds its `old`."""
    dest.mkdir(parents=True, exist_ok=True)
    files = sorted((ROOT / stage).glob("*.py")) if stage in FOLDER_STAGES else [ROOT / stage / "train.py"]
    mine: dict[Path, list[tuple[str, str]]] = {f: [] for f in files}
    for old, new in edits:
        holding = [f for f in files if old in f.read_text()]
        assert len(holding) == 1, f"{stage}: expected one file holding {old!r}, found {[f.name for f in holding]}"
        mine[holding[0]].append((old, new))
    for f in files:
        (dest / f.name).write_text(edited(f, mine[f]))
    return dest / "train.py"


def load_copy(path: Path) -> ModuleType:
    """Import a copy made by mutate(), or a script, as a module of its own (load_stage imports the repository's
    stages, once), with the files beside it that it imports (tour.import_script)."""
    return import_script(path, f"copy_{path.parent.name}_{abs(hash(path))}")


def forked_ranks(module: str, worker: str, world: int, out: Path, timeout: float | None = None) -> list[dict]:
    """What each rank of a small in-process job found: tests/`module`.py's `worker(rank, world, store, out)` on `world`
    ranks, forked from one fresh interpreter (torch imported once; gloo over a FileStore in `out`: no port), each
    writing `out`/rank{R}.json. The job is a launch of its own, under the suite's time limit (by default that of the
    interpreter and its ranks) and survivor check."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import torch.multiprocessing as mp; "
            f"import {module} as t; mp.start_processes(t.{worker}, args=({world}, {str(out / 'store')!r}, "
            f"{str(out)!r}), nprocs={world}, start_method='fork')")
    check(launch_commands([[sys.executable, "-c", code]], out,
                          timeout=time_limit(programs=1 + world) if timeout is None else timeout))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


class Early:
    """A test module's EARLY_JOBS, `module.early_job(job)` for each, in two worker processes of their own at the lowest
    priority, started (start()) when the session's background has ended (conftest.py): from then on the session
    leaves a core idle a third of the time, and these take it, so that their tests find them done. Same code, same
    results as in this process; results() waits for them, starting them first if need be, at the others' priority."""

    def __init__(self, module: ModuleType) -> None:
        self.module, self.jobs, self.futures = module, list(module.EARLY_JOBS), []
        self.pool, self.pids, self.lock = None, [], threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.pool is not None:
                return
            # spawn, not fork: this process has threads (the background's); nice 19: idle time only, until wanted
            before = {p.pid for p in multiprocessing.active_children()}
            self.pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), initializer=os.nice,
                                            initargs=(19,))
            self.futures = [self.pool.submit(self.module.early_job, job) for job in self.jobs]
            # (the submits have started its workers, children of this process's multiprocessing)
            self.pids = [p.pid for p in multiprocessing.active_children() if p.pid not in before]

    def results(self) -> list:
        self.start()
        if not all(f.done() for f in self.futures):
            try:  # wanted now: the workers at the others' priority (raising one takes root)
                for pid in self.pids:
                    os.setpriority(os.PRIO_PROCESS, pid, 0)
            except PermissionError:  # else the jobs not begun run here
                return [f.result() if not f.cancel() else self.module.early_job(job)
                        for f, job in zip(self.futures, self.jobs, strict=True)]
        return [f.result() for f in self.futures]

    def close(self) -> None:
        """At the session's end: jobs still running (their tests deselected by a failure, -x) are stopped."""
        if self.pool is None:
            return
        self.pool.shutdown(wait=False, cancel_futures=True)
        for pid in self.pids if not all(f.done() for f in self.futures) else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def group_of_one() -> Iterator[None]:
    """A gloo process group of one in this process (what `python train.py` makes): enough for DDP and its hooks."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


CORPUS = ROOT / "11_gpt" / "data" / "input.txt"  # tiny Shakespeare, the GPT stages' --data
SMALL_CORPUS = (662_628, 24_000)  # the first line start whose next 24,000 characters use all 65 of CORPUS's


def small_corpus(folder: Path) -> Path:
    """SMALL_CORPUS's stretch of CORPUS as folder/input.txt, for the GPT stages' --data: a run's cost beyond its steps
    is the corpus (tokenised by every rank) and its held-out tenth (scored whole at the end by every layout compared
    with one process); here 2,400 held out, whose last window is shorter at context 24, 32 and 64 (the padded tail a
    layout must score as one process does). Its vocabulary is CORPUS's, so a model or checkpoint of the default corpus
    has its shapes."""
    start, chars = SMALL_CORPUS
    text = CORPUS.read_text(encoding="utf-8")
    assert text[start - 1] == "\n" and set(text[start:start + chars]) == set(text), "SMALL_CORPUS: not CORPUS's stretch"
    path = folder / "input.txt"
    path.write_text(text[start:start + chars], encoding="utf-8")
    return path


def gradient_bytes(dtype: str = "float64") -> int:
    """What one all-reduce of every gradient hands over per rank: stage 01's parameters, counted here, not by a hook."""
    import torch
    return sum(p.numel() for p in load_stage("01_single_gpu").Net().parameters()) * getattr(torch, dtype).itemsize


# --- Time limits made of this machine's pace -------------------------------------------------------------------------
# A job's time limit (launch's, launch_commands', run_job's `timeout`), which only a hang or a wait nobody configured
# reaches: what the case configured to wait (`waits`: a --timeout it sets off on purpose, say) plus PROGRAM_STARTUPS
# start-ups of a trivial launch (PROBE, what a program pays at least) for every process the case runs (`programs`: each
# rank one, torchrun's agent one, each restart's ranks again; on these cores N ranks cost about N times one, and their
# epochs and steps are the tutorial's small ones; a case that does much more, a compile, counts more and says why).
# Measured, a process took mostly 1-4 start-ups, at most 7.7 (when one module ran 4 ranks beside 16): 25
# leaves three times the most. The start-up is timed as the tests run (run_job, as their jobs), so as slow as the
# machine is then; a timing younger than PROBE_REUSE seconds serves every limit (a probe costs ~2.6 CPU-s). A 1.7 times
# slower or busier machine gets limits in proportion, and a hang is still ended: in about 2 minutes for a 2-rank job
# where a start-up takes 2.5 s.
PROGRAM_STARTUPS = 25
PROBE = (sys.executable, "-c", "import torch")  # a trivial launch
PROBE_LIMIT = 600  # only for the probe itself, which has nothing to be measured against: an interpreter that hangs
PROBE_REUSE = 120.0
_probed: list[tuple[float, float]] = []  # (when, seconds) of the last probe
_probing = threading.Lock()  # tests launching side by side (and the READMEs' blocks) share one probe


def startup() -> tuple[float, float]:
    """Seconds one trivial launch (PROBE) takes on this machine now, run as the tests' jobs are (run_job), and how
    many seconds ago it was timed (at most PROBE_REUSE)."""
    with _probing:
        if not _probed or time.monotonic() - _probed[-1][0] > PROBE_REUSE:
            run = run_job([list(PROBE)], timeout=PROBE_LIMIT)
            assert run.returncode == 0, f"the probe of the machine's pace failed\n{run.describe()}"
            _probed.append((time.monotonic(), run.seconds))
        when, seconds = _probed[-1]
        return seconds, time.monotonic() - when


class Limit(float):
    """A time limit in seconds that says how it was made (launch_commands says it when a job reaches it)."""

    def __new__(cls, seconds: float, how: str) -> Limit:
        limit = super().__new__(cls, seconds)
        limit.how = how
        return limit


def run_chains(chains: dict[str, list[Step]], tmp: Path, names: dict[str, list[str]] | None = None,
               scripts: dict[str, Path] | None = None, weights: dict[str, int] | None = None,
               args: tuple[str, ...] = ()) -> dict[str, Run]:
    """A test module's runs: each chain's steps one after another (a resumed run after the one it resumes), two
    chains at a time (independent ones side by side: put the longest first, so that the others fill in beside it).
    Each run by its name (`names[chain]`, else the chain's own), its --out tmp/name, checked; `scripts[chain]`: a
    mutated copy to run instead; `weights[chain]`: programs each process counts as in its time limit (a compiling
    run, 3); `args`: given to every run after its own (a later flag wins: `--data`, small_corpus(tmp))."""
    names, scripts, weights = names or {}, scripts or {}, weights or {}

    def run_chain(chain: str) -> list[Run]:
        return [check(launch(with_args(s, *args), out=tmp / names.get(chain, [chain])[i], script=scripts.get(chain),
                             timeout=time_limit(programs=programs(s) * weights.get(chain, 1))))
                for i, s in enumerate(chains[chain])]

    with ThreadPoolExecutor(max_workers=2) as pool:
        finished = dict(zip(chains, pool.map(run_chain, chains), strict=True))
    return {name: run for chain, done in finished.items()
            for name, run in zip(names.get(chain, [chain]), done, strict=True)}


def time_limit(programs: int = 1, waits: float = 0.0) -> Limit:
    """The time limit of a case that runs `programs` processes and configured `waits` seconds of waiting."""
    unit, age = startup()
    return Limit(waits + PROGRAM_STARTUPS * programs * unit,
                 f"{waits:g}s configured + " * bool(waits) + f"{PROGRAM_STARTUPS} x {programs} process(es) x a "
                 f"start-up of {unit:.1f}s timed {age:.0f}s before")
