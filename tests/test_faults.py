"""The fault battery: every stage, the faults users meet, injected from outside the scripts.

Each case states the fault, the exit status it must end with, a bound on the time from the fault
to the end of the whole job, and a fragment of the message; every case also checks that no process
of the job is left running. The bound is what the case configured (a --timeout, a rendezvous timeout, the
launcher's SIGTERM-to-SIGKILL grace, read from torch) plus a margin measured in the same run: a few times the
slowest start-up of a trivial launch (`python -c "import torch"`) timed among the cases, under their load. So a
slower or busier machine loosens the bounds in proportion, and a case that waits for something it did not
configure (a default timeout, a hang) still fails. The faults are real: signals sent to a worker, a port another
process holds, a node that never comes, a read-only or full disk, bad files and bad values. The stages carry no
test hooks.

The cases run concurrently, once per session: most of their time is spent waiting for a timeout.

Bad values (every flag of every stage, recipe and tool has one) are checked in this process, by calling the
script's parse_args(): every check of a value is there, and main() calls it before anything else
(test_main_checks_values_before_anything_else); a tool that parses in main() runs main() itself, stopped where its
checks end (main_until_checked). Launching the script for each would spend ~3 s of CPU importing torch, ~300
times. One bad value per stage and tool is still launched for real, proving the script refuses in one line and
exit 2 before training. Bad snapshot files are checked in main() too, before it joins a process group: each kind
runs main() in this process up to that point (test_bad_snapshot_...), and one kind per stage is launched for real.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch

import harness
from conftest import CONFIGS
from harness import (
    PROBE,  # a trivial launch: the start-up every case pays at least once
    PROBE_LIMIT,
    RECIPES,
    ROOT,
    STAGES,
    TORCHRUN,
    Fault,
    Job,
    Run,
    Step,
    attempt_workers,
    check,
    clean_env,
    free_port,
    launch,
    launch_commands,
    load_copy,
    load_stage,
    mutate,
    selected,
    with_args,
)

DDP_STAGES = [s for s in STAGES if s >= "03" and s[:2] in CONFIGS]  # killed as the tour runs them
SNAPSHOT_STAGES = ["06_checkpoint", "07_model_parallel"]  # --snapshot is a file
# The bad-snapshot and full-disk cases run on 06 and 08 alone: 07 and 09 handle snapshots with 06's and 08's code
# (test_repo.SHARED_SNAPSHOT_CODE), and each case launches a process (~4 CPU-s).
SNAPSHOT_STAGE = "06_checkpoint"
CHECKPOINT_STAGE = "08_fsdp"  # --snapshot is a directory of shards (torch.distributed.checkpoint)
CHECKPOINT_STAGES = [CHECKPOINT_STAGE, "09_tensor_parallel"]  # 09 keeps 08's checkpoints
GPT_STAGE = "11_gpt"  # a directory of shards too, but its own checks (steps, not epochs; the model's shape)
# A tiny GPT (one block of width 16 reading 16 characters): its cases cost what a launch costs, not training.
GPT_TINY = ("--device", "cpu", "--layers", "1", "--heads", "1", "--width", "16", "--context", "16", "--sample", "0")
# The checkpoint's settings; its learning rate decays over the 4 steps of the runs that resume it.
GPT_SETTINGS = (*GPT_TINY, "--batch-size", "2", "--save-every", "2", "--eval-every", "2", "--lr", "0.002",
                "--decay-steps", "4")
GPT_STEPS = 2  # steps in the checkpoint the bad-snapshot cases spoil (one process)
# Killed and stalled as the stages are: 2 processes under torchrun, a log line every step, told to run far longer.
GPT_FAULT = Step(GPT_STAGE, "torchrun", (*GPT_TINY, "--batch-size", "2", "--eval-every", "1", "--max-steps",
                                         "1000000"), nproc=2)
CP_STAGE = "12_context_parallel"
# Stage 12 as cp 2: every sequence split over the two ranks, whose ring attention waits on the other's keys and
# values inside every block's forward and backward (P2P on the cp group, not a collective of the world's).
CP_FAULT = Step(CP_STAGE, "torchrun", (*GPT_FAULT.args, "--cp", "2"), nproc=2)
GPT_FAULTS = {GPT_STAGE: GPT_FAULT, CP_STAGE: CP_FAULT}  # the job each GPT stage is killed or stalled in
PP_STAGE = "13_pipeline_4d"  # 12 with pp: its cp stalls and dies as 12's does (the same code), its pipeline is new
# Stage 13 as pp 2 alone, stalled apart from cp: rank 1 is the second pipeline stage, and rank 0's one wait on it is
# a receive on the pp group (grid.py's; with cp too, the cp group's timeout would end the job first).
PP_FAULT = Step(PP_STAGE, "torchrun", (*GPT_FAULT.args, "--layers", "2", "--pp", "2", "--parallel", "fsdp",
                                       "--accumulate", "2"), nproc=2)
EP_STAGE = "14_experts"  # 13 with experts: killed as ep 2, whose ranks wait on each other in every block's all-to-all
EP_FAULT = Step(EP_STAGE, "torchrun", (*GPT_FAULT.args, "--ep", "2"), nproc=2)
GPT_FAULTS[EP_STAGE] = EP_FAULT  # (killed only: its stalls are a collective's, as 11's)
GPT_FAULT_AFTER = {"after": "| train loss", "longer": ()}  # signalled() after its first step's line
TIMEOUT = 5  # --timeout in the stall cases: how long the healthy ranks wait for the stalled one
# The GPT stages' (11-, 12-stalled-rank, 13-stalled-stage): --timeout also bounds the start-up's store waits, and the
# (pp, dp x cp, tp) grid's groups once took longer than 5 s to make under CI's load (13: 1 of 3 runs; 11: its ranks
# joined more than 5 s apart, DistStoreError in init_process_group, 1 of ~10 runs).
GPT_TIMEOUT = 20
RENDEZVOUS_TIMEOUT = 10  # how long the lone node's agent waits for the other node
# The margin, in start-ups of a trivial launch (PROBE) timed among the cases, the slowest of them: what a case does
# besides the waits it configured. Measured here (2 cores shared with other jobs, a start-up 10-18 s among the
# cases), in start-ups: a case timed from the fault pays exits only (the healthy ranks', the agents'): at most 0.9
# (05's killed rank: both nodes' agents leave); a case timed from its start pays its launch too: at most 2.5 (the
# refusals of 10 and 11, whose imports are the heaviest; 08's full disk, a start, an epoch and a failed save: 2.3).
# More than twice each. A case that waits for something it did not configure (a timeout left at its default, a
# rendezvous longer than it set) exceeds them: seen with 04's --timeout made 10 times longer, a lone node's 5 times.
AFTER_FAULT_STARTUPS = 2
FROM_START_STARTUPS = 6
# A launch's time limit (the job is killed, the case fails as hung): its waits plus this many start-ups, timed
# alone just before the cases. A whole case is a few start-ups (the launcher's, then its workers', an epoch, the
# exits), each up to 3 times slower among the cases than alone: 40 leaves room for twice that, and still ends a
# hang within minutes.
HANG_STARTUPS = 40
# Cases launched at once. The stalls and lone nodes mostly wait, so 6 keeps the 2 cores busy with the rest:
# the battery took 2m02 with 4, 1m38 with 6, 1m46 with 8 here (2 cores, shared).
POOL = 6
POLL = 0.02  # how often a watcher reads the job's output (harness.Fault's pace too)


@dataclass
class Pace:
    """How long a trivial launch (PROBE) takes here and now: the unit of every margin and time limit."""
    before: float  # timed before this module launches anything (the slower of two)
    among: list[float] = field(default_factory=list)  # timed among the cases, under their load

    @property
    def startup(self) -> float:
        """The slowest start-up among the cases (the margins' unit): what they met. (Before them: none were timed.)"""
        return max(self.among or [self.before])

    def margin(self, startups: float) -> float:
        return startups * self.startup

    def limit(self, waits: float = 0.0) -> float:
        """A launch's time limit: only a hang (or a wait nobody configured) reaches it."""
        return waits + HANG_STARTUPS * self.before

    def describe(self, startups: float) -> str:
        return (f"margin {self.margin(startups):.1f}s = {startups:g} x the slowest start-up of "
                f"`{' '.join(PROBE[1:])}` this run ({self.before:.1f}s before the cases, "
                f"{', '.join(f'{t:.1f}' for t in self.among)}s among them)")


def startup() -> float:
    """Seconds of one trivial launch, as the cases launch (harness: its own process group, bounded in time)."""
    return launch_commands([list(PROBE)], timeout=PROBE_LIMIT).seconds


def launcher_grace(launcher: str) -> float:
    """How long the launcher waits, after SIGTERM, for a failed job's other workers to leave before SIGKILL.

    Read from torch. torchrun: once a worker has failed, its agent's _invoke_run calls _stop_workers, which calls
    LocalElasticAgent._shutdown() without a timeout: its default (--shutdown-timeout only applies when the agent
    itself is signalled). mp.spawn: ProcessContext.join() without a grace_period waits a fixed time after SIGTERM.
    A stopped (SIGSTOP) worker cannot obey SIGTERM, so a stall always costs this wait: test_fault checks that the
    stalls took at least this long, so a torch that changed the wait (or where it is read) fails there.
    """
    if launcher == "torchrun":
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        return float(inspect.signature(LocalElasticAgent._shutdown).parameters["timeout"].default)
    source = inspect.getsource(torch.multiprocessing.ProcessContext.join)
    found = re.search(r"_join_procs_with_timeout\((\d+) if grace_period is None", source)
    assert found, "torch.multiprocessing.ProcessContext.join no longer waits a fixed time after SIGTERM"
    return float(found.group(1))


class Seen:
    """Passed to launch(during=...): notes when the job first printed `text`, as two times after its start: the last
    look that did not see it and the first that did (it was printed between the two)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.before: float | None = None
        self.at: float | None = None

    def __call__(self, job: Job) -> None:
        while True:
            ended = job.ended.is_set()  # before the look: a job that ended has printed everything it will
            now = time.monotonic() - job.start
            if self.text in job.output():
                self.at = time.monotonic() - job.start
                return
            if ended:
                return
            self.before = now
            time.sleep(POLL)


@dataclass
class Place:
    """What the cases need on disk, made once."""
    tmp: Path
    a_file: Path  # a regular file: nothing can be created "under" it
    read_only: Path | None  # a directory on a read-only mount (None: cannot be made here)
    good_snapshot: bytes  # stage 06 after 1 epoch, batch 64, one process
    good_checkpoint: Path | None  # stage 08's checkpoint directory after 1 epoch, batch 64, one process
    payload_marker: Path  # the pickle payload would create this file
    # A fresh tiny disk holding the stage's good snapshot (or checkpoint) and no room for another; None: cannot mount.
    full_disk: Callable[[str], Path] | None
    pace: Pace | None = None  # launches' time limits (None: nothing is launched)
    gpt_checkpoint: Path | None = None  # stage 11's checkpoint directory (GPT_SETTINGS, GPT_STEPS steps)


@dataclass
class Outcome:
    run: Run
    seconds: float  # from the fault (as soon as it was seen) to the end of the job: at most the true time
    facts: dict = field(default_factory=dict)  # what the message must mention, e.g. the port
    unseen: float = 0.0  # how much earlier the fault may have happened than `seconds` counts from


@dataclass(frozen=True)
class Case:
    id: str
    stage: str
    fault: str
    status: int | None  # the exit status; None: any non-zero status
    waits: float  # seconds, from the fault to the end of the job, that the case configured; the margin is added
    message: str  # must appear in the output; formatted with Outcome.facts
    start: Callable[[Place], Outcome]
    at_least: float = 0.0  # the job must also take this long after the fault: a wait it must really have waited
    from_start: bool = False  # the fault is there at the start: timed from it, the launch's own start-up included
    one_line: bool = False  # the script refuses in exactly one stderr line, before training
    also: Callable[[Outcome, Place], None] | None = None  # further checks (the file is untouched, ...)
    needs: str | None = None  # a Place attribute that must exist, e.g. "read_only"


# --- how each kind of fault is started --------------------------------------------------------------------

def with_place(args: tuple[str, ...], place: Place) -> tuple[str, ...]:
    return tuple(a.format(file=place.a_file, ro=place.read_only, tmp=place.tmp, run=place.tmp / "a_run")
                 for a in args)


def started_with(stage: str, *args: str, env: dict[str, str] | None = None) -> Callable[[Place], Outcome]:
    """A fault present at start: a bad value, an unwritable path. Timed from the start."""
    def go(place: Place) -> Outcome:
        run = launch(Step(stage, "python", with_place(args, place)), script=path_of(stage),
                     timeout=place.pace.limit(), env=env)
        return Outcome(run, run.seconds)
    return go


def signalled(stage: str, signum: int, *args: str, step: Step | None = None, waits: float = 0.0,
              after: str = "epoch 1/", longer: tuple[str, ...] = ("--epochs", "200"),
              tag: str = "") -> Callable[[Place], Outcome]:
    """`signum` sent to rank 1 once the job has printed `after` (the first epoch's line), the job told to run far
    longer (`longer`). `waits`: what the case configured after the fault, for the job's time limit. `tag`: told
    apart from the stage's other case with this signal (its run's directory)."""
    def go(place: Place) -> Outcome:
        base = with_args(step or CONFIGS[stage[:2]], *longer)
        limit = place.pace.limit(waits)
        fault = Fault(signum, rank=1, after=after, limit=limit)
        out = place.tmp / f"{stage}-{signal.Signals(signum).name}{tag}"
        run = launch(with_args(base, *args), out, timeout=limit, during=fault)
        return Outcome(run, fault.seconds_to_end(run))
    return go


def port_taken(stage: str) -> Callable[[Place], Outcome]:
    """Another process listens on the port the job is told to use."""
    def go(place: Place) -> Outcome:
        with socket.socket() as holder:
            holder.bind(("", 0))
            holder.listen()
            port = holder.getsockname()[1]
            if stage == "03_ddp_spawn":  # mp.spawn: the port comes from MASTER_PORT
                run = launch(Step(stage, "python", ("--device", "cpu")), timeout=place.pace.limit(),
                             env={"MASTER_PORT": str(port)})
            else:  # torchrun: --master_port
                nodes = "--nnodes=2 --node_rank=0" if stage == "05_multinode" else "--nnodes=1 --nproc_per_node=2"
                run = launch_commands([[*TORCHRUN, *nodes.split(), "--master_addr=127.0.0.1",
                                        f"--master_port={port}", f"{stage}/train.py", "--device", "cpu"]],
                                      timeout=place.pace.limit())
        return Outcome(run, run.seconds, {"port": port})
    return go


# What torchrun's agent logs (with LOGLEVEL=INFO) just before it starts waiting for the other nodes.
RENDEZVOUS_STARTS = "Rendezvous'ing worker group"


def lone_node(rendezvous: str) -> Callable[[Place], Outcome]:
    """Node 0 of 2 started alone, with a RENDEZVOUS_TIMEOUT: the other node never comes. Timed from the moment the
    agent says it starts waiting (its log line), not from the launch: torch's import is not the case's."""
    def go(place: Place) -> Outcome:
        port = free_port()
        if rendezvous == "static":
            how = ["--node_rank=0", "--master_addr=127.0.0.1", f"--master_port={port}",
                   f"--rdzv_conf=timeout={RENDEZVOUS_TIMEOUT}"]
        else:
            how = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=lonely",
                   f"--rdzv_conf=is_host=1,join_timeout={RENDEZVOUS_TIMEOUT}"]
        waiting = Seen(RENDEZVOUS_STARTS)
        run = launch_commands([[*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", *how, "05_multinode/train.py",
                                "--device", "cpu"]], env={"LOGLEVEL": "INFO"},
                              timeout=place.pace.limit(RENDEZVOUS_TIMEOUT), during=waiting)
        assert waiting.at is not None, f"the agent never logged {RENDEZVOUS_STARTS!r}\n{run.describe()}"
        return Outcome(run, run.seconds - waiting.at, unseen=waiting.at - (waiting.before or 0.0))
    return go


def bad_snapshot(stage: str, kind: str, place: Place, where: str) -> tuple[Path, tuple[str, ...]]:
    """A spoilt snapshot (06: a file) or checkpoint directory (08) of `kind` in a new folder `where`, and the
    arguments that resume from it."""
    folder = place.tmp / where
    folder.mkdir()
    if stage == CHECKPOINT_STAGE:
        return spoilt_checkpoint(kind, folder / "ck", place)
    if stage == GPT_STAGE:
        return spoilt_gpt_checkpoint(kind, folder / "ck", place)
    path = folder / "s.pt"
    write_bad_snapshot(kind, path, place)
    return path, ("--device", "cpu", "--epochs", "2", "--snapshot", str(path))


def snapshot_given(stage: str, kind: str) -> Callable[[Place], Outcome]:
    """The script launched on a spoilt snapshot: the whole path from the command line (in-process: the rest)."""
    def go(place: Place) -> Outcome:
        path, args = bad_snapshot(stage, kind, place, f"launched-{stage}-{kind}")
        before = contents(path)
        run = launch(Step(stage, "python", args), timeout=place.pace.limit())
        return Outcome(run, run.seconds, {"path": path, "before": before})
    return go


def disk_fills_up(stage: str) -> Callable[[Place], Outcome]:
    """Resume from the good snapshot (epoch 1) on a disk with no room for the next one."""
    def go(place: Place) -> Outcome:
        path = place.full_disk(stage)
        before = contents(path)
        run = launch(Step(stage, "python", ("--device", "cpu", "--epochs", "3", "--snapshot", str(path))),
                     timeout=place.pace.limit())
        return Outcome(run, run.seconds, {"path": path, "before": before})
    return go


def spoilt_checkpoint(kind: str, path: Path, place: Place) -> tuple[Path, tuple[str, ...]]:
    """Stage 08's good checkpoint directory copied to `path`, spoilt as `kind` (or resumed with other settings)."""
    shutil.copytree(place.good_checkpoint, path)
    (last,) = path.iterdir()  # epoch_0001
    settings: tuple[str, ...] = ()
    if kind == "truncated":
        shard = last / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "missing":
        (last / "__0_0.distcp").unlink()
    elif kind == "foreign":  # a directory holding something else: stage 06's snapshot file
        shutil.rmtree(last)
        (path / "s.pt").write_bytes(place.good_snapshot)
    elif kind == "payload":  # the metadata is a pickle, which dcp.load would unpickle as it is
        (last / ".metadata").write_bytes(pickle.dumps(Payload(str(place.payload_marker))))
    else:  # a good checkpoint, resumed with other settings
        settings = {"other_model": ("--hidden", "32"), "other_seed": ("--seed", "7"),
                    "other_dtype": ("--dtype", "float64")}[kind]
    return path, ("--device", "cpu", "--epochs", "2", "--snapshot", str(path), *settings)


def spoilt_gpt_checkpoint(kind: str, path: Path, place: Place) -> tuple[Path, tuple[str, ...]]:
    """Stage 11's good checkpoint directory copied to `path`, spoilt as `kind` (or resumed with other settings); the
    arguments resume it to twice its steps. "good": as it was, resumed with its own settings (the control)."""
    shutil.copytree(place.gpt_checkpoint, path)
    (last,) = path.iterdir()  # step_000002: its shards, .metadata and progress.json (steps, losses, settings)
    settings: tuple[str, ...] = ()
    if kind == "truncated":
        shard = last / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "missing":
        (last / "__0_0.distcp").unlink()
    elif kind == "foreign":  # a directory that also holds something else: stage 06's snapshot file
        (path / "s.pt").write_bytes(place.good_snapshot)
    elif kind == "payload":
        (last / ".metadata").write_bytes(pickle.dumps(Payload(str(place.payload_marker))))
    elif kind == "no_progress":
        (last / "progress.json").unlink()
    elif kind == "progress_not_json":
        (last / "progress.json").write_text('{"steps": 2, ')
    elif kind == "progress_of_another":  # JSON, but not this stage's: another tool's record
        (last / "progress.json").write_text(json.dumps({"epochs_run": 1, "losses": [2.0]}))
    elif kind != "good":
        settings = {"other_model": ("--width", "32"), "other_seed": ("--seed", "7"),
                    "other_batch": ("--batch-size", "4"), "other_dtype": ("--dtype", "float64"),
                    "other_schedule": ("--lr", "0.01")}[kind]
    return path, (*GPT_SETTINGS, "--max-steps", str(2 * GPT_STEPS), "--snapshot", str(path), *settings)


class Payload:
    """Unpickling this would create a file: proof that the code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def write_bad_snapshot(kind: str, path: Path, place: Place) -> None:
    good = place.good_snapshot
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "not_torch":
        path.write_bytes(b"this is not a snapshot\n")
    elif kind == "foreign":  # a torch file, but a plain state_dict (stage 01's model.pt), not a snapshot
        torch.save(load_stage("01_single_gpu").Net().state_dict(), path)
    elif kind == "payload":
        torch.save({"model": Payload(str(place.payload_marker))}, path)
    else:
        path.write_bytes(good)
        snapshot = torch.load(path, weights_only=True)
        if kind == "other_model":
            snapshot["model"] = {"layer.weight": torch.zeros(3, 3), "layer.bias": torch.zeros(3)}
        elif kind == "other_dtype":  # float64 weights would be cast to float32 silently: no exact resume
            snapshot["dtype"] = "float64"
        else:  # other_seed
            snapshot["seed"] = 7
        torch.save(snapshot, path)


def contents(path: Path) -> bytes | dict[str, bytes]:
    """A snapshot file's bytes, or every file of a checkpoint directory."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()} \
        if path.is_dir() else path.read_bytes()


def left_alone(outcome: Outcome, place: Place) -> None:
    untouched(outcome.facts["path"], outcome.facts["before"], place)


def untouched(path: Path, before: bytes | dict[str, bytes], place: Place) -> None:
    """The refused snapshot is as it was (`before`: its contents()), no pickled code ran, no half-save is left."""
    assert contents(path) == before, f"{path} was changed"
    assert not place.payload_marker.exists(), "the pickle payload ran"
    assert not list(path.parent.glob(path.name + ".tmp")), "a half-written snapshot was left behind"
    assert not (path.is_dir() and list(path.glob("*.tmp"))), "a half-written checkpoint was left behind"


def one_line(script: str, stderr: str, start: str = "") -> bool:
    """The script refused in exactly one stderr line, its own: `<stage>/train.py: error: <start>...` (a tool: its
    own file's name)."""
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith(f"{path_of(script).relative_to(ROOT)}: error: {start}")


# --- the cases ------------------------------------------------------------------------------------------------

# The recipes' own flags; their contract flags are checked as in stage 04.
RECIPE_BAD_VALUES: dict[str, dict[tuple[str, ...], str]] = {
    "recipes/grad_accumulation": {("--accumulate", "0"): "--accumulate",  # (3 is fine: a short last step, exact)
                                  ("--sync-every-micro-batch=yes",): "--sync-every-micro-batch"},
    "recipes/uneven_inputs": {("--skew", "-1"): "--skew", ("--skew", "nan"): "--skew",
                              ("--no-join=1",): "--no-join", ("--divide-by", "all"): "--divide-by"},
    "recipes/mixed_precision": {("--autocast", "x"): "--autocast", ("--clip-grad-norm", "0"): "--clip-grad-norm",
                                ("--dtype", "float64"): "--dtype",  # autocast leaves float64 alone: no recipe left
                                **({} if torch.cuda.is_available() else {("--autocast", "float16"): "--autocast"})},
    "recipes/comm_hooks": {("--hook", "bf16"): "--hook", ("--powersgd-rank", "0"): "--powersgd-rank",
                           ("--powersgd-rank", "2"): "--powersgd-rank"},  # without --hook powersgd: it would do nothing
    "recipes/compile": {("--bucket-cap-mb", "0"): "--bucket-cap-mb", ("--bucket-cap-mb", "nan"): "--bucket-cap-mb"},
    "recipes/ddp_options": {("--static-graph=yes",): "--static-graph",
                            ("--gradient-as-bucket-view=1",): "--gradient-as-bucket-view"},
    "recipes/sync_batchnorm": {("--batchnorm", "x"): "--batchnorm", ("--device", "cpu"): "--device"},  # GPU-only
}


def bad_values(stage: str) -> dict[tuple[str, ...], str]:
    """{arguments: the flag the message must name} for every flag the stage has."""
    table = {
        ("--epochs", "-1"): "--epochs", ("--batch-size", "0"): "--batch-size", ("--lr", "nan"): "--lr",
        ("--seed", "x"): "--seed", ("--device", "tpu"): "--device", ("--dtype", "float16"): "--dtype",
        ("--out", "{file}/sub"): "--out", ("--out", "{ro}"): "--out",
    }
    if not torch.cuda.is_available():
        table[("--device", "cuda")] = "--device"
    if stage >= "03":
        table[("--timeout", "0")] = "--timeout"
    if stage == "03_ddp_spawn":
        table[("--world-size", "0")] = "--world-size"
    table |= RECIPE_BAD_VALUES.get(stage, {})
    if stage in SNAPSHOT_STAGES:
        table |= {("--save-every", "0"): "--save-every", ("--snapshot", "{file}/s.pt"): "--snapshot",
                  ("--snapshot", "{ro}/s.pt"): "--snapshot", ("--snapshot", "{tmp}"): "--snapshot"}
    if stage in CHECKPOINT_STAGES:  # a directory: a file given for it, or one that cannot be written
        table |= {("--save-every", "0"): "--save-every", ("--snapshot", "{file}"): "--snapshot",
                  ("--snapshot", "{file}/ck"): "--snapshot", ("--snapshot", "{ro}/ck"): "--snapshot",
                  ("--hidden", "0"): "--hidden", ("--hidden", "1.5"): "--hidden",
                  ("--no-reshard-after-forward=1",): "--no-reshard-after-forward"}
    if stage == "09_tensor_parallel":  # alone, a process is a world of 1: only --tp 1 divides it
        table |= {("--tp", "0"): "--tp", ("--tp", "x"): "--tp", ("--tp", "2"): "--tp"}
    if stage == "10_pipeline_parallel":  # alone, a world of 1 has one stage; 65 micro-batches of 64 leave one empty
        table |= {("--pp", "0"): "--pp", ("--pp", "2"): "--pp", ("--microbatches", "0"): "--microbatches",
                  ("--microbatches", "65"): "--microbatches", ("--schedule", "zb"): "--schedule"}
    if stage in ("11_gpt", CP_STAGE, PP_STAGE, EP_STAGE):  # a GPT on a text: --max-steps, its shape, the text
        del table[("--epochs", "-1")]
        table |= {("--max-steps", "0"): "--max-steps", ("--save-every", "0"): "--save-every",
                  ("--snapshot", "{file}"): "--snapshot", ("--snapshot", "{file}/ck"): "--snapshot",
                  ("--snapshot", "{ro}/ck"): "--snapshot", ("--parallel", "zero3"): "--parallel",
                  ("--tp", "0"): "--tp", ("--tp", "x"): "--tp", ("--tp", "2"): "--tp",  # a world of 1; and DDP
                  ("--accumulate", "0"): "--accumulate", ("--amp", "fp16"): "--amp",
                  ("--amp", "bf16", "--dtype", "float64"): "--amp",  # autocast leaves float64 alone
                  ("--compile=1",): "--compile", ("--ac", "partial"): "--ac", ("--data", "{file}/input.txt"): "--data",
                  ("--data", "{tmp}"): "--data",  # a directory
                  ("--context", "0"): "--context", ("--context", "200000"): "--context",  # longer than the text
                  ("--layers", "0"): "--layers", ("--heads", "0"): "--heads", ("--heads", "3"): "--heads",
                  ("--width", "0"): "--width", ("--eval-every", "0"): "--eval-every", ("--sample", "-1"): "--sample",
                  ("--sample", "x"): "--sample", ("--clip", "-1"): "--clip", ("--warmup-steps", "0"): "--warmup-steps",
                  ("--decay-steps", "0"): "--decay-steps",
                  ("--warmup-steps", "20", "--max-steps", "10"): "--warmup-steps"}  # a warm-up past the decay's end
    if stage in ("11_gpt", CP_STAGE, PP_STAGE, EP_STAGE):  # --sp splits the sequence over tp: without --tp (here 1)
        table |= {("--sp",): "--sp"}  # there is nothing to split it over
    if stage in ("11_gpt", CP_STAGE, PP_STAGE, EP_STAGE):  # HSDP: FSDP2's replicas (here with DDP, and in a world of 1)
        table |= {("--replicate", "0"): "--replicate", ("--replicate", "x"): "--replicate",
                  ("--replicate", "2"): "--replicate"}
    if stage in (CP_STAGE, PP_STAGE, EP_STAGE):  # alone, a world of 1: only --cp 1 divides it
        table |= {("--cp", "0"): "--cp", ("--cp", "x"): "--cp", ("--cp", "2"): "--cp",
                  ("--cp-impl", "torch"): "--cp-impl", ("--no-zigzag=1",): "--no-zigzag"}
    if stage in (PP_STAGE, EP_STAGE):  # and only --pp 1
        table |= {("--pp", "0"): "--pp", ("--pp", "2"): "--pp", ("--pp-schedule", "zb"): "--pp-schedule"}
    if stage in (PP_STAGE, EP_STAGE):  # virtual stages: a positive count, and a pipeline (--pp 2 or more) to cut
        table |= {("--stages-per-rank", "0"): "--stages-per-rank", ("--stages-per-rank", "2"): "--stages-per-rank"}
    if stage == EP_STAGE:  # and only --ep 1; k at most E
        table |= {("--experts", "0"): "--experts", ("--top-k", "0"): "--top-k", ("--top-k", "5"): "--top-k",
                  ("--ep", "0"): "--ep", ("--ep", "2"): "--ep", ("--ep", "x"): "--ep",
                  ("--capacity-factor", "0"): "--capacity-factor", ("--capacity-factor", "nan"): "--capacity-factor",
                  ("--aux-weight", "-1"): "--aux-weight", ("--balance", "all"): "--balance"}
    return table


# Scripts beside the stages with flags of their own: the pipeline written by hand, DDP written by hand and its tools,
# the benchmarks. Found on disk, so a new one fails test_every_flag_of_every_script_has_a_bad_value_case until its
# flags have cases. Checked in this process as the stages are: parse_args() for those that have one (main() starts
# with it), else main() itself, stopped where its checks end (main_until_checked).
TOOLS = sorted(str(p.relative_to(ROOT).with_suffix("")) for p in [ROOT / "10_pipeline_parallel" / "by_hand.py",
                                                                   *ROOT.glob("ddp_by_hand/*.py"),
                                                                   *ROOT.glob("zero_by_hand/*.py"),
                                                                   *ROOT.glob("benchmarks/*.py"),
                                                                   *ROOT.glob("at_scale/*.py"),
                                                                   *ROOT.glob("debugging/*.py")]
               if "__main__" in p.read_text())  # (at_scale/costs.py, hardware.py: modules, no flags)
PLAN = ("--model", "llama3-8b", "--gpus", "8", "--global-batch-tokens", "65536")  # plan.py's own flags, all good
# The flags every stage has, as the stages' own table gives them (without --device cuda, which depends on the machine).
CONTRACT = {args: flag for args, flag in bad_values("01_single_gpu").items() if args != ("--device", "cuda")}
TOOL_BAD_VALUES: dict[str, dict[tuple[str, ...], str]] = {
    "10_pipeline_parallel/by_hand": bad_values("10_pipeline_parallel"),  # stage 10's flags and checks, by hand
    "ddp_by_hand/naive": {**CONTRACT, ("--timeout", "0"): "--timeout"},
    "benchmarks/cp_memory": {("--tokens", "12"): "--tokens",  # 12: 8 must divide it (zigzag, cp up to 4)
                             ("--heads", "0"): "--heads", ("--head-size", "0"): "--head-size",
                             ("--timeout", "0"): "--timeout", ("--out", "{file}/sub"): "--out"},
    "benchmarks/cp_balance": {("--tokens", "0"): "--tokens", ("--tokens", "12"): "--tokens",  # 12: 8 must divide it
                              ("--repeats", "0"): "--repeats", ("--timeout", "0"): "--timeout"},
    "ddp_by_hand/bucketed": {**CONTRACT, ("--timeout", "0"): "--timeout", ("--bucket-mb", "0"): "--bucket-mb",
                             ("--first-bucket-mb", "nan"): "--first-bucket-mb"},
    **{f"zero_by_hand/{name}": {**CONTRACT, ("--timeout", "0"): "--timeout", ("--bucket-mb", "0"): "--bucket-mb",
                                ("--first-bucket-mb", "nan"): "--first-bucket-mb"} for name in ("zero1", "zero2")},
    "zero_by_hand/zero3": {**CONTRACT, ("--timeout", "0"): "--timeout"},
    "zero_by_hand/memory": {("--hidden", "0"): "--hidden", ("--layers", "0"): "--layers",
                            ("--batch-size", "0"): "--batch-size", ("--world-sizes", "0"): "--world-sizes",
                            ("--ways", "ZeRO-4"): "--ways", ("--lr", "0"): "--lr", ("--timeout", "0"): "--timeout",
                            ("--out", "{file}/sub"): "--out"},
    "zero_by_hand/vs_library": {("--world-sizes", "0"): "--world-sizes", ("--steps", "1"): "--steps",
                                ("--seed", "x"): "--seed", ("--timeout", "0"): "--timeout"},
    "ddp_by_hand/overlap": {("--hidden", "0"): "--hidden", ("--layers", "0"): "--layers",
                            ("--batch-size", "0"): "--batch-size", ("--bucket-mb", "1,1"): "--bucket-mb",
                            ("--bucket-mb", "0"): "--bucket-mb", ("--world-size", "0"): "--world-size",
                            ("--warmup", "1"): "--warmup",  # DDP rebuilds its buckets after step 1: 2 at least
                            ("--steps", "0"): "--steps", ("--rounds", "0"): "--rounds", ("--seed", "x"): "--seed",
                            ("--timeout", "0"): "--timeout", ("--out", "{file}/sub"): "--out"},
    "ddp_by_hand/vs_ddp": {("--world-sizes", "0"): "--world-sizes", ("--steps", "1"): "--steps",
                           ("--seed", "x"): "--seed", ("--timeout", "0"): "--timeout"},
    # Its arguments are folders of finished runs: one without a summary.json (a finished one, {run}, for the rest).
    "ddp_by_hand/compare_runs": {("{tmp}",): "runs", ("{run}", "--ddp", "{tmp}"): "--ddp"},
    "benchmarks/ddp_scaling": {("--models", "resnet"): "--models", ("--batches", "0"): "--batches",
                               ("--world-size", "1"): "--world-size", ("--mlp-width", "0"): "--mlp-width",
                               ("--sweep-batch", "0"): "--sweep-batch", ("--bucket-caps", "1,1"): "--bucket-caps",
                               ("--accumulate", "0"): "--accumulate", ("--steps", "-1"): "--steps",
                               ("--rounds", "0"): "--rounds", ("--budget", "inf"): "--budget",
                               ("--warmup", "0"): "--warmup", ("--seed", "x"): "--seed",
                               ("--out", "{file}/sub"): "--out", ("--timeout", "0"): "--timeout"},
    # Checked where it can run (TOOL_SETTINGS: 2 GPUs visible); --gpus 3 is more than are visible.
    "benchmarks/dp_vs_ddp": {("--batch-size", "-1"): "--batch-size", ("--epochs", "0"): "--epochs",
                             ("--gpus", "0"): "--gpus", ("--gpus", "3"): "--gpus", ("--out", "{file}/sub"): "--out",
                             ("--timeout", "0"): "--timeout"},
    "benchmarks/fsdp_memory": {("--worlds", "1,0"): "--worlds", ("--modes", "zero3"): "--modes",
                               ("--width", "250"): "--width",  # not a multiple of W = 4
                               ("--blocks", "0"): "--blocks", ("--batch", "0"): "--batch", ("--steps", "0"): "--steps",
                               ("--seed", "x"): "--seed", ("--out", "{file}/sub"): "--out",
                               ("--timeout", "0"): "--timeout"},
    "benchmarks/gpt_scaling": {("--quick=1",): "--quick", ("--steps", "3"): "--steps", ("--rounds", "0"): "--rounds",
                               ("--batch-size", "0"): "--batch-size", ("--out", "{file}/sub"): "--out",
                               ("--timeout", "0"): "--timeout"},
    "benchmarks/lr_scaling": {("--worlds", "3"): "--worlds",  # 3 x 32 does not divide 4096
                              ("--epochs", "5,x"): "--epochs", ("--seeds", "0"): "--seeds",
                              ("--batch-size", "0"): "--batch-size", ("--lr", "nan"): "--lr",
                              ("--out", "{file}/sub"): "--out"},
    "benchmarks/moe_quality": {("--quick=1",): "--quick", ("--out", "{file}/sub"): "--out",
                               ("--timeout", "0"): "--timeout"},
    "benchmarks/moe_traffic": {("--quick=1",): "--quick", ("--steps", "1"): "--steps",
                               ("--dtype", "bfloat16"): "--dtype", ("--out", "{file}/sub"): "--out",
                               ("--timeout", "0"): "--timeout"},
    # Its --out is required: given (a writable one) wherever the value checked is checked after parsing.
    "benchmarks/pipeline_bubble": {("--microbatches", "0,4"): "--microbatches",
                                   ("--microbatch-size", "0"): "--microbatch-size", ("--width", "0"): "--width",
                                   ("--layers", "0"): "--layers", ("--steps", "0"): "--steps",
                                   ("--layers", "1", "--out", "{tmp}/bubble"): "--layers",  # a stage with none
                                   ("--warmup", "-1", "--out", "{tmp}/bubble"): "--warmup",
                                   ("--figure-m", "3", "--out", "{tmp}/bubble"): "--figure-m",
                                   ("--out", "{file}/sub/bubble"): "--out"},
    "benchmarks/rounding": {("--epochs", "0"): "--epochs", ("--lrs", "0.05,-1"): "--lrs",
                            ("--dtypes", "float16"): "--dtypes", ("--batch-size", "48"): "--batch-size",
                            ("--seed", "x"): "--seed", ("--check-epochs", "0"): "--check-epochs",
                            ("--no-check=1",): "--no-check", ("--timeout", "0"): "--timeout",
                            ("--out", "{file}/sub"): "--out"},
    # Its layout is checked by stage 13's own parse_args at --world ranks (default 2; width 64, 4 heads, 2 layers).
    "at_scale/simulate": {("--layers", "0"): "--layers", ("--width", "0"): "--width",
                          ("--heads", "3"): "--heads",  # 3 does not divide the width
                          ("--context", "30", "--cp", "2"): "--context",  # zigzag cuts it into 4 chunks
                          ("--vocab", "0"): "--vocab", ("--world", "0"): "--world", ("--ac", "some"): "--ac",
                          ("--tp", "2"): "--tp",  # under DDP (tp runs with FSDP2)
                          ("--sp",): "--sp",  # without --tp: stage 13's own check
                          ("--pp", "3"): "--pp", ("--pp-schedule", "zb"): "--pp-schedule",
                          ("--pp-schedule", "zbv"): "--pp-schedule",  # a split backward: the memory tracker fails
                          ("--stages-per-rank", "2"): "--stages-per-rank",  # without --pp: stage 13's own check
                          ("--cp", "3"): "--cp", ("--parallel", "zero"): "--parallel",
                          ("--micro-batch", "0"): "--micro-batch", ("--accumulate", "0"): "--accumulate",
                          ("--rank", "2"): "--rank",  # not a rank of --world 2
                          ("--experts", "0"): "--experts", ("--ep", "2"): "--ep",  # --ep, --top-k: with --experts
                          ("--top-k", "3", "--experts", "2"): "--top-k",  # k more than E: stage 14's own check
                          ("--replicate", "0"): "--replicate",
                          ("--world", "4", "--parallel", "fsdp", "--replicate", "3"): "--replicate",  # dp 4: 13's check
                          ("--out", "{file}/sub"): "--out"},
    # A model (a preset or the shape), the GPUs and the batch given, as a user would; then one bad value.
    "at_scale/plan": {("--gpus", "0"): "--gpus", ("--gpu", "tpu"): "--gpu", ("--model", "gpt5"): "--model",
                      ("--layers", "0"): "--layers", ("--width", "0"): "--width", ("--heads", "0"): "--heads",
                      ("--vocab", "0"): "--vocab", ("--experts", "0"): "--experts", ("--top-k", "0"): "--top-k",
                      ("--gpus-per-node", "0"): "--gpus-per-node", ("--context", "0"): "--context",
                      ("--global-batch-tokens", "-1"): "--global-batch-tokens",
                      (*PLAN, "--global-batch-tokens", "1000"): "--global-batch-tokens",  # not whole sequences
                      (*PLAN, "--dp", "3"): "--dp", (*PLAN, "--tp", "16", "--gpus", "16"): "--tp",  # 8 KV heads
                      (*PLAN, "--pp", "64", "--gpus", "64"): "--pp",  # 32 blocks
                      (*PLAN, "--pp", "4", "--stages-per-rank", "9"): "--stages-per-rank",  # 36 stages, 32 blocks
                      (*PLAN, "--pp", "1", "--stages-per-rank", "2"): "--stages-per-rank",  # no pipeline to cut
                      (*PLAN, "--cp", "3"): "--cp", (*PLAN, "--ep", "2"): "--ep",  # no experts
                      ("--parallel", "zero4"): "--parallel", ("--micro-batch", "0"): "--micro-batch",
                      ("--ac", "some"): "--ac", ("--show", "0"): "--show", ("--cp-impl", "ulysses"): "--cp-impl",
                      ("--sp", "maybe"): "--sp", (*PLAN, "--sp", "yes", "--tp", "1"): "--sp",  # no tp to split over
                      ("--replicate", "0"): "--replicate", (*PLAN, "--replicate", "3"): "--replicate",  # 8 GPUs
                      (*PLAN, "--parallel", "ddp", "--replicate", "2"): "--replicate",  # HSDP replicates FSDP2's shards
                      ("--gpus", "8", "--global-batch-tokens", "65536", "--layers", "2"): "--model",  # no width, heads
                      (*PLAN, "--experts", "8"): "--experts",  # a shape flag beside a preset: not left unread
                      ("--gpus", "8", "--global-batch-tokens", "65536", "--layers", "2", "--width", "64", "--heads",
                       "2", "--top-k", "1"): "--top-k",  # no experts to go to
                      ("--gpus", "8", "--global-batch-tokens", "65536", "--layers", "2", "--width", "64", "--heads",
                       "2", "--experts", "4", "--ep", "8"): "--ep",  # not dividing the experts
                      (*PLAN, "--tp", "8", "--gpus-per-node", "4"): "--tp",  # beyond a node
                      (*PLAN, "--out", "{file}/sub"): "--out"},
    # Without --measure it reads its measurements from --out: a folder without them is refused.
    "at_scale/this_machine": {("--measure=1",): "--measure", ("--rounds", "0"): "--rounds",
                              ("--steps", "0"): "--steps", ("--repeats", "0"): "--repeats",
                              ("--out", "{tmp}"): "--out", ("--measure", "--out", "{file}/sub"): "--out",
                              ("--rounds", "7"): "--rounds"},  # without --measure: the measurements are read
    "debugging/bugs": {("--bug", "deadlock"): "--bug", ("--bug", "drift", "--steps", "3"): "--steps",  # at step 3
                       ("--bug", "set_epoch", "--steps", "64"): "--steps",  # 64 steps an epoch at 2 ranks of 32
                       ("--against", "{run}/summary.json"): "--against",  # JSON, not a --losses list
                       ("--time-find-unused", "2", "--bug", "drift"): "--bug",  # it trains no bug
                       ("--batch-size", "0"): "--batch-size", ("--lr", "nan"): "--lr", ("--seed", "x"): "--seed",
                       ("--world-size", "1"): "--world-size", ("--timeout", "0"): "--timeout",
                       ("--trace", "{file}/sub"): "--trace", ("--time-find-unused", "0"): "--time-find-unused",
                       ("--find-unused=1",): "--find-unused", ("--finite-check=1",): "--finite-check",
                       ("--no-replica-check=1",): "--no-replica-check", ("--sync-sends=1",): "--sync-sends",
                       ("--losses", "{file}/sub"): "--losses", ("--against", "{tmp}"): "--against"},
    # Its --nanogpt is checked last: the other cases need no nanoGPT checkout (CI has none).
    "benchmarks/vs_nanogpt": {("--nanogpt", "{tmp}"): "--nanogpt", ("--quick=1",): "--quick",
                              ("--out", "{file}/sub"): "--out", ("--timeout", "0"): "--timeout"},
}
# Flags a user never gives, each with why: no bad-value case.
INTERNAL_FLAGS = {("benchmarks/fsdp_memory", "--worker"): "set by its own launcher for each rank; hidden from --help",
                  ("benchmarks/moe_traffic", "--count"): "set by its own launcher for each rank; hidden from --help",
                  **{("at_scale/this_machine", flag): "set by its own --measure for each process it starts; hidden "
                     "from --help" for flag in ("--compute", "--rank", "--matmul")}}
# Messages that do not name their argument (the one line says what is wrong and the fix, not the flag): reported, and
# checked as they are.
UNNAMED = {("ddp_by_hand/compare_runs", "runs"): "no summary.json in ",
           ("ddp_by_hand/compare_runs", "--ddp"): "no summary.json in "}
REQUIRED = {"ddp_by_hand/compare_runs": ("{run}",), "benchmarks/pipeline_bubble": ("--out", "{tmp}/bubble"),
            "at_scale/plan": PLAN}  # (TYPO)
# What a tool needs around it to reach its checks, as a user running it would have it.
TOOL_ENV = {"benchmarks/pipeline_bubble": {"RANK": "0", "WORLD_SIZE": "2"}}  # run by torchrun, 2 processes: it checks
TOOL_GPUS = {"benchmarks/dp_vs_ddp": 2}  # it measures nothing below 2 GPUs, and checks --gpus and --out only then


# Spoilt snapshots (06: a file) and checkpoint directories (08), and resuming with other settings: each kind is
# checked in-process through main() (test_bad_snapshot_is_refused_in_one_line); one is also launched per stage.
SNAPSHOT_KINDS = {SNAPSHOT_STAGE: ["truncated", "not_torch", "foreign", "payload", "other_model", "other_seed",
                                   "other_dtype"],
                  CHECKPOINT_STAGE: ["truncated", "missing", "foreign", "payload", "other_model", "other_seed",
                                     "other_dtype"],
                  GPT_STAGE: ["truncated", "missing", "foreign", "payload", "no_progress", "progress_not_json",
                              "progress_of_another", "other_model", "other_seed", "other_batch", "other_dtype",
                              "other_schedule"]}
# What stage 11's line says for each kind: refused for the reason of its kind, not for another one.
GPT_SETTINGS_LINE = "was made with --seed 0, global batch 2 and --dtype float32"
GPT_REFUSALS = {"truncated": "__0_0.distcp is truncated", "missing": "__0_0.distcp is missing",
                "foreign": "is not a checkpoint directory of this stage (it holds s.pt)",
                "payload": "is not part of a checkpoint's metadata", "no_progress": "cannot load",
                "progress_not_json": "cannot load", "progress_of_another": "progress.json is not this stage's",
                "other_model": "holds another model: context 16, layers 1, heads 1, width 16",
                "other_seed": GPT_SETTINGS_LINE, "other_batch": GPT_SETTINGS_LINE, "other_dtype": GPT_SETTINGS_LINE,
                "other_schedule": "was made with --lr 0.002 --warmup-steps 1 --decay-steps 4"}
LAUNCHED_KIND = "truncated"
LAUNCHED_BAD_VALUE = ("--batch-size", "0")  # the bad value launched for real in every stage; the rest: in-process
TYPO = ("--batchsize", "32")  # a misspelt flag: argparse's own error, also raised in parse_args


# A stall costs its --timeout and the launcher's SIGTERM grace (launcher_grace: 30 s in torch 2.13), so there is one per
# way of launching: mp.spawn (03), torchrun on one node (04), two nodes (05), one for FSDP (08), whose collectives run
# inside autograd's hooks, one for the pipeline (10), whose stages wait for each other in send/recv, not in collectives,
# and the GPT (11), whose DDP or FSDP model and loss all-reduce run in a loop of steps, not epochs, and the GPT split
# over cp (12), whose ranks wait for each other's keys and values in the ring's sends and receives on the cp group; and
# the GPT with two pipeline stages (13-stalled-stage), which wait on each other in the schedule's sends and receives on
# the pp group. (13's cp is 12's code, and its snapshots 12's too (test_repo.SHARED_SNAPSHOT_CODE): its stall of the
# ring, its killed rank and its snapshot cases would repeat 12's and 11's.)
# 06 and 07 meet a stall as 04 does: the same torchrun agent, and the collective's timeout caught in main() by
# explain_peer_failure, word for word 04's (test_repo.py's contract test). They differ from 04 only in the store
# ddp_setup passes (used while joining, before any stall) and in the barrier after a snapshot, one more
# collective that times out like the others.
STALL_STAGES = ["03_ddp_spawn", "04_ddp_torchrun", "05_multinode", "08_fsdp", "10_pipeline_parallel", GPT_STAGE,
                CP_STAGE]


def stalled(case_id: str, stage: str, fault: str, step: Step | None, timeout: int, **signal_kw) -> Case:
    """Rank 1 SIGSTOPped. It cannot obey SIGTERM: the job ends after the healthy ranks' --timeout and the launcher's
    whole grace (not less: at_least), then SIGKILL."""
    grace = launcher_grace((step or CONFIGS[stage[:2]]).launcher)
    return Case(case_id, stage, fault, None, timeout + grace, f"--timeout {timeout}s",
                signalled(stage, signal.SIGSTOP, "--timeout", str(timeout), step=step, waits=timeout + grace,
                          **signal_kw), at_least=grace)


def cases() -> list[Case]:
    out = []
    for stage in STALL_STAGES:  # slow first: they wait for timeouts, and run beside the rest
        # 05: two nodes of two ranks, so the stalled rank 1 shares node 0 with rank 0, whose failure makes
        # that node's torchrun stop it. (A node whose only worker stalls is never told: see README.md.)
        # 10: dp 2 x pp 2, so the stalled stage's neighbour waits in a send/recv on the pp row's own group, which
        # must wait --timeout as the world's does (init_device_mesh's subgroups would wait 30 minutes).
        stall = replace(CONFIGS["05"], nproc=2) if stage == "05_multinode" else GPT_FAULTS.get(stage) \
            or (replace(CONFIGS["10"], nproc=4) if stage == "10_pipeline_parallel" else None)
        out.append(stalled(f"{stage[:2]}-stalled-rank", stage, "SIGSTOP to rank 1 after its first log line", stall,
                           GPT_TIMEOUT if stage in GPT_FAULTS else TIMEOUT,
                           **(GPT_FAULT_AFTER if stage in GPT_FAULTS else {})))
    out += [Case("05-node-never-joins-static", "05_multinode", "node 0 of 2 started alone (static)", None,
                 RENDEZVOUS_TIMEOUT, "1/2 clients joined", lone_node("static"), at_least=RENDEZVOUS_TIMEOUT),
            Case("05-node-never-joins-c10d", "05_multinode", "node 0 of 2 started alone (c10d)", None,
                 RENDEZVOUS_TIMEOUT, "RendezvousTimeoutError", lone_node("c10d"), at_least=RENDEZVOUS_TIMEOUT)]
    out.append(stalled(f"{PP_STAGE[:2]}-stalled-stage", PP_STAGE, "SIGSTOP to pipeline stage 1 after its first log "
                       "line", PP_FAULT, GPT_TIMEOUT, **GPT_FAULT_AFTER))
    for stage in [*DDP_STAGES, *GPT_FAULTS]:  # nothing waits: the healthy ranks see a closed connection at once
        out.append(Case(f"{stage[:2]}-killed-rank", stage, "SIGKILL to rank 1 after its first log line", None, 0,
                        "SIGKILL", signalled(stage, signal.SIGKILL, step=GPT_FAULTS.get(stage),
                                             **(GPT_FAULT_AFTER if stage in GPT_FAULTS else {}))))
    # The rest: a fault present at the start, timed from the start (nothing configured to wait: the margin alone).
    after_fault, out = out, []
    out += [Case("03-port-taken", "03_ddp_spawn", "MASTER_PORT held by another process", 2, 0,
                 "MASTER_PORT={port} is in use", port_taken("03_ddp_spawn"), one_line=True),
            Case("04-port-taken", "04_ddp_torchrun", "--master_port held by another process", None, 0,
                 "port: {port}, useIpv6: false, code: -98, name: EADDRINUSE", port_taken("04_ddp_torchrun")),
            Case("05-port-taken", "05_multinode", "--master_port held by another process", None, 0,
                 "port: {port}, useIpv6: false, code: -98, name: EADDRINUSE", port_taken("05_multinode"))]
    out.append(Case("08-disk-full", CHECKPOINT_STAGE, "the disk fills up while the shards are written", None, 0,
                    "is still the last checkpoint", disk_fills_up(CHECKPOINT_STAGE), also=left_alone,
                    needs="full_disk"))
    out.append(Case(f"{SNAPSHOT_STAGE[:2]}-disk-full", SNAPSHOT_STAGE, "the disk fills up before a snapshot is saved",
                    None, 0, "still holds the previous snapshot", disk_fills_up(SNAPSHOT_STAGE), also=left_alone,
                    needs="full_disk"))
    for stage in (SNAPSHOT_STAGE, CHECKPOINT_STAGE, GPT_STAGE):
        out.append(Case(f"{stage[:2]}-snapshot-{LAUNCHED_KIND}", stage, f"--snapshot is {LAUNCHED_KIND}", 2, 0,
                        "argument --snapshot: ", snapshot_given(stage, LAUNCHED_KIND), one_line=True, also=left_alone))
    for stage in STAGES:
        args, flag = LAUNCHED_BAD_VALUE, bad_values(stage)[LAUNCHED_BAD_VALUE]
        out.append(Case(f"{stage[:2]}{' '.join(args)}", stage, f"bad value {' '.join(args)}", 2, 0,
                        f"argument {flag}: ", started_with(stage, *args), one_line=True))
    for tool in TOOLS:  # the first of its bad values, each refused while parsing: nothing else is needed
        args, flag = next(iter(TOOL_BAD_VALUES[tool].items()))
        out.append(Case(f"{tool} {' '.join(args)}", tool, f"bad value {' '.join(args)}", 2, 0,
                        UNNAMED.get((tool, flag), f"argument {flag}: "), started_with(tool, *args), one_line=True))
    return after_fault + [replace(case, from_start=True) for case in out]


CASES = cases()
# Checked in-process: (stage, arguments, what the one line must contain).
SCRIPTS = [*STAGES, *RECIPES]  # the recipes are stage 04 plus one technique: they refuse bad values alike


def table(script: str) -> dict[tuple[str, ...], str]:
    return TOOL_BAD_VALUES[script] if script in TOOLS else bad_values(script)


# (script, arguments, the flag, what its one line must contain)
REFUSALS = [(script, args, flag, UNNAMED.get((script, flag), f"argument {flag}: "))
            for script in [*SCRIPTS, *TOOLS] for args, flag in table(script).items()] + \
           [(script, (*REQUIRED.get(script, ()), *TYPO), "", f"unrecognized arguments: {' '.join(TYPO)}")
            for script in [*SCRIPTS, *TOOLS]]


def short(script: str) -> str:
    return script[:2] if script in STAGES else script.removeprefix("recipes/")


def path_of(script: str) -> Path:
    """A stage's or recipe's train.py, or a tool's own file."""
    return ROOT / f"{script}.py" if script in TOOLS else ROOT / script / "train.py"


def load_script(script: str) -> ModuleType:
    return load_tool(script) if script in TOOLS else load_stage(script)


@functools.cache
def load_tool(script: str) -> ModuleType:
    """Import a tool as a module, as load_stage imports a stage (its work is in functions: importing runs nothing)."""
    spec = importlib.util.spec_from_file_location(f"tool_{script.replace('/', '_')}", ROOT / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- the place, and running every case once ------------------------------------------------------------------

@contextlib.contextmanager
def mounted(path: Path, options: str) -> Iterator[bool]:
    """A tmpfs at `path` (root only; False where it cannot be mounted)."""
    path.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    ok = mount.returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module", autouse=True)
def real_torchrun() -> Iterator[None]:
    """Every torchrun job here through torchrun itself (harness.forked): how the real launcher ends a job is tested
    here. A `python script` launch no fault watches (a bad value, a spoilt snapshot, a full disk, the snapshots the
    cases start from) is still forked from the session's import of torch: the script runs as `python script` would
    run it (tests/test_forkrun.py), and there is no launcher to test (~80 CPU-s less)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "FORK_RANKS", False)
        yield


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Iterator[Place]:
    """The paths alone (no snapshot, no disks): all that the in-process checks need."""
    tmp = tmp_path_factory.mktemp("faults")
    a_file = tmp / "a_file"
    a_file.write_text("not a directory")
    (tmp / "a_run").mkdir()  # {run}: where a finished run's --out would be, as far as compare_runs checks
    (tmp / "a_run" / "summary.json").write_text("{}")
    with contextlib.ExitStack() as stack:
        read_only = tmp / "read_only"
        if not stack.enter_context(mounted(read_only, "ro,size=1m")):
            read_only.chmod(0o555)  # not root: permissions make it read-only; root ignores them
            with contextlib.suppress(OSError), open(read_only / "probe", "w"):
                read_only = None  # writable after all: those cases are skipped
        yield Place(tmp, a_file, read_only, b"", None, tmp / "payload_ran", None)


@pytest.fixture(scope="module")
def pace() -> Pace:
    """Two trivial launches, one after the other, before the module launches anything else."""
    return Pace(before=max(startup(), startup()))


@pytest.fixture(scope="module")
def place(paths, pace) -> Iterator[Place]:
    tmp = paths.tmp
    good, good_checkpoint, gpt_checkpoint = tmp / "good.pt", tmp / "good_checkpoint", tmp / "gpt_checkpoint"
    with ThreadPoolExecutor(max_workers=2) as pool:  # stage 06's snapshot, 08's and 11's checkpoints, two at once
        made = pool.map(lambda step: check(launch(step, timeout=pace.limit())), [
            Step("06_checkpoint", "python", ("--device", "cpu", "--epochs", "1", "--snapshot", str(good))),
            Step(CHECKPOINT_STAGE, "python", ("--device", "cpu", "--epochs", "1", "--snapshot", str(good_checkpoint))),
            Step(GPT_STAGE, "python", (*GPT_SETTINGS, "--max-steps", str(GPT_STEPS), "--snapshot",
                                       str(gpt_checkpoint)))])
        list(made)
    good_snapshot = good.read_bytes()
    with contextlib.ExitStack() as stack:
        disks = iter(range(100))

        def full_disk(stage: str) -> Path | None:
            disk = tmp / f"disk{next(disks)}"
            source = good_checkpoint if stage == CHECKPOINT_STAGE else good
            size = sum(f.stat().st_size for f in source.rglob("*")) if source.is_dir() else source.stat().st_size
            # Room for the good snapshot plus half of another (and tmpfs's own blocks): the next save cannot fit.
            if not stack.enter_context(mounted(disk, f"size={size * 3 // 2 + 16384}")):
                return None
            copy = shutil.copytree if source.is_dir() else shutil.copy
            return Path(copy(source, disk / source.name))

        probe = full_disk("06_checkpoint")
        yield replace(paths, good_snapshot=good_snapshot, good_checkpoint=good_checkpoint,
                      full_disk=full_disk if probe else None, pace=pace, gpt_checkpoint=gpt_checkpoint)


@pytest.fixture(scope="module")
def outcomes(place, request) -> dict[str, Outcome | BaseException]:
    """Every selected case's outcome, POOL cases at a time (the slow ones mostly wait), and the start-up timed among
    them three times: beside the first cases, halfway, and beside the last (None in the queue: a probe)."""
    chosen = selected(request, "test_fault", "case")
    queue: list[Case | None] = list(chosen)
    for at in (len(queue), len(queue) // 2, 0):
        queue.insert(at, None)

    def one(case: Case | None) -> Outcome | BaseException | None:
        if case is None:
            place.pace.among.append(startup())
            return None
        if case.needs and getattr(place, case.needs) is None:
            return pytest.skip.Exception(f"{case.needs} cannot be made here (needs root to mount a tmpfs)")
        try:
            return case.start(place)
        except BaseException as e:  # pytest.fail from the launcher (a hang), or a bug: reported by the case's test
            return e

    with ThreadPoolExecutor(max_workers=POOL) as pool:
        done = list(pool.map(one, queue))
    return {case.id: outcome for case, outcome in zip(queue, done, strict=True) if case is not None}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(outcomes, place, case):
    outcome = outcomes[case.id]
    if isinstance(outcome, BaseException):
        raise outcome
    run = outcome.run
    where = f"{case.fault}\n{run.describe()}"
    assert run.returncode is not None, f"hung: {where}"
    if case.status is None:
        assert run.returncode != 0, f"exit 0 despite the fault: {where}"
    else:
        assert run.returncode == case.status, where
    pace, startups = place.pace, FROM_START_STARTUPS if case.from_start else AFTER_FAULT_STARTUPS
    assert outcome.seconds <= case.waits + pace.margin(startups), \
        f"took {outcome.seconds:.1f}s after the fault: more than the {case.waits:g}s it configured + the " \
        f"{pace.describe(startups)}: {where}"
    # The other way: the job did wait what it must (the fault may have come up to `unseen` earlier than seen).
    assert outcome.seconds + outcome.unseen >= case.at_least, \
        f"ended {outcome.seconds + outcome.unseen:.1f}s after the fault, before the {case.at_least:g}s it must " \
        f"wait: {where}"
    assert case.message.format(**outcome.facts) in run.stdout + run.stderr, where
    assert not run.survivors, f"processes left running: {run.survivors}: {where}"
    if case.one_line:
        assert one_line(case.stage, run.stderr), where
        assert "epoch" not in run.stdout, f"training started before the refusal: {where}"
    if case.also:
        case.also(outcome, place)


class Accepted(Exception):
    """Raised where main() would join a process group: it got past every check of its arguments and files."""


def refusal(module: ModuleType, args: tuple[str, ...], whole_main: bool = False) -> tuple[object, str, str]:
    """(exit code, stdout, stderr) of a stage's parse_args(args), in this process, as the script would see it.

    whole_main: main(args) instead, up to joining the process group (ddp_setup raises Accepted there, so
    nothing accepted can start training in this process): the checks of the snapshot file come after parse_args.
    """
    out, err = io.StringIO(), io.StringIO()
    # The launchers' variables (MASTER_PORT, LOCAL_WORLD_SIZE, ...) are removed, as every launch removes them.
    with mock.patch.dict(os.environ, clean_env(), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            (mock.patch.object(module, "ddp_setup", side_effect=Accepted) if whole_main else contextlib.nullcontext()):
        try:
            (module.main if whole_main else module.parse_args)(list(args))
        except SystemExit as e:
            return e.code, out.getvalue(), err.getvalue()
        except Accepted:
            pass
    return "no exit: the value was accepted", out.getvalue(), err.getvalue()


# What ends a tool's checks in its main(): parsing, refusing, or checking --out. The statement after the last of them
# starts the work (the launches, the measuring).
CHECK = re.compile(r"\bparse_args\(|\.error\(|\.check_out_writable\(")


def checks_end(main: Callable) -> int:
    """The line of main()'s first statement after its last check."""
    body = ast.parse(textwrap.dedent(inspect.getsource(main))).body[0].body
    last = max(i for i, statement in enumerate(body) if CHECK.search(ast.unparse(statement)))
    assert last + 1 < len(body), f"{main.__module__}.main() does nothing after its checks?"
    return main.__code__.co_firstlineno + body[last + 1].lineno - 1


def main_until_checked(script: str, args: tuple[str, ...], module: ModuleType | None = None) -> tuple[object, str, str]:
    """(exit code, stdout, stderr) of a tool's main(args), in this process, stopped (Accepted) when it reaches the
    statement after its last check: nothing accepted starts measuring here. The tool sees what it would where it runs
    (TOOL_ENV, TOOL_GPUS); a main() without argv reads sys.argv, so that is set too. `module`: another version of
    the tool's file (a negative control)."""
    main = (module or load_tool(script)).main
    stop = checks_end(main)

    def step(frame, event, arg):
        if event == "line" and frame.f_lineno >= stop:
            raise Accepted
        return step

    def trace(frame, event, arg):
        return step if frame.f_code is main.__code__ else None

    out, err = io.StringIO(), io.StringIO()
    gpus = mock.patch("torch.cuda.device_count", return_value=TOOL_GPUS[script]) if script in TOOL_GPUS \
        else contextlib.nullcontext()
    with mock.patch.dict(os.environ, clean_env(TOOL_ENV.get(script)), clear=True), gpus, \
            mock.patch.object(sys, "argv", [str(path_of(script).relative_to(ROOT)), *args]), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        before = sys.gettrace()
        sys.settrace(trace)
        try:
            main(list(args)) if inspect.signature(main).parameters else main()
        except SystemExit as e:
            return e.code, out.getvalue(), err.getvalue()
        except Accepted:
            pass
        finally:
            sys.settrace(before)
    return "no exit: the value was accepted", out.getvalue(), err.getvalue()


def refusal_of(script: str, args: tuple[str, ...]) -> tuple[object, str, str]:
    """What `python <script> <args>` exits with and prints, checked in this process (refusal, main_until_checked)."""
    module = load_script(script)
    return refusal(module, args) if hasattr(module, "parse_args") else main_until_checked(script, args)


@pytest.mark.parametrize("script,args,flag,message", REFUSALS,
                         ids=[f"{short(s)}{' ' if s in TOOLS else ''}{' '.join(a)}" for s, a, _, _ in REFUSALS])
def test_bad_value_is_refused_in_one_line(paths, script, args, flag, message):
    """What `python <script> <args>` prints and exits with: parse_args is all main() runs before it (a tool: its
    main() up to the end of its checks)."""
    if "{ro}" in "".join(args) and paths.read_only is None:
        pytest.skip("read_only cannot be made here (needs root to mount a tmpfs)")
    code, out, err = refusal_of(script, with_place(args, paths))
    where = f"{path_of(script).relative_to(ROOT)} {' '.join(args)}: exit {code}\nstdout: {out}\nstderr: {err}"
    assert code == 2, where
    assert one_line(script, err) and message in err, where
    assert not out, where


def test_in_process_tool_check_sees_a_missing_check(tmp_path):
    """Negative controls for the tools' in-process checks. main() really is stopped where its checks end: --warmup 2
    passes overlap.py's checks, and nothing is launched (mp.spawn comes next). A check left out is seen: overlap.py
    with its --warmup check loosened to accept 1 lets it through, where the file itself refuses it."""
    with mock.patch.object(load_tool("ddp_by_hand/overlap").mp, "spawn", side_effect=AssertionError("spawned")):
        code, out, err = main_until_checked("ddp_by_hand/overlap", ("--warmup", "2", "--out", str(tmp_path / "o")))
    assert code == "no exit: the value was accepted" and not err, (code, out, err)
    assert main_until_checked("ddp_by_hand/overlap", ("--warmup", "1"))[0] == 2
    text = path_of("ddp_by_hand/overlap").read_text()
    assert text.count("if args.warmup < 2:") == 1
    # The edited text run as the file itself (its name and folder: it imports bucketed.py from beside it).
    broken = ModuleType("overlap_without_its_warmup_check")
    broken.__file__ = str(path_of("ddp_by_hand/overlap"))
    with mock.patch.dict(sys.modules, {broken.__name__: broken}):  # where its dataclasses look their module up
        exec(compile(text.replace("if args.warmup < 2:", "if args.warmup < 1:"), broken.__file__, "exec"),
             broken.__dict__)
        code, _, err = main_until_checked("ddp_by_hand/overlap", ("--warmup", "1", "--out", str(tmp_path / "o")),
                                          broken)
    assert code == "no exit: the value was accepted" and not err, f"the copy without the check refused: {code} {err}"


IN_PROCESS_SNAPSHOTS = [(stage, kind) for stage, kinds in SNAPSHOT_KINDS.items() for kind in kinds]


@pytest.mark.parametrize("stage,kind", IN_PROCESS_SNAPSHOTS, ids=[f"{s[:2]}-{k}" for s, k in IN_PROCESS_SNAPSHOTS])
def test_bad_snapshot_is_refused_in_one_line(place, stage, kind):
    """What `python <stage>/train.py --snapshot <spoilt>` does before it would join a group: one line, exit 2,
    the snapshot left as it was, no pickled code run."""
    path, args = bad_snapshot(stage, kind, place, f"in-process-{stage}-{kind}")
    before = contents(path)
    code, out, err = refusal(load_stage(stage), args, whole_main=True)
    where = f"{stage}/train.py {' '.join(args)}: exit {code}\nstdout: {out}\nstderr: {err}"
    assert code == 2, where
    assert one_line(stage, err, "argument --snapshot: "), where
    assert "epoch" not in out, where
    if stage == GPT_STAGE:
        assert GPT_REFUSALS[kind] in err, where
    untouched(path, before, place)


def test_in_process_gpt_checkpoint_check_accepts_its_own(place):
    """The control for stage 11's refusals: its own checkpoint, resumed with its own settings, passes every check
    (main() is stopped where it would join the group), and is left as it was."""
    path, args = bad_snapshot(GPT_STAGE, "good", place, "in-process-gpt-good")
    before = contents(path)
    code, out, err = refusal(load_stage(GPT_STAGE), args, whole_main=True)
    assert code == "no exit: the value was accepted" and not err, (code, out, err)
    untouched(path, before, place)


def test_in_process_snapshot_check_sees_a_missing_check(place, tmp_path):
    """Negative control: a copy of stage 06 without the settings check takes another seed's snapshot, and main()
    is stopped where it would join the group (nothing trains in this process)."""
    check_line = 'if (snapshot["seed"], snapshot["global_batch"], snapshot["dtype"]) != (seed, global_batch, dtype):'
    broken = load_copy(mutate(SNAPSHOT_STAGE, check_line, "if False:", tmp_path / "broken"))
    _, args = bad_snapshot(SNAPSHOT_STAGE, "other_seed", place, "in-process-broken-06")
    code, out, err = refusal(broken, args, whole_main=True)
    assert code == "no exit: the value was accepted" and not err and "epoch" not in out, (code, out, err)


def test_in_process_check_sees_a_missing_check(tmp_path):
    """Negative control: a copy of stage 01 whose positive() accepts 0 lets --batch-size 0 through.

    An exact copy refuses it: what differs is the check, not the loading.
    """
    def load(name: str, old: str, new: str) -> ModuleType:
        return load_copy(mutate("01_single_gpu", old, new, tmp_path / name))

    same = load("same", "if not (value > 0 and", "if not (value > 0 and")
    broken = load("broken", "if not (value > 0 and", "if not (value >= 0 and")
    assert refusal(same, LAUNCHED_BAD_VALUE)[0] == 2
    code, _, err = refusal(broken, LAUNCHED_BAD_VALUE)
    assert code != 2 and not err, f"the copy without the check still refused: exit {code}, {err!r}"


@pytest.mark.parametrize("script", [*SCRIPTS, *TOOLS])
def test_main_checks_values_before_anything_else(script):
    """Why the in-process checks stand for the script: main() starts with parse_args(argv) (a tool without one: its
    checks come before anything else main() does, and main_until_checked runs them all), and running the file calls
    main(); the module's top level only defines (one real launch per script, in the battery, confirms the whole
    path)."""
    tree = ast.parse(path_of(script).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    if hasattr(load_script(script), "parse_args"):
        first = ast.unparse(main.body[0])
        assert first == "args = parse_args(argv)", f"{script}: main() starts with {first!r}, not parse_args(argv)"
    else:
        checks_end(load_tool(script).main)  # there is a statement after the checks, where the work starts
    entry = ast.unparse(tree.body[-1])
    assert entry in ("if __name__ == '__main__':\n    main()", "if __name__ == '__main__':\n    sys.exit(main())"), \
        f"{script}: does not end by calling main()"


def complete_checkpoints(directory: Path) -> list[int]:
    """The steps of stage 11's complete checkpoints in `directory` (a step_N.tmp is one being written)."""
    return sorted(int(p.name.removeprefix("step_")) for p in directory.glob("step_*") if p.name[5:].isdigit()) \
        if directory.exists() else []


def test_gpt_killed_worker_is_restarted_and_resumes_exactly(pace, tmp_path):
    """Stage 11 under `torchrun --max-restarts=1`: rank 1 SIGKILLed once a checkpoint is complete; torchrun restarts
    the group, which resumes from the newest checkpoint and ends bit for bit where the same job without the kill ends
    (run beside it): the same weights, the same per-step losses, the same states at every step both recorded."""
    steps = 80  # the kill comes once the step-10 checkpoint is complete: 70 steps before the job could end
    settings = (*GPT_TINY, "--batch-size", "2", "--max-steps", str(steps), "--save-every", "10", "--eval-every", "10")
    jobs = {name: Step(GPT_STAGE, "torchrun", (*settings, "--snapshot", str(tmp_path / name / "ck")), nproc=2,
                       torchrun_args=("--max-restarts=1",)) for name in ("killed", "whole")}
    kills: list[int] = []  # the newest complete checkpoint when rank 1 was killed

    def killer(job: Job) -> None:  # beside the job: once a checkpoint is complete, kill rank 1 (once)
        ck = tmp_path / "killed" / "ck"
        if (pids := attempt_workers(job, 2)) is None:  # found while they start, to kill at once below
            return
        while not complete_checkpoints(ck) and not job.ended.is_set():
            time.sleep(POLL)
        if not job.ended.is_set():
            os.kill(pids[1], signal.SIGKILL)
            kills.append(complete_checkpoints(ck)[-1])

    with ThreadPoolExecutor(max_workers=2) as pool:
        killed = pool.submit(launch, jobs["killed"], tmp_path / "killed" / "out", timeout=pace.limit(), during=killer)
        whole = pool.submit(launch, jobs["whole"], tmp_path / "whole" / "out", timeout=pace.limit())
        killed, whole = check(killed.result()), check(whole.result())
    resumed = re.search(r"resumed from \S+ \(written by 2 ranks\) at step (\d+)", killed.stdout)
    assert len(kills) == 1 and resumed, (kills, killed.describe())
    at = int(resumed.group(1))
    assert kills[0] <= at < steps and killed.summary["resumed_at"] == at, (kills, at, killed.describe())
    assert "resumed from" not in whole.stdout, whole.describe()
    assert killed.summary["losses"] == whole.summary["losses"] and len(whole.summary["losses"]) == steps
    assert all(torch.equal(killed.model[k], whole.model[k]) for k in whole.model) and \
        killed.model.keys() == whole.model.keys()
    ours = {state["step"]: state for state in killed.trajectory}
    theirs = {state["step"]: state for state in whole.trajectory}
    assert at in ours and ours.keys() <= theirs.keys(), (ours.keys(), theirs.keys())
    for step, state in ours.items():
        for part in ("params", "exp_avg", "exp_avg_sq"):
            assert all(torch.equal(state[part][n], theirs[step][part][n]) for n in state[part]), (step, part)


def test_bad_value_under_torchrun_fails_fast_with_the_line(pace):
    run = launch(Step("04_ddp_torchrun", "torchrun", ("--batch-size", "0"), nproc=2), timeout=pace.limit())
    assert run.returncode != 0 and not run.survivors, run.describe()
    assert "argument --batch-size: must be a positive int, got 0" in run.stderr


def test_every_flag_of_every_script_has_a_bad_value_case():
    """The battery grows with the stages and tools: a new flag without a bad-value case fails here.

    The flags are those the parser itself lists in its usage line, and those the source declares.
    """
    for script in [*SCRIPTS, *TOOLS]:
        code, usage, _ = refusal_of(script, ("--help",))
        assert code == 0, f"{script}: --help exited {code}"
        usage = usage.split("\n\n")[0]  # the usage line (wrapped), before the description
        declared = set(re.findall(r"\[(--[a-z][a-z-]*)", usage)) - {"--help"}
        declared |= set(re.findall(r'add_argument\("(--[a-z-]+)"', path_of(script).read_text()))
        declared -= {flag for s, flag in INTERNAL_FLAGS if s == script}
        checked = {flag for s, _, flag, _ in REFUSALS if s == script}
        missing = declared - checked
        assert declared and not missing, f"{script}: no bad-value case for {sorted(missing)}"


@pytest.mark.parametrize("script,version,refused", [
    ("01_single_gpu", "1.13.1", True), ("07_model_parallel", "2.0.0", False), ("08_fsdp", "2.5.1", True),
    ("09_tensor_parallel", "2.5.1", True), ("09_tensor_parallel", "2.6.0", False),
    ("10_pipeline_parallel", "2.5.1", True), ("11_gpt", "2.5.1", True), ("12_context_parallel", "2.5.1", True),
    ("13_pipeline_4d", "2.5.1", True), ("14_experts", "2.6.0", True), ("14_experts", "2.7.0", False),
    ("ddp_by_hand/bucketed", "2.0.1", True), ("ddp_by_hand/bucketed", "2.1.0", False)])
def test_a_torch_older_than_the_script_needs_is_refused_in_one_line(script, version, refused, monkeypatch, capsys):
    """Each script needs the torch of NEEDS_TORCH (one table, in the shared block): 08-13 need 2.6 and check it at
    the top of the file, since an older torch would fail on their imports in a traceback; the rest in check_args.
    The minimum itself is accepted."""
    from torch.torch_version import TorchVersion
    needs = ".".join(map(str, load_stage("01_single_gpu").NEEDS_TORCH.get(script.split("/")[0], (2, 0))))
    path = ROOT / f"{script}.py" if "/" in script else ROOT / script / "train.py"
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    try:
        load_copy(path).parse_args(["--device", "cpu"])
        code = None  # accepted
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    if not refused:
        assert code is None and not err, (code, err)
        return
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"{path.relative_to(ROOT)}: error: ") and version in err and f"{needs} or newer" in err, err


def test_a_crashed_worker_shows_where_it_crashed_among_the_others_errors():
    """A worker killed by a crash inside torch (SIGSEGV) prints its Python stack first (PYTHONFAULTHANDLER); the other
    ranks' errors and the launcher's report follow and can fill the tail a failure shows: Run.describe keeps it."""
    crash = "import ctypes\ndef where_it_crashed():\n    ctypes.string_at(0)\nwhere_it_crashed()"
    others = "import sys; sys.stderr.write('another rank: connection reset by peer\\n' * 200)"
    run = launch_commands([["bash", "-c", '"$0" -c "$1"; "$0" -c "$2"', sys.executable, crash, others]],
                           timeout=harness.time_limit(programs=2))
    assert run.returncode == 0 and run.stderr.index("Fatal Python error") < 100, run.describe()
    assert len(run.stderr) > 4000 and "where_it_crashed" not in run.stderr[-4000:]  # the tail alone would lose it
    assert "--- the crash ---" in run.describe() and "in where_it_crashed" in run.describe(), run.describe()


def test_a_job_killed_at_its_time_limit_says_where_it_waited(tmp_path):
    """At its time limit a job's processes print their Python stacks before they are killed (tour.print_stacks:
    SIGABRT, answered by faulthandler): a hang names its line. And no core file, though this one allows them (the
    limit lowered first). The limit: one start-up of a torch launch timed here; the script imports nothing."""
    path = tmp_path / "hang.py"
    path.write_text("import threading\n\n\ndef wait_here():\n    print('waiting', flush=True)\n"
                    "    threading.Event().wait()\n\n\nwait_here()\n")
    # (where the hard limit forbids core files the shell cannot allow them, and the last check holds anyway)
    allow_cores = 'ulimit -c unlimited 2>/dev/null; exec "$0" "$1"'
    run = harness.run_job([["bash", "-c", allow_cores, sys.executable, str(path)]], timeout=harness.startup()[0],
                          cwd=tmp_path)
    assert run.returncode is None and run.stdout == "waiting\n" and not run.survivors, run.describe()
    assert f'File "{path}", line 6 in wait_here' in run.stderr, run.describe()
    assert not [f.name for f in tmp_path.iterdir() if f.name.startswith("core")]


def test_every_rank_of_a_hung_job_says_where_it_waited(tmp_path):
    """The hang learners meet most: a collective one rank calls and the other never does. print_stacks, as run_job
    calls it at the limit (here once both ranks wait), has each rank of a torchrun job (torchrun itself, as every job
    here) name its line."""
    path = tmp_path / "hang.py"
    path.write_text(textwrap.dedent("""\
        import os, threading
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("waiting", flush=True)
        if os.environ["RANK"] == "1":
            dist.barrier()  # rank 0 never calls it
        else:
            threading.Event().wait()
        """))

    def when_both_wait(job: Job) -> None:
        while job.output().count("waiting") < 2 and not job.ended.is_set():
            time.sleep(0.05)
        harness.print_stacks(job.tag)

    run = harness.run_job([[*TORCHRUN, "--standalone", "--nproc_per_node=2", str(path)]],
                          timeout=harness.time_limit(programs=2), during=when_both_wait)
    assert run.returncode not in (0, None) and not run.survivors, run.describe()
    for line in (6, 8):
        assert f'File "{path}", line {line} in <module>' in run.stderr, run.describe()
