"""The tour: run every stage through its real launcher and show they all compute the same training.

    python tour.py                    # GPUs if visible (nccl), else the CPU (gloo); float64
    python tour.py --dtype float32    # the precision training uses: rounding 5e8 times coarser
    python tour.py --epochs 20        # as long as each stage trains by default
    python tour.py --out runs/tour    # keep every run's files (summary.json, model.pt, ...) to look at

Each stage trains the same model on the same data in the same order; the distributed ones
use W processes of batch b, the single-process ones batch W*b. Only the way the work is
split changes, so every epoch of every stage is an epoch of stage 01, up to float rounding:
the tour replays each recorded epoch with stage 01's own code and compares (see replay_error).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent
# Variables a launcher sets for its workers: a value inherited from the caller's shell would leak in.
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")  # `torchrun`, with this interpreter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Step:
    stage: str
    launcher: str  # "python" (the script may mp.spawn itself), "torchrun", or "sbatch" (the tour's Slurm run)
    args: tuple[str, ...]
    nproc: int = 1  # processes torchrun starts on each node
    nnodes: int = 1  # torchrun "nodes", all on this machine (127.0.0.1)
    label: str = ""  # how the table names the launcher
    torchrun_args: tuple[str, ...] = ()  # e.g. --max-restarts=3

    def commands(self, out: Path | None = None, script: Path | None = None) -> list[list[str]]:
        """One command per node."""
        path = str(script or ROOT / self.stage / "train.py")
        args = [a.replace("{out}", str(out)) for a in self.args]  # e.g. a snapshot file inside the run's dir
        args = [*args, "--out", str(out)] if out is not None else args
        if self.launcher == "python":
            return [[sys.executable, path, *args]]
        if self.nnodes == 1:  # --standalone binds its rendezvous to port 0: always a free port
            return [[*TORCHRUN, "--standalone", f"--nproc_per_node={self.nproc}", *self.torchrun_args, path, *args]]
        port = free_port()  # static rendezvous: every node is told where node 0 listens
        return [[*TORCHRUN, f"--nnodes={self.nnodes}", f"--nproc_per_node={self.nproc}", f"--node_rank={i}",
                 "--master_addr=127.0.0.1", f"--master_port={port}", *self.torchrun_args, path, *args]
                for i in range(self.nnodes)]

    def spec(self) -> dict:
        """What the step runs, its label aside, as JSON: two steps with the same spec launch the same job."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "label"}

    @property
    def env(self) -> dict[str, str]:
        # One thread per process where torchrun does not set it (it does for nproc_per_node > 1): the model is
        # tiny, so a second thread mostly waits (stage 01 alone here: the same time, 6.5 CPU-s instead of 5.3),
        # spinning against whatever else runs (several "nodes" sharing the cores, a busy machine).
        return {"OMP_NUM_THREADS": "1"} if self.launcher == "python" or self.nnodes > 1 else {}


# The tour's length: every epoch is replayed, so 5 epochs check what 20 would (each epoch's replay is as sharp as
# any other's), in a quarter of the time. The stages train 20 by default; `tour.py --epochs 20` runs them so.
EPOCHS = 5


def plan(world: int, batch: int, epochs: int | None = EPOCHS, device: str = "auto", dtype: str = "float64",
         gpus: int | None = None, lr: float | None = None, seed: int | None = None) -> list[Step]:
    """Every stage that exists, each set up to compute the same thing at global batch world*batch.

    `epochs`: None leaves each stage's own default. `gpus`: how many the runs may use (default: those visible, none
    for --device cpu). With one GPU, the single-process runs use it and the multi-process ones run as CPU processes.
    """
    gpus = visible_gpus(device) if gpus is None else gpus
    settings = training_args(epochs, lr, seed)
    one = ("--device", "cuda" if gpus == 1 else device, "--dtype", dtype, *settings)  # single-process runs
    common = ("--device", "cpu" if gpus == 1 else device, "--dtype", dtype, *settings)  # multi-process runs
    tp = next(d for d in (4, 2, 1) if world % d == 0)  # stage 09's tensor-parallel degree
    pp = 2 if world % 2 == 0 else 1  # stage 10's pipeline stages
    steps = [
        Step("01_single_gpu", "python", (*one, "--batch-size", str(world * batch)), label="python"),
        Step("02_dataparallel", "python", (*one, "--batch-size", str(world * batch)), label="python"),
        Step("03_ddp_spawn", "python", (*common, "--world-size", str(world), "--batch-size", str(batch)),
             label="mp.spawn"),
        Step("04_ddp_torchrun", "torchrun", (*common, "--batch-size", str(batch)), nproc=world, label="torchrun"),
        Step("04_ddp_torchrun", "python", (*one, "--batch-size", str(world * batch)), label="python (1 process)"),
        *([Step("04_ddp_torchrun", "torchrun", (*one, "--batch-size", str(world * batch)), nproc=1,
                label="torchrun, 1 process")] if gpus == 1 else []),  # DDP with nccl on the one GPU
        # Without GPUs, W torchrun "nodes" of one process each on 127.0.0.1. Nodes sharing one machine's
        # GPUs would all pick cuda:LOCAL_RANK, so with GPUs it runs as one node.
        Step("05_multinode", "torchrun", (*common, "--batch-size", str(batch)), nproc=1, nnodes=world,
             label=f"torchrun, {world} nodes") if gpus < 2 else
        Step("05_multinode", "torchrun", (*common, "--batch-size", str(batch)), nproc=world, label="torchrun, 1 node"),
        Step("06_checkpoint", "torchrun", (*common, "--batch-size", str(batch), "--snapshot", "{out}/snapshot.pt"),
             nproc=world, label="torchrun + snapshots"),
        # Two GPUs per process: half as many processes, each with twice the batch (same global batch).
        Step("07_model_parallel", "torchrun", (*common, "--batch-size", str(2 * batch)), nproc=world // 2,
             label="torchrun, model on 2 GPUs") if gpus >= 2 and world % 2 == 0 else
        Step("07_model_parallel", "torchrun", (*common, "--batch-size", str(batch)), nproc=world,
             label="torchrun, model split"),
        Step("08_fsdp", "torchrun", (*common, "--batch-size", str(batch)), nproc=world, label="torchrun, FSDP2 shards"),
        # Every layer split over tp processes (the most of 4, 2, 1 that divides W: the model's 4 classes are split
        # too); the tp ranks of a row share their samples, so each row takes tp*b of them: the same W*b a step.
        Step("09_tensor_parallel", "torchrun", (*common, "--batch-size", str(tp * batch), "--tp", str(tp)),
             nproc=world, label=f"torchrun, dp {world // tp} x tp {tp}"),
        # The layers split over pp processes (2: body | head, as in 07), 4 micro-batches; the stages of a pipeline
        # share their samples, so each pipeline takes pp*b of them: the same W*b a step.
        Step("10_pipeline_parallel", "torchrun", (*common, "--batch-size", str(pp * batch), "--pp", str(pp),
                                                  "--microbatches", "4"),
             nproc=world, label=f"torchrun, dp {world // pp} x pp {pp}"),
    ]
    return [s for s in steps if (ROOT / s.stage / "train.py").exists()]


def training_args(epochs: int | None, lr: float | None, seed: int | None) -> tuple[str, ...]:
    """The flags every run shares when the tour sets them; none: the stages' own defaults."""
    given = (("--epochs", epochs), ("--lr", lr), ("--seed", seed))
    return tuple(word for flag, value in given if value is not None for word in (flag, str(value)))


def tour_world(gpus: int) -> int:
    """Processes of the distributed runs: one per GPU, as many as divide the data evenly (a power of two: 4096
    samples and batch 32 per process), or 2 CPU processes. Three GPUs would make a global batch of 96, which does
    not divide 4096: DistributedSampler pads the last step with repeated samples, and no stage is then stage 01."""
    return 2 ** (gpus.bit_length() - 1) if gpus >= 2 else 2


def visible_gpus(device: str) -> int:
    import torch  # here, not at the top: importing torch takes seconds
    return torch.cuda.device_count() if device != "cpu" else 0


def where(gpus: int, world: int) -> str:
    """What runs where, in one line."""
    if gpus == 0:
        return "CPU (gloo)"
    if gpus == 1:
        return (f"1 GPU: the single-process runs on it (nccl for DDP), the {world}-process runs as CPU processes "
                f"(gloo)")
    return "GPUs (nccl)"


@dataclass
class Run:
    cmd: list[str]
    returncode: int | None  # None: killed at the time limit
    stdout: str
    stderr: str
    seconds: float
    out: Path | None
    survivors: list[int] = field(default_factory=list)  # processes of the job alive after the launcher exited

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    @property
    def model(self) -> dict:
        import torch
        return torch.load(self.out / "model.pt", map_location="cpu", weights_only=True)

    @property
    def trajectory(self) -> list[dict]:
        import torch
        return torch.load(self.out / "trajectory.pt", map_location="cpu", weights_only=True)

    def describe(self) -> str:
        status = "killed at the time limit" if self.returncode is None else f"exit {self.returncode}"
        # A crashed process's Python stack (PYTHONFAULTHANDLER, clean_env) comes first in stderr, before the
        # other ranks' errors and the launcher's report: keep it even where the tail alone would cut it off.
        # At the time limit every process printed its stacks so (print_stacks): each rank's, all kept.
        crash = self.stderr.find("Fatal Python error")
        cut_off = 0 <= crash < len(self.stderr) - 4000
        what, keep = ("the crash", 3000) if self.returncode is not None else ("the stacks at the time limit", 12000)
        crashed = f"--- {what} ---\n{self.stderr[crash:crash + keep]}\n" if cut_off else ""
        return (f"$ {' '.join(self.cmd)}\n{status} after {self.seconds:.1f}s\n"
                f"--- stdout ---\n{self.stdout[-4000:]}\n{crashed}--- stderr ---\n{self.stderr[-4000:]}")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    # A process killed by a crash inside torch (SIGSEGV, SIGABRT) prints where it was, in Python, instead of nothing.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update(extra or {})
    return env


JOB_TAG = "DDP_TUTORIAL_JOB"  # set in every launched job's environment; every descendant inherits it


def _ended(pid: int) -> bool:
    """Whether process `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def _job_members(tag: str) -> list[int]:
    """Live (non-zombie) processes of the job tagged `tag`.

    Found by their environment, not their process group: torchrun starts each worker in a
    session of its own (torch.distributed.elastic's subprocess handler), out of the launcher's group.
    Or by their name: a rank forked by the tests' launcher (tests/forkrun.py) keeps the environment of the process
    it was forked from, and carries the tag's last 15 characters as its name (PR_SET_NAME) instead.
    """
    needle, name = f"{JOB_TAG}={tag}".encode(), tag[-15:]
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (needle in (proc / "environ").read_bytes().split(b"\0") or
                    (proc / "comm").read_text().rstrip("\n") == name) and not _ended(int(proc.name)):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return found


def _kill_job(tag: str) -> None:
    for pid in _job_members(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# At a job's time limit, how long its processes get to print their stacks before they are killed
STACKS_GRACE = 5.0


def print_stacks(tag: str) -> None:
    """Every process of the job prints where each of its threads is, in Python, to its stderr, and ends: SIGABRT, which
    faulthandler (PYTHONFAULTHANDLER, clean_env) answers with the stacks; no core file (RLIMIT_CORE 0 first). So a job
    killed at its time limit says on which line each rank waited (a hang's usual story: one rank in a collective the
    others never called). One process at a time, the last started first (ranks before their launcher): ranks share
    their launcher's stderr, and stacks printed at once would interleave. What is left after STACKS_GRACE seconds is
    killed by the caller."""
    deadline = time.monotonic() + STACKS_GRACE
    for pid in sorted(_job_members(tag), reverse=True):
        with contextlib.suppress(OSError):  # (gone meanwhile)
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
            os.kill(pid, signal.SIGABRT)
        while not _ended(pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def _read(file) -> str:
    """The whole of a file the job is still writing to (pread: our own offset stays put)."""
    return os.pread(file.fileno(), os.fstat(file.fileno()).st_size, 0).decode(errors="replace")


@dataclass
class Job:
    """A job while it runs, as a test that injects a fault sees it: its output so far and its processes."""
    tag: str
    start: float
    files: list  # one (stdout, stderr) pair of temporary files per node
    ended: threading.Event = field(default_factory=threading.Event)  # set once every launcher has exited

    def output(self) -> str:
        """What every node printed so far, stdout and stderr (the stages' output is unbuffered)."""
        return "".join(_read(f) for pair in self.files for f in pair)

    def members(self) -> list[int]:
        return _job_members(self.tag)


def run_job(cmds: list[list[str]], out: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 180.0, grace: float = 5.0, during: Callable[[Job], None] | None = None,
            cwd: Path = ROOT) -> Run:
    """Run one command per node under one deadline; `during(job)`, if given, runs alongside in a thread.

    At the deadline every process of the job prints its Python stacks to its stderr (print_stacks) and is killed
    (returncode None). Whatever outlives the launchers is reported in `survivors` and killed. stdout/stderr are node
    0's, then the others'.
    """
    start = time.monotonic()
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    # Files, not pipes: a pipe would need reading while the job runs, and `during` reads the output too.
    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in cmds]
    procs = [subprocess.Popen(cmd, cwd=cwd, env=clean_env({**(env or {}), JOB_TAG: tag}), stdout=o, stderr=e,
                              start_new_session=True) for cmd, (o, e) in zip(cmds, files, strict=True)]
    job = Job(tag, start, files)
    watcher = threading.Thread(target=during, args=(job,), daemon=True) if during else None
    if watcher:
        watcher.start()
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=None if timed_out else max(0.0, start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            print_stacks(tag)  # where each process waited, in its stderr
            _kill_job(tag)  # launchers and workers: torchrun's workers live in sessions of their own
            proc.wait()
    job.ended.set()
    codes = [p.returncode for p in procs]
    returncode = None if timed_out else next((c for c in codes if c != 0), 0)
    # Helpers such as multiprocessing's resource tracker leave on their own just after the
    # launcher (~20 ms here): give the job a bounded grace period to end before judging it.
    deadline = time.monotonic() + grace
    while (survivors := _job_members(tag)) and time.monotonic() < deadline:
        time.sleep(0.02)
    _kill_job(tag)
    seconds = time.monotonic() - start
    if watcher:
        watcher.join(timeout=grace)
    stdout, stderr = ("".join(_read(pair[i]) for pair in files) for i in (0, 1))
    for pair in files:
        for f in pair:
            f.close()
    return Run([" ".join(c) for c in cmds] if len(cmds) > 1 else cmds[0], returncode, stdout, stderr,
               seconds, out, survivors)


def save_run(run: Run, step: Step, out: Path) -> None:
    """Write out/run.json beside the run's own files: which step it was, the command, its exit and what it printed."""
    record = {"stage": step.stage, "launcher": step.launcher, "label": step.label, "step": step.spec(), "cmd": run.cmd,
              "returncode": run.returncode, "seconds": run.seconds, "survivors": run.survivors,
              "stdout": run.stdout, "stderr": run.stderr}
    (out / "run.json").write_text(json.dumps(record, indent=1))


def load_run(out: Path) -> tuple[dict, Run]:
    """A run that save_run() recorded (the tour's --out): (its record, the Run as run_job returned it)."""
    r = json.loads((out / "run.json").read_text())
    return r, Run(r["cmd"], r["returncode"], r["stdout"], r["stderr"], r["seconds"], out, r["survivors"])


def run_command(cmd: list[str], out: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 180.0, grace: float = 5.0) -> Run:
    """Run one command in its own process group (see run_job)."""
    return run_job([cmd], out, env, timeout, grace)


def slurm_missing() -> str | None:
    """Why the local Slurm cluster cannot run here, or None if it can."""
    missing = [p for p in ("slurmctld", "slurmd", "sbatch", "squeue", "munged") if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)})"
    return "the local Slurm cluster needs root" if os.geteuid() != 0 else None


# The caller's own Slurm variables (tests run inside an allocation, say) must not reach the local cluster.
SLURM_CALLER_ENV = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "TORCHELASTIC_")


def run_slurm_command(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 30.0) -> Run:
    """A Slurm client or slurm/local_cluster.sh call (returncode None: killed at `timeout`).

    Not run_command: the daemons that `start` leaves running would count as survivors and be
    killed, and a job's processes belong to slurmd, not to this call.
    """
    start = time.monotonic()
    full_env = {k: v for k, v in clean_env().items() if not k.startswith(SLURM_CALLER_ENV)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**full_env, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        returncode = None
    return Run(cmd, returncode, stdout, stderr, time.monotonic() - start, None)


def run_slurm_job(nodes: int, train_args: list[str], out: Path, timeout: float) -> Run:
    """Start slurm/local_cluster.sh, submit slurm/train.sbatch as a reader would, wait, stop the cluster."""
    start_time = time.monotonic()
    state = Path(tempfile.mkdtemp(prefix="ddp-tour-slurm-"))  # directly in /tmp: munged checks its parents
    cluster = ["bash", str(ROOT / "slurm" / "local_cluster.sh")]
    env = {"SLURM_CONF": str(state / "slurm.conf")}
    try:
        started = run_slurm_command([*cluster, "start", str(state)], env, timeout=60)
        if started.returncode != 0:
            return started
        job_env = {**env, "REPO": str(ROOT), "TORCHRUN": " ".join(TORCHRUN), "NPROC_PER_NODE": "1",
                   "TRAIN_ARGS": " ".join([*train_args, "--out", str(out)]), "MASTER_PORT": str(free_port()),
                   "OMP_NUM_THREADS": "1"}  # the two "nodes" share this machine's cores
        cmd = ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={state}/job.out", "slurm/train.sbatch"]
        submitted = run_slurm_command(cmd, job_env, timeout=30)
        if submitted.returncode != 0:
            return submitted
        job = submitted.stdout.strip().split(";")[0]
        while run_slurm_command(["squeue", "-h", "-j", job], env, timeout=30).stdout.strip():  # listed until it ends
            if time.monotonic() - start_time > timeout:
                run_slurm_command(["scancel", job], env, timeout=30)
                return Run(cmd, None, "", f"job {job} did not finish in {timeout:.0f}s", timeout, out)
            time.sleep(0.5)
        log = (state / "job.out").read_text() if (state / "job.out").exists() else "(no job log)"
        done = (out / "summary.json").exists()
        return Run(cmd, 0 if done else 1, log, "" if done else "the job wrote no summary",
                   time.monotonic() - start_time, out)
    finally:
        run_slurm_command([*cluster, "stop", str(state)], env, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def max_gap(ours: list, theirs: list) -> float:
    """Largest |difference| between two lists of tensors, pair by pair (two models' parameters, say)."""
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |difference| between two state_dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(a)} vs {sorted(b)}")
    return max_gap([a[k] for k in a], [b[k] for k in a])


@functools.cache
def load_stage(stage: str | Path) -> ModuleType:
    """Import a stage's train.py as a module (its work is in functions, so importing runs nothing).

    A stage ("04_ddp_torchrun"), a recipe ("recipes/grad_accumulation") or a folder elsewhere: a folder holding
    train.py.
    """
    folder = ROOT / stage
    return import_script(folder / "train.py",
                         f"stage_{folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder.name}")


def import_script(path: Path, name: str) -> ModuleType:
    """Import the script `path` as the module `name`, and the files beside it that it imports as its own.

    A GPT stage's train.py imports the files beside it by their plain names (`from model import GPT`, as
    `python 11_gpt/train.py` finds them), and two stages hold files of the same names: each is imported here as its
    stage's own (`stage_11_gpt.model`), never found under the plain name by the next stage loaded.
    """
    folder, name = path.parent, name.replace("/", "_")
    siblings = {p.stem for p in folder.glob("*.py")} - {path.stem}
    hidden = {s: sys.modules.pop(s) for s in siblings if s in sys.modules}  # another stage's, or a test's
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect.getsource() finds classes through sys.modules
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
        for sibling in siblings:
            if (own := sys.modules.pop(sibling, None)) is not None:  # under its stage's name, its classes too
                own.__name__ = f"{name}.{sibling}"
                sys.modules[own.__name__] = own
                for value in vars(own).values():
                    if isinstance(value, type) and value.__module__ == sibling:
                        value.__module__ = own.__name__
        sys.modules.update(hidden)
    files = [sys.modules[f"{name}.{sibling}"] for sibling in sorted(siblings) if f"{name}.{sibling}" in sys.modules]

    def beside(attr: str):  # stage.X for an X defined in another of its files (module __getattr__, PEP 562)
        for own in files:
            if attr in vars(own):
                return vars(own)[attr]
        raise AttributeError(f"{folder.name} has no {attr!r} in train.py or the files beside it")
    if files:
        module.__getattr__ = beside
    return module


def tolerance(dtype: str) -> float:
    """sqrt(eps) of the dtype: far above one epoch's rounding, far below what any bug changes (README)."""
    import torch
    return torch.finfo(getattr(torch, dtype)).eps ** 0.5


def replay_error(summary: dict, trajectory: list[dict]) -> float:
    """How far a run's recorded epochs are from stage 01's code replaying each of them.

    For every epoch the run recorded, stage 01's own Trainer starts from the run's weights and
    momentum before it, trains that epoch on the CPU, and is compared with the run's state after it.
    A run with AdamW (zero_by_hand/, summary "optimizer") is replayed with stage 01's code and
    torch's AdamW at the run's settings, from its moments and step count.
    A stage that computes stage 01's training differs by one epoch's rounding, however long it
    trained (final weights can drift much further: training amplifies rounding). A stage that
    computes something else (another order, batch, average or start) differs at once.
    """
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and fair to whatever else runs
    try:
        return _replay_error(load_stage("01_single_gpu"), summary, trajectory)
    finally:
        torch.set_num_threads(threads)


def _replay_error(s01: ModuleType, summary: dict, trajectory: list[dict]) -> float:
    import torch
    args = argparse.Namespace(seed=summary["seed"], lr=summary["lr"], dtype=summary["dtype"],
                              batch_size=summary["global_batch"])
    cpu = torch.device("cpu")
    train_set, _, model, optimizer = s01.load_train_objs(args, cpu)
    if summary.get("optimizer", "SGD") == "AdamW":  # stage 01's model and loop, torch's AdamW in place of its SGD
        settings = summary["adamw"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=summary["lr"], betas=tuple(settings["betas"]),
                                      eps=settings["eps"], weight_decay=settings["weight_decay"])
    loader = s01.prepare_dataloader(train_set, args.batch_size)
    if summary.get("epoch_samples", len(train_set)) != len(train_set):  # the ranks did not share the data evenly
        order = epoch_order(len(train_set), summary["epoch_samples"])
        loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=order)
    trainer = s01.Trainer(model, loader, optimizer, cpu, args.seed)
    params = list(model.parameters())
    # A run from scratch must start where stage 01 starts, exactly.
    worst = max_gap(params, trajectory[0]["params"]) if trajectory[0]["epoch"] == 0 else 0.0
    for before, after in itertools.pairwise(trajectory):
        restore_state(params, optimizer, before)
        trainer._run_epoch(before["epoch"])
        worst = max(worst, state_gap(params, optimizer, after))
    return worst


def epoch_order(n: int, samples: int):
    """A sampler: stage 01's order of an epoch (torch.randperm(n) from the generator its Trainer reseeds), cut or
    lengthened to `samples` as DistributedSampler does where the ranks cannot share n samples evenly: it repeats the
    first ones (padding), or with drop_last leaves out the last. Replaying with it checks that a stage at W = 3 computes
    exactly stage 01's training on that order, which the stage says before training."""
    import torch
    from torch.utils.data import Sampler

    class Order(Sampler):
        def __init__(self) -> None:
            self.generator = torch.Generator()

        def __len__(self) -> int:
            return samples

        def __iter__(self):
            order = torch.randperm(n, generator=self.generator).tolist()
            return iter((order * -(-samples // n))[:samples])

    return Order()


def restore_state(params: list, optimizer, state: dict) -> None:
    """Set the weights and the optimizer's state to a recorded state_of() (fresh copies): SGD's momentum, or
    AdamW's two moments and step count."""
    import torch
    with torch.no_grad():
        for p, w in zip(params, state["params"], strict=True):
            p.copy_(w)
    optimizer.state.clear()
    for i, p in enumerate(params):
        if "exp_avg" in state and state["step"] is not None:
            optimizer.state[p] = {"step": torch.tensor(float(state["step"])), **{
                key: state[key][i].clone() for key in ("exp_avg", "exp_avg_sq")}}
        elif "momentum" in state and state["momentum"][i] is not None:
            optimizer.state[p]["momentum_buffer"] = state["momentum"][i].clone()


def state_gap(params: list, optimizer, state: dict) -> float:
    """Largest |difference| from a recorded state_of(): the weights and SGD's momentum or AdamW's moments (and
    AdamW's step count, which must be equal: infinity if not)."""
    keys = ("exp_avg", "exp_avg_sq") if "exp_avg" in state else ("momentum_buffer",)
    if "exp_avg" in state and any(int(optimizer.state[p]["step"]) != state["step"] for p in params):
        return math.inf
    return max(max_gap(params, state["params"]),
               *(max_gap([optimizer.state[p][key] for p in params], state[key if key in state else "momentum"])
                 for key in keys))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tools.cli import ArgumentParser, positive  # one-line errors, shared with the tools (tools/ is beside tour.py)

    p = ArgumentParser(prog="tour.py", description="Run every stage and check that each computes stage 01's training.")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="precision of every run: float64 (default) makes rounding too small to hide a bug")
    p.add_argument("--epochs", type=positive(int), default=EPOCHS,
                   help=f"epochs per stage (default {EPOCHS}: every one is replayed; the stages' own default is 20)")
    p.add_argument("--batch-size", type=positive(int), default=32, help="per-process batch b of the distributed stages")
    p.add_argument("--lr", type=positive(float), help="every stage's learning rate (default: the stages' own, 0.05)")
    p.add_argument("--seed", type=int, help="every stage's seed: data, initial weights, order (default: 0)")
    p.add_argument("--timeout", type=positive(float), default=300.0,
                   help="seconds one stage may take before it is killed (each of its processes first prints where "
                        "it waited: its Python stacks)")
    p.add_argument("--out", type=Path,
                   help="keep every run's files in OUT/<row>-<stage>-<launcher>/: its summary.json, model.pt, "
                        "trajectory.pt and run.json (the command and what it printed); default: a temporary "
                        "directory, removed at the end")
    args = p.parse_args(argv)
    if args.out is not None:
        p.check_out_writable(args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = visible_gpus(args.device)
    world = tour_world(gpus)
    steps = plan(world, args.batch_size, args.epochs, args.device, args.dtype, gpus, args.lr, args.seed)
    tol = tolerance(args.dtype)
    print(f"tour: stages 01-{steps[-1].stage[:2]}, world size {world}, batch {args.batch_size} per process "
          f"= {world * args.batch_size} global, {args.epochs} epochs, {args.dtype}"
          + (f", lr {args.lr:g}" if args.lr is not None else "")
          + (f", seed {args.seed}" if args.seed is not None else "") + f"; {where(gpus, world)}\n", flush=True)

    # Stage 05 once more, as a Slurm job on a local two-node cluster, where Slurm is installed.
    slurm_skip = slurm_missing() or ("the local Slurm cluster runs on the CPU only" if gpus >= 2 else None)
    slurm_args = ("--device", "cpu" if gpus else args.device, "--dtype", args.dtype,
                  *training_args(args.epochs, args.lr, args.seed),
                  "--batch-size", str(args.batch_size))
    slurm_step = Step("05_multinode", "sbatch", slurm_args, label=f"sbatch, {world} Slurm nodes")
    runs = [*steps, slurm_step] if slurm_skip is None else steps

    rows, reference, failed, drift, worst = [], None, False, 0.0, 0.0
    with contextlib.ExitStack() as stack:
        base = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddp-tour-")))
        for i, step in enumerate(runs):
            print(f"[{i + 1}/{len(runs)}] {step.stage} via {step.label} ...", end=" ", flush=True)
            out = base / f"{i + 1:02d}-{step.stage}-{step.launcher}"
            shutil.rmtree(out, ignore_errors=True)  # nothing left over from an earlier tour
            out.mkdir()
            if step.launcher == "sbatch":
                run = run_slurm_job(world, list(step.args), out, timeout=args.timeout)
            else:
                run = run_job(step.commands(out=out), out, step.env, timeout=args.timeout)
            save_run(run, step, out)
            if run.returncode != 0:
                print(f"FAILED\n{run.describe()}")
                failed = True
                continue
            s, model = run.summary, run.model
            reference = reference if reference is not None else model
            diff, replay = max_abs_diff(reference, model), replay_error(s, run.trajectory)
            failed |= replay > tol
            drift, worst = max(drift, diff), max(worst, replay)
            print(f"done in {run.seconds:.1f}s", flush=True)
            rows.append((step.stage, step.label, str(s["world_size"]), f"{s['backend'] or '-'}/{s['device']}",
                         f"{s['losses'][-1]:.4f}", f"{s['eval_accuracy']:.2%}", f"{diff:.1e}", f"{replay:.1e}",
                         f"{s['seconds']:.1f}", f"{run.seconds:.1f}"))

    header = ("stage", "launcher", "world", "backend/device", "train loss", "held-out acc", "max|Δw| vs 01",
              "epoch replay", "train s", "wall s")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    print()
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if slurm_skip:
        print(f"\n(no Slurm run: {slurm_skip}; see slurm/README.md)")
    if drift > tol and not failed:
        print(f"\nThe final weights drifted up to {drift:.1e} apart while every epoch replays to ≤ {worst:.1e}: "
              f"training amplified {args.dtype} rounding (README: \"Same weights, up to rounding\").")
    verdict = ("FAILED: see above" if failed else
               f"every stage computed stage 01's training: each epoch replays with stage 01's code to "
               f"≤ {tol:.1e} ({args.dtype} tolerance); only the split of the work changed")
    print(f"\n{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
