"""The fault battery: every stage, the faults users meet, injected from outside the scripts.

Each case states the fault, the exit status it must end with, a bound on the time from the fault
to the end of the whole job, and a fragment of the message; every case also checks that no process
of the job is left running. The faults are real: signals sent to a worker, a port another process
holds, a node that never comes, a read-only or full disk, bad files and bad values. The stages
carry no test hooks.

The cases run concurrently, once per session: most of their time is spent waiting for a timeout.

Bad values (every flag of every stage has one) are checked in this process, by calling the stage's
parse_args(): every check of a value is there, and main() calls it before anything else
(test_main_checks_values_before_anything_else). Launching the script for each would spend ~3 s of
CPU importing torch, ~80 times. One bad value per stage is still launched for real, proving the
script refuses in one line and exit 2 before training. Bad snapshot files are checked in main() too,
before it joins a process group: each kind runs main() in this process up to that point (test_bad_snapshot_...),
and one kind per stage is launched for real.
"""
from __future__ import annotations

import ast
import contextlib
import io
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch

from conftest import CONFIGS
from harness import (
    RECIPES,
    ROOT,
    STAGES,
    TORCHRUN,
    Fault,
    Run,
    Step,
    check,
    clean_env,
    free_port,
    launch,
    launch_commands,
    load_copy,
    load_stage,
    mutate,
    selected,
)

DDP_STAGES = [s for s in STAGES if s >= "03" and s[:2] in CONFIGS]  # killed as the tour runs them
SNAPSHOT_STAGES = ["06_checkpoint", "07_model_parallel"]  # --snapshot is a file
# The bad-snapshot and full-disk cases run on 06 and 08 alone: 07 and 09 handle snapshots with 06's and 08's code
# (test_repo.SHARED_SNAPSHOT_CODE), and each case launches a process (~4 CPU-s).
SNAPSHOT_STAGE = "06_checkpoint"
CHECKPOINT_STAGE = "08_fsdp"  # --snapshot is a directory of shards (torch.distributed.checkpoint)
CHECKPOINT_STAGES = [CHECKPOINT_STAGE, "09_tensor_parallel"]  # 09 keeps 08's checkpoints
TIMEOUT = 5  # --timeout in the stall cases: how long the healthy ranks wait for the stalled one
LAUNCHER_GRACE = 30  # mp.spawn and torchrun wait this long for a worker to obey SIGTERM before SIGKILL
SLACK = 15  # scheduling on a busy 2-core machine
START = 40  # a fault present at start: importing torch (3 s alone), several jobs at once
# Cases launched at once. The 3 stalls and 2 lone nodes mostly wait, so 6 keeps the 2 cores busy with the rest:
# the battery took 2m02 with 4, 1m38 with 6, 1m46 with 8 here (2 cores, shared); the bounds above held in each.
POOL = 6


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


@dataclass
class Outcome:
    run: Run
    seconds: float  # from the fault to the end of the job
    facts: dict = field(default_factory=dict)  # what the message must mention, e.g. the port


@dataclass(frozen=True)
class Case:
    id: str
    stage: str
    fault: str
    status: int | None  # the exit status; None: any non-zero status
    within: float  # seconds, from the fault to the end of the job
    message: str  # must appear in the output; formatted with Outcome.facts
    start: Callable[[Place], Outcome]
    one_line: bool = False  # the script refuses in exactly one stderr line, before training
    also: Callable[[Outcome, Place], None] | None = None  # further checks (the file is untouched, ...)
    needs: str | None = None  # a Place attribute that must exist, e.g. "read_only"


# --- how each kind of fault is started --------------------------------------------------------------------

def with_place(args: tuple[str, ...], place: Place) -> tuple[str, ...]:
    return tuple(a.format(file=place.a_file, ro=place.read_only, tmp=place.tmp) for a in args)


def started_with(stage: str, *args: str, env: dict[str, str] | None = None) -> Callable[[Place], Outcome]:
    """A fault present at start: a bad value, an unwritable path. Timed from the start."""
    def go(place: Place) -> Outcome:
        run = launch(Step(stage, "python", with_place(args, place)), timeout=90, env=env)
        return Outcome(run, run.seconds)
    return go


def signalled(stage: str, signum: int, *args: str, step: Step | None = None) -> Callable[[Place], Outcome]:
    """`signum` sent to rank 1 once the first epoch is done (the job is told to run far longer)."""
    def go(place: Place) -> Outcome:
        base = step or CONFIGS[stage[:2]]
        fault = Fault(signum, rank=1)
        out = place.tmp / f"{stage}-{signal.Signals(signum).name}"
        run = launch(replace(base, args=(*base.args, "--epochs", "200", *args)), out, timeout=150, during=fault)
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
                run = launch(Step(stage, "python", ("--device", "cpu")), timeout=90, env={"MASTER_PORT": str(port)})
            else:  # torchrun: --master_port
                nodes = "--nnodes=2 --node_rank=0" if stage == "05_multinode" else "--nnodes=1 --nproc_per_node=2"
                run = launch_commands([[*TORCHRUN, *nodes.split(), "--master_addr=127.0.0.1",
                                        f"--master_port={port}", f"{stage}/train.py", "--device", "cpu"]], timeout=90)
        return Outcome(run, run.seconds, {"port": port})
    return go


def lone_node(rendezvous: str) -> Callable[[Place], Outcome]:
    """Node 0 of 2 started alone, with a 10 s rendezvous timeout: the other node never comes."""
    def go(place: Place) -> Outcome:
        port = free_port()
        if rendezvous == "static":
            how = ["--node_rank=0", "--master_addr=127.0.0.1", f"--master_port={port}", "--rdzv_conf=timeout=10"]
        else:
            how = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=lonely",
                   "--rdzv_conf=is_host=1,join_timeout=10"]
        run = launch_commands([[*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", *how, "05_multinode/train.py",
                                "--device", "cpu"]], timeout=90)
        return Outcome(run, run.seconds)
    return go


def bad_snapshot(stage: str, kind: str, place: Place, where: str) -> tuple[Path, tuple[str, ...]]:
    """A spoilt snapshot (06: a file) or checkpoint directory (08) of `kind` in a new folder `where`, and the
    arguments that resume from it."""
    folder = place.tmp / where
    folder.mkdir()
    if stage == CHECKPOINT_STAGE:
        return spoilt_checkpoint(kind, folder / "ck", place)
    path = folder / "s.pt"
    write_bad_snapshot(kind, path, place)
    return path, ("--device", "cpu", "--epochs", "2", "--snapshot", str(path))


def snapshot_given(stage: str, kind: str) -> Callable[[Place], Outcome]:
    """The script launched on a spoilt snapshot: the whole path from the command line (in-process: the rest)."""
    def go(place: Place) -> Outcome:
        path, args = bad_snapshot(stage, kind, place, f"launched-{stage}-{kind}")
        before = contents(path)
        run = launch(Step(stage, "python", args), timeout=90)
        return Outcome(run, run.seconds, {"path": path, "before": before})
    return go


def disk_fills_up(stage: str) -> Callable[[Place], Outcome]:
    """Resume from the good snapshot (epoch 1) on a disk with no room for the next one."""
    def go(place: Place) -> Outcome:
        path = place.full_disk(stage)
        before = contents(path)
        run = launch(Step(stage, "python", ("--device", "cpu", "--epochs", "3", "--snapshot", str(path))), timeout=90)
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


def one_line(stage: str, stderr: str, start: str = "") -> bool:
    """The script refused in exactly one stderr line, its own: `<stage>/train.py: error: <start>...`."""
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith(f"{stage}/train.py: error: {start}")


# --- the cases ------------------------------------------------------------------------------------------------

# The recipes' own flags; their contract flags are checked as in stage 04.
RECIPE_BAD_VALUES: dict[str, dict[tuple[str, ...], str]] = {
    "recipes/grad_accumulation": {("--accumulate", "0"): "--accumulate",
                                  ("--accumulate", "3"): "--accumulate",  # 3 x 64 does not divide 4096: a short step
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
    if stage == "10_pipeline_parallel":  # alone, a world of 1 has one stage; 3 micro-batches do not divide 64
        table |= {("--pp", "0"): "--pp", ("--pp", "2"): "--pp", ("--microbatches", "0"): "--microbatches",
                  ("--microbatches", "3"): "--microbatches", ("--schedule", "zb"): "--schedule"}
    if stage == "11_gpt":  # a GPT on a text: its length is --max-steps (no --epochs); the model's shape, the corpus
        del table[("--epochs", "-1")]
        table |= {("--max-steps", "0"): "--max-steps", ("--save-every", "0"): "--save-every",
                  ("--snapshot", "{file}"): "--snapshot", ("--snapshot", "{file}/ck"): "--snapshot",
                  ("--snapshot", "{ro}/ck"): "--snapshot", ("--parallel", "zero3"): "--parallel",
                  ("--tp", "0"): "--tp", ("--tp", "x"): "--tp", ("--tp", "2"): "--tp",  # a world of 1; and DDP
                  ("--accumulate", "0"): "--accumulate", ("--amp", "fp16"): "--amp",
                  ("--amp", "bf16", "--dtype", "float64"): "--amp",  # autocast leaves float64 alone
                  ("--compile=1",): "--compile", ("--data", "{file}/input.txt"): "--data",
                  ("--data", "{tmp}"): "--data",  # a directory
                  ("--context", "0"): "--context", ("--context", "200000"): "--context",  # longer than the text
                  ("--layers", "0"): "--layers", ("--heads", "0"): "--heads", ("--heads", "3"): "--heads",
                  ("--width", "0"): "--width", ("--eval-every", "0"): "--eval-every", ("--sample", "-1"): "--sample",
                  ("--sample", "x"): "--sample"}
    return table


# Spoilt snapshots (06: a file) and checkpoint directories (08), and resuming with other settings: each kind is
# checked in-process through main() (test_bad_snapshot_is_refused_in_one_line); one is also launched per stage.
SNAPSHOT_KINDS = {SNAPSHOT_STAGE: ["truncated", "not_torch", "foreign", "payload", "other_model", "other_seed",
                                   "other_dtype"],
                  CHECKPOINT_STAGE: ["truncated", "missing", "foreign", "payload", "other_model", "other_seed",
                                     "other_dtype"]}
LAUNCHED_KIND = "truncated"
LAUNCHED_BAD_VALUE = ("--batch-size", "0")  # the bad value launched for real in every stage; the rest: in-process
TYPO = ("--batchsize", "32")  # a misspelt flag: argparse's own error, also raised in parse_args


# A stall costs ~40 s (the launcher's SIGTERM grace), so there is one per way of launching: mp.spawn (03),
# torchrun on one node (04), two nodes (05), one for FSDP (08), whose collectives run inside autograd's hooks, and
# one for the pipeline (10), whose stages wait for each other in send/recv, not in collectives.
# 06 and 07 meet a stall as 04 does: the same torchrun agent, and the collective's timeout caught in main() by
# explain_peer_failure, word for word 04's (test_repo.py's contract test). They differ from 04 only in the store
# ddp_setup passes (used while joining, before any stall) and in the barrier after a snapshot, one more
# collective that times out like the others.
STALL_STAGES = ["03_ddp_spawn", "04_ddp_torchrun", "05_multinode", "08_fsdp", "10_pipeline_parallel"]


def cases() -> list[Case]:
    out = []
    for stage in STALL_STAGES:  # slow first: they wait for timeouts, and run beside the rest
        # 05: two nodes of two ranks, so the stalled rank 1 shares node 0 with rank 0, whose failure makes
        # that node's torchrun stop it. (A node whose only worker stalls is never told: see README.md.)
        stall = replace(CONFIGS["05"], nproc=2) if stage == "05_multinode" else None
        out.append(Case(f"{stage[:2]}-stalled-rank", stage, "SIGSTOP to rank 1 after epoch 1", None,
                        TIMEOUT + LAUNCHER_GRACE + SLACK, f"--timeout {TIMEOUT}s",
                        signalled(stage, signal.SIGSTOP, "--timeout", str(TIMEOUT), step=stall)))
    out += [Case("05-node-never-joins-static", "05_multinode", "node 0 of 2 started alone (static)", None,
                 10 + SLACK, "1/2 clients joined", lone_node("static")),
            Case("05-node-never-joins-c10d", "05_multinode", "node 0 of 2 started alone (c10d)", None,
                 10 + SLACK, "RendezvousTimeoutError", lone_node("c10d"))]
    for stage in DDP_STAGES:
        out.append(Case(f"{stage[:2]}-killed-rank", stage, "SIGKILL to rank 1 after epoch 1", None, 10,
                        "SIGKILL", signalled(stage, signal.SIGKILL)))
    out += [Case("03-port-taken", "03_ddp_spawn", "MASTER_PORT held by another process", 2, START,
                 "MASTER_PORT={port} is in use", port_taken("03_ddp_spawn"), one_line=True),
            Case("04-port-taken", "04_ddp_torchrun", "--master_port held by another process", None, START,
                 "port: {port}, useIpv6: false, code: -98, name: EADDRINUSE", port_taken("04_ddp_torchrun")),
            Case("05-port-taken", "05_multinode", "--master_port held by another process", None, START,
                 "port: {port}, useIpv6: false, code: -98, name: EADDRINUSE", port_taken("05_multinode"))]
    out.append(Case("08-disk-full", CHECKPOINT_STAGE, "the disk fills up while the shards are written", None, START,
                    "is still the last checkpoint", disk_fills_up(CHECKPOINT_STAGE), also=left_alone,
                    needs="full_disk"))
    out.append(Case(f"{SNAPSHOT_STAGE[:2]}-disk-full", SNAPSHOT_STAGE, "the disk fills up before a snapshot is saved",
                    None, START, "still holds the previous snapshot", disk_fills_up(SNAPSHOT_STAGE), also=left_alone,
                    needs="full_disk"))
    for stage in (SNAPSHOT_STAGE, CHECKPOINT_STAGE):
        out.append(Case(f"{stage[:2]}-snapshot-{LAUNCHED_KIND}", stage, f"--snapshot is {LAUNCHED_KIND}", 2, START,
                        "argument --snapshot: ", snapshot_given(stage, LAUNCHED_KIND), one_line=True, also=left_alone))
    for stage in STAGES:
        args, flag = LAUNCHED_BAD_VALUE, bad_values(stage)[LAUNCHED_BAD_VALUE]
        out.append(Case(f"{stage[:2]}{' '.join(args)}", stage, f"bad value {' '.join(args)}", 2, START,
                        f"argument {flag}: ", started_with(stage, *args), one_line=True))
    return out


CASES = cases()
# Checked in-process: (stage, arguments, what the one line must contain).
SCRIPTS = [*STAGES, *RECIPES]  # the recipes are stage 04 plus one technique: they refuse bad values alike
REFUSALS = [(stage, args, f"argument {flag}: ") for stage in SCRIPTS for args, flag in bad_values(stage).items()] + \
           [(stage, TYPO, f"unrecognized arguments: {' '.join(TYPO)}") for stage in SCRIPTS]


def short(script: str) -> str:
    return script[:2] if script in STAGES else script.removeprefix("recipes/")


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


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Iterator[Place]:
    """The paths alone (no snapshot, no disks): all that the in-process checks need."""
    tmp = tmp_path_factory.mktemp("faults")
    a_file = tmp / "a_file"
    a_file.write_text("not a directory")
    with contextlib.ExitStack() as stack:
        read_only = tmp / "read_only"
        if not stack.enter_context(mounted(read_only, "ro,size=1m")):
            read_only.chmod(0o555)  # not root: permissions make it read-only; root ignores them
            with contextlib.suppress(OSError), open(read_only / "probe", "w"):
                read_only = None  # writable after all: those cases are skipped
        yield Place(tmp, a_file, read_only, b"", None, tmp / "payload_ran", None)


@pytest.fixture(scope="module")
def place(paths) -> Iterator[Place]:
    tmp = paths.tmp
    good, good_checkpoint = tmp / "good.pt", tmp / "good_checkpoint"
    with ThreadPoolExecutor(max_workers=2) as pool:  # stage 06's snapshot and stage 08's checkpoint, at once
        made = pool.map(lambda step: check(launch(step)), [
            Step("06_checkpoint", "python", ("--device", "cpu", "--epochs", "1", "--snapshot", str(good))),
            Step(CHECKPOINT_STAGE, "python", ("--device", "cpu", "--epochs", "1", "--snapshot", str(good_checkpoint)))])
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
                      full_disk=full_disk if probe else None)


@pytest.fixture(scope="module")
def outcomes(place, request, background) -> dict[str, Outcome | BaseException]:
    """Every selected case's outcome, POOL cases at a time (the slow ones mostly wait)."""
    chosen = selected(request, "test_fault", "case")
    background.wait()  # the time bounds above hold on 2 cores shared by the battery alone (conftest.LAST)

    def one(case: Case) -> Outcome | BaseException:
        if case.needs and getattr(place, case.needs) is None:
            return pytest.skip.Exception(f"{case.needs} cannot be made here (needs root to mount a tmpfs)")
        try:
            return case.start(place)
        except BaseException as e:  # pytest.fail from the launcher (a hang), or a bug: reported by the case's test
            return e

    with ThreadPoolExecutor(max_workers=POOL) as pool:
        return dict(zip((c.id for c in chosen), pool.map(one, chosen), strict=True))


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
    assert outcome.seconds <= case.within, f"took {outcome.seconds:.1f}s > {case.within}s after the fault: {where}"
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


@pytest.mark.parametrize("stage,args,message", REFUSALS, ids=[f"{short(s)}{' '.join(a)}" for s, a, _ in REFUSALS])
def test_bad_value_is_refused_in_one_line(paths, stage, args, message):
    """What `python <stage>/train.py <args>` prints and exits with: parse_args is all main() runs before it."""
    if "{ro}" in "".join(args) and paths.read_only is None:
        pytest.skip("read_only cannot be made here (needs root to mount a tmpfs)")
    code, out, err = refusal(load_stage(stage), with_place(args, paths))
    where = f"{stage}/train.py {' '.join(args)}: exit {code}\nstdout: {out}\nstderr: {err}"
    assert code == 2, where
    assert one_line(stage, err) and message in err, where
    assert not out, where


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


@pytest.mark.parametrize("stage", SCRIPTS)
def test_main_checks_values_before_anything_else(stage):
    """Why the in-process checks stand for the script: main() starts with parse_args(argv), and running the file
    calls main(); the module's top level only defines (one real launch per stage, above, confirms the whole path)."""
    tree = ast.parse((ROOT / stage / "train.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    first = ast.unparse(main.body[0])
    assert first == "args = parse_args(argv)", f"{stage}: main() starts with {first!r}, not parse_args(argv)"
    entry = tree.body[-1]
    assert ast.unparse(entry) == "if __name__ == '__main__':\n    main()", f"{stage}: does not end by calling main()"


def test_bad_value_under_torchrun_fails_fast_with_the_line():
    run = launch(Step("04_ddp_torchrun", "torchrun", ("--batch-size", "0"), nproc=2), timeout=60)
    assert run.returncode != 0 and not run.survivors, run.describe()
    assert "argument --batch-size: must be a positive int, got 0" in run.stderr


def test_every_flag_of_every_stage_has_a_bad_value_case():
    """The battery grows with the stages: a new flag without a bad-value case fails here.

    The flags are those the parser itself lists in its usage line, and those the source declares.
    """
    for stage in SCRIPTS:
        code, usage, _ = refusal(load_stage(stage), ("--help",))
        assert code == 0, f"{stage}: --help exited {code}"
        usage = usage.split("\n\n")[0]  # the usage line (wrapped), before the description
        declared = set(re.findall(r"\[(--[a-z][a-z-]*)", usage)) - {"--help"}
        declared |= set(re.findall(r'add_argument\("(--[a-z-]+)"', (ROOT / stage / "train.py").read_text()))
        checked = {flag for s, _, message in REFUSALS if s == stage
                   for flag in re.findall(r"argument (--[a-z-]+): ", message)}
        missing = declared - checked
        assert declared and not missing, f"{stage}: no bad-value case for {sorted(missing)}"


@pytest.mark.parametrize("script,version,refused", [
    ("01_single_gpu", "1.13.1", True), ("07_model_parallel", "2.0.0", False), ("08_fsdp", "2.5.1", True),
    ("09_tensor_parallel", "2.5.1", True), ("09_tensor_parallel", "2.6.0", False),
    ("10_pipeline_parallel", "2.5.1", True), ("11_gpt", "2.5.1", True),
    ("ddp_by_hand/bucketed", "2.0.1", True), ("ddp_by_hand/bucketed", "2.1.0", False)])
def test_a_torch_older_than_the_script_needs_is_refused_in_one_line(script, version, refused, monkeypatch, capsys):
    """Each script needs the torch of NEEDS_TORCH (one table, in the shared block): 08-11 need 2.6 and check it at
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
