"""The hand-written messages keep NCCL's rules, checked on gloo through tests/sync_sends.py; the old order did not.

On NCCL a send completes only once its receiver takes it (above the eager size), and a process's messages run one
after another; gloo runs each message on its own, so an order of sends and receives that waits on itself passes on
gloo and hangs on GPUs. tests/sync_sends.py runs a script with those two rules laid over gloo (see its docstring).

- by_hand.py's GPipe and 1F1B, and the library's train.py, through it: tests/test_pipeline.py's grid (dp 2 x pp 2
  and pp 3), whose launches also compare by_hand with the library (test_synchronous_in_order_messages_change_nothing);
- the ring and parameter-server all-reduces through it, under torchrun: every case of collectives/check.py;
- the negative control: by_hand.py with each exchange's messages posted one after the other, the send first (the
  order it had: an isend, then a blocking recv), runs on gloo, and through sync_sends hangs in its first 1F1B step
  until --timeout, which ends the job with the stage's message.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import sync_sends

from conftest import CONFIGS
from harness import ROOT, TORCHRUN, Job, check, launch, launch_commands, with_args

STAGE = "10_pipeline_parallel"
CHECK = ROOT / "collectives" / "check.py"
TIMEOUT = 10  # --timeout of the negative control: how long its stages wait for a message nobody takes
POLL = 0.02  # how often the watcher reads the job's output (harness.Fault's pace)


def old_order(dest: Path) -> Path:
    """by_hand.py with each exchange's messages posted one by one in the list's order, the send first: as it was."""
    text = (ROOT / STAGE / "by_hand.py").read_text()
    together = "for work in dist.batch_isend_irecv(ops):"
    assert text.count(together) == 1, "by_hand.py changed: expected one batch_isend_irecv in Pipe.exchange"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "by_hand.py"
    path.write_text(text.replace(together, "for work in [op.op(op.tensor, op.peer, op.group) for op in ops]:"))
    return path


def test_the_old_order_runs_on_gloo_and_hangs_where_sends_are_synchronous(tmp_path):
    """The old order (1F1B, pp 2, the tour's settings, 1 epoch): gloo trains through it. Through sync_sends, stage 0
    sends the activations of micro-batch 1 and waits for their receipt before it receives the gradient of 0, while
    stage 1 sends that gradient and waits likewise: each waits --timeout, and the job fails with the stage's line.
    Timed from the stage's first line (its start-up, measured in the same run): the failure comes at least --timeout
    after it (a hang, not a crash), and the job ends within --timeout plus one more start-up."""
    script = old_order(tmp_path / "src")
    step = with_args(CONFIGS["10"], "--epochs", "1", "--timeout", str(TIMEOUT))
    assert step.args[step.args.index("--pp") + 1] == "2" and "--schedule" not in step.args  # 1F1B, the default
    plain = check(launch(step, script=script))
    assert "epoch 1/1" in plain.stdout and sync_sends.messages(plain.stderr) == {}

    seen: dict[str, float] = {}

    def watch(job: Job) -> None:
        while not job.ended.is_set() and len(seen) < 2:
            out = job.output()
            for name, line in (("start", "steps/epoch"), ("failure", "waited more than --timeout")):
                if name not in seen and line in out:
                    seen[name] = time.monotonic() - job.start
            time.sleep(POLL)
    run = launch_commands(sync_sends.wrapped(step.commands(None, script), script), env=step.env, timeout=300,
                          during=watch)
    assert run.returncode == 1 and not run.survivors, run.describe()
    assert "epoch 1/" not in run.stdout, "the first epoch never ends"
    assert f"waited more than --timeout {TIMEOUT}s for another rank" in run.stderr, run.describe()
    assert re.search(r"sync_sends: rank [01]: message \d+ to rank [01] was never taken", run.stderr), run.describe()
    assert seen.keys() == {"start", "failure"}, (seen, run.describe())
    startup = seen["start"]
    assert seen["failure"] - startup >= TIMEOUT, seen
    assert run.seconds <= startup + TIMEOUT + startup, (seen, run.seconds)


def test_the_hand_written_all_reduces_equal_dist_all_reduce_with_synchronous_sends(tmp_path):
    """collectives/check.py under torchrun (3 ranks), through sync_sends: the simple ring, the fast one (1 MiB and
    64-byte pieces) and the parameter server finish every case and equal dist.all_reduce (integers exactly)."""
    world = 3
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={world}", str(CHECK), "--out", str(tmp_path)]
    run = check(launch_commands(sync_sends.wrapped([cmd], CHECK), tmp_path, timeout=600))
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
