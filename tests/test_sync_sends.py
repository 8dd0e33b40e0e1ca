"""The hand-written messages keep NCCL's rules, checked on gloo through tests/sync_sends.py; the old order did not.

On NCCL a send completes only once its receiver takes it (above the eager size), and a process's messages and
collectives run one after another; gloo runs each message on its own, and its collectives apart, so an order that
waits on itself passes on gloo and hangs on GPUs. tests/sync_sends.py runs a script with those rules laid over gloo
(see its docstring).

- by_hand.py's GPipe and 1F1B, and the library's train.py, through it: tests/test_pipeline.py's grid (dp 2 x pp 2
  and pp 3), whose launches also compare by_hand with the library (test_synchronous_in_order_messages_change_nothing);
- the ring and parameter-server all-reduces through it, under torchrun: every case of collectives/check.py;
- the negative control: by_hand.py with each exchange's messages posted one after the other, the send first (the
  order it had: an isend, then a blocking recv), at the grid's pp 3 launch with 1F1B, the very launch that passes
  there through sync_sends: it runs on gloo, and through sync_sends hangs in its first step until --timeout, which
  ends the job with the stage's message;
- a collective in the stream: a rank that posts a send and then an all-reduce, while its peer enters the all-reduce
  before it receives, hangs as on NCCL (where plain gloo runs it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import sync_sends
from test_pipeline import GRID

from harness import ROOT, TORCHRUN, Job, check, launch, launch_commands, load_copy, time_limit, with_args

STAGE = "10_pipeline_parallel"
CHECK = ROOT / "collectives" / "check.py"
POLL = 0.02  # how often the watcher reads the job's output (harness.Fault's pace)
# The negative control's launch: the grid's cheapest setting (3 processes, 41 steps an epoch, against 4 and 86 at
# dp 2 x pp 2) whose 1F1B by hand runs through sync_sends in tests/test_pipeline.py.
SETTING, SCHEDULE = "pp 3", "1f1b"
HANG = 10  # the planted collective's group timeout: how long its ranks wait for what never comes


def old_order(dest: Path) -> Path:
    """by_hand.py with each exchange's messages posted one by one in the list's order, the send first: as it was (and
    task.py, which it imports, beside it)."""
    text = (ROOT / STAGE / "by_hand.py").read_text()
    together = "for work in dist.batch_isend_irecv(ops):"
    assert text.count(together) == 1, "by_hand.py changed: expected one batch_isend_irecv in Pipe.exchange"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / STAGE / "task.py", dest / "task.py")
    path = dest / "by_hand.py"
    path.write_text(text.replace(together, "for work in [op.op(op.tensor, op.peer, op.group) for op in ops]:"))
    return path


def watcher(lines: dict[str, str], seen: dict[str, float]) -> Callable[[Job], None]:
    """For launch(during=...): records in `seen` when (seconds after the job's start) each of `lines` (name -> text)
    first appeared in its output."""
    def watch(job: Job) -> None:
        while not job.ended.is_set() and len(seen) < len(lines):
            out = job.output()
            for name, line in lines.items():
                if name not in seen and line in out:
                    seen[name] = time.monotonic() - job.start
            time.sleep(POLL)
    return watch


def test_the_old_order_runs_on_gloo_and_hangs_where_sends_are_synchronous(tmp_path):
    """The old order at the grid's pp 3 launch with 1F1B (its flags, processes and schedule, as the grid's fixture
    runs them; only the message order differs): gloo trains through it. Through sync_sends, in the first step,
    stage 1 sends the activations of micro-batch 1 and waits for their receipt before it receives the gradient of 0,
    while stage 2 sends that gradient and waits likewise (stage 0 waits behind them): each waits --timeout, and the
    job fails with the stage's line. Timed from the stage's first line (its start-up, measured in the same run): the
    failure comes at least --timeout after it (a hang, not a crash), and the job ends within --timeout plus one more
    start-up."""
    grid_step, synchronous = GRID[SETTING]
    assert synchronous[SCHEDULE], f"test_pipeline's {SETTING} {SCHEDULE} no longer runs through sync_sends: the " \
                                  f"control would have no passing twin"
    step = with_args(grid_step, "--schedule", SCHEDULE)  # as the grid's fixture makes it
    world = str(step.nproc)
    with mock.patch.dict(os.environ, {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}):
        args = load_copy(ROOT / STAGE / "by_hand.py").parse_args(list(step.args))  # the settings it runs with
    assert (args.pp, args.schedule) == (3, SCHEDULE) and args.microbatches >= args.pp, args
    timeout = args.timeout  # the grid's own --timeout: the control waits as long as its twin may
    script = old_order(tmp_path / "src")
    programs = step.nproc + 1  # its ranks and torchrun's agent
    plain = check(launch(step, script=script, timeout=time_limit(programs)))
    assert f"epoch {args.epochs}/{args.epochs}" in plain.stdout and sync_sends.messages(plain.stderr) == {}

    seen: dict[str, float] = {}
    watch = watcher({"start": "steps/epoch", "failure": "waited more than --timeout"}, seen)
    run = launch_commands(sync_sends.wrapped(step.commands(None, script), script), env=step.env,
                          timeout=time_limit(programs, waits=timeout), during=watch)
    assert run.returncode == 1 and not run.survivors, run.describe()
    assert "epoch 1/" not in run.stdout, "the first epoch never ends"
    assert f"waited more than --timeout {timeout:g}s for another rank" in run.stderr, run.describe()
    # Stages 1 and 2 wait on each other (whichever times out first may end the job before the other says so).
    assert re.search(r"sync_sends: rank (1: message \d+ to rank 2|2: message \d+ to rank 1) was never taken",
                     run.stderr), run.describe()
    assert seen.keys() == {"start", "failure"}, (seen, run.describe())
    startup = seen["start"]
    assert seen["failure"] - startup >= timeout, seen
    assert run.seconds <= startup + timeout + startup, (seen, run.seconds)


def test_the_hand_written_all_reduces_equal_dist_all_reduce_with_synchronous_sends(tmp_path):
    """collectives/check.py under torchrun (3 ranks), through sync_sends: the simple ring, the fast one (1 MiB and
    64-byte pieces) and the parameter server finish every case and equal dist.all_reduce (integers exactly), whose
    calls run in the same stream as the messages."""
    world = 3
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={world}", str(CHECK), "--out", str(tmp_path)]
    run = check(launch_commands(sync_sends.wrapped([cmd], CHECK), tmp_path, timeout=time_limit(world + 1)))
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in reports] == list(range(world)) and {r["world_size"] for r in reports} == {world}
    for report in reports:
        cases = report["cases"]
        assert {c["algorithm"] for c in cases} == {"ring_simple", "ring", "ring_pieces", "ps"}
        assert not [c for c in cases if not (c["matches_all_reduce"] and c["matches_expected"])], report["rank"]
        assert any(c["numel"] >= 1_000_000 for c in cases), "a tensor of several 1 MiB pieces per chunk"
    assert f"world size {world}: " in run.stdout and "FAILED" not in run.stdout
    counted = sync_sends.messages(run.stderr)
    assert sorted(counted) == list(range(world)) and min(counted.values()) > 1000, counted
    inputs = {(c["dtype"], tuple(c["shape"])) for c in reports[0]["cases"]}  # each checked against a dist.all_reduce
    collectives = sync_sends.collectives(run.stderr)
    assert sorted(collectives) == list(range(world)) and min(collectives.values()) > len(inputs), collectives


# Rank 0 posts a send (a batch of one, not waited) and then an all-reduce; rank 1 enters the all-reduce first and only
# then receives. On NCCL a batched message goes on the group's communicator, the one its collectives use, so each
# rank's two calls run in turn on one stream: rank 0's all-reduce waits behind its send, which waits for rank 1's
# receive, which waits behind rank 1's all-reduce, which waits for rank 0's. 16 MiB is four times NCCL's default
# buffer (NCCL_BUFFSIZE, 4 MiB), so the send cannot complete into the receiver's buffer alone. gloo runs the two calls
# apart: the all-reduce meets at once, then the receive. (Rank 1 receiving first, then entering the all-reduce, would
# not hang anywhere: the send is taken, then both all-reduce.)
AFTER_A_SEND = '''
import os, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist

def say(fd, line):  # one write: the ranks share stdout and stderr, and unbuffered print() writes the newline apart
    os.write(fd, f"{line}\\n".encode())


dist.init_process_group("gloo", timeout=timedelta(seconds=float(sys.argv[1])))
rank = dist.get_rank()
x = torch.full((4 << 20,), float(1 - rank))
y = torch.ones(1)
dist.all_reduce(y)  # every rank is up (on NCCL a group's first call must not be a batch of messages)
say(1, f"rank {rank}: posting")
start = time.monotonic()
try:
    if rank == 0:
        sent = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1)])
        dist.all_reduce(y)
        for work in sent:
            work.wait()
    else:
        dist.all_reduce(y)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 0)]):
            work.wait()
except RuntimeError as e:
    say(2, f"rank {rank}: failed after {time.monotonic() - start:.3f}s: {e}")
    os._exit(1)
assert y.item() == 4 and x.eq(1).all(), (y, x)
say(1, f"rank {rank}: done")
dist.destroy_process_group()
'''


def test_a_collective_waits_behind_a_send_nobody_has_taken(tmp_path):
    """AFTER_A_SEND (2 ranks, group timeout HANG): plain gloo runs it; through sync_sends, where the all-reduce is an
    item of the stream behind the send, rank 0's send waits HANG for a receive that never comes, and its all-reduce
    fails with it, while rank 1's all-reduce waits for rank 0's. Timed as the control above: rank 0 fails at least
    HANG after it posted (a hang, not a crash; its own clock), and the job ends within HANG plus one more start-up
    (the seconds from the job's start to the ranks' "posting" lines)."""
    script = tmp_path / "after_a_send.py"
    script.write_text(AFTER_A_SEND)
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(HANG)]
    plain = check(launch_commands([cmd], tmp_path, timeout=time_limit(3)))  # 2 ranks and torchrun's agent
    assert [f"rank {r}: done" in plain.stdout for r in (0, 1)] == [True, True] and sync_sends.messages(plain.stderr) \
        == {}, plain.describe()

    seen: dict[str, float] = {}
    watch = watcher({r: f"rank {r}: posting" for r in (0, 1)}, seen)
    run = launch_commands(sync_sends.wrapped([cmd], script), tmp_path, timeout=time_limit(3, waits=HANG),
                          during=watch)
    assert run.returncode == 1 and not run.survivors and "done" not in run.stdout, run.describe()
    failed = dict(re.findall(r"^rank (\d): failed after ([\d.]+)s", run.stderr, re.M))
    assert failed.keys() == {"0", "1"}, run.describe()
    assert re.search(r"^rank 0: failed after [\d.]+s: sync_sends: rank 0: message 0 to rank 1 was never taken",
                     run.stderr, re.M), run.describe()
    assert float(failed["0"]) >= HANG, failed
    assert sync_sends.collectives(run.stderr) == {0: 1, 1: 1}, run.describe()  # the first all-reduce, in the stream
    startup = max(seen.values()) if seen.keys() == {0, 1} else None
    assert startup is not None and run.seconds <= startup + HANG + startup, (seen, run.seconds)
