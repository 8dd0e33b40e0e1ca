"""debugging/bugs.py: each planted bug shows its symptom, and the tool that finds it names its cause.

The runs are debugging/README.md's commands (conftest.readme_run: run once, in the background); the tests read
their output and the flight recorder's files, launching nothing. Each claim is checked against bugs.py's own source
(the line of a collective is found by its text) or the dumps' own records, not against numbers written here:
- only_rank0: the job fails no sooner than --timeout and within --timeout plus a measured margin; each rank's
  watchdog names the line of the collective it waits in, and the two are different collectives;
- mismatch: fr_trace names the sequence number where the ranks' recorded collectives first differ, the culprit
  rank and both kinds; the watchdog names rank 1's misplaced call;
- drift: the replica check names the parameter bugs.py changes and the step it changes it at;
- dropout: a seed per rank before DDP(...) and a dropout drawing each rank's masks from it: the replicas stay equal,
  and the loss is not the run without dropout's; seed: a layer drawn afresh after DDP(...) from each rank's seed is
  named by the replica check at step 0, and no parameter before it (drawn before DDP(...), broadcast) is;
- none: the same script without a bug passes every check (no false alarm);
- unused, replaced, twice: DDP's own error on every rank, and the parameters it names (by index, and by name under
  TORCH_DISTRIBUTED_DEBUG=INFO) are the ones bugs.py leaves without a gradient or uses twice, found in its own model;
  unused with the replica check on: the replicas part at step 0, a step before DDP's error; with
  --find-unused it trains and every check passes; replaced with --find-unused: the new layer parts at step 0;
- nan: without a check the NaN reaches every parameter of every rank; the finite check names rank 1 and the step;
- crash (under torchrun): one rank's exception ends the job well before --timeout, and the first error line names
  that rank; torchrun's summary lists it, and its Root Cause is the failure it stamped first, the other rank only
  when both carry the same second;
- sendrecv: an isend then a recv on both ranks trains on gloo; under NCCL's rules (--sync-sends, tests/sync_sends.py)
  it hangs until --timeout, each rank's stack dump names the line of its receive, and a send is never taken;
- set_epoch: the replicas stay equal, and the loss comparison with a run that calls it names the first step of
  the second epoch (stage 04's data over 2 ranks of --batch-size).
Nothing is left running (readme_run's check). parse_args, in this process: an --against file that is not what --losses
writes, or shorter than --steps, is refused; so are the flags --time-find-unused would ignore; under torchrun the
world-size checks see its ranks and name --nproc_per_node; --steps is refused only where the bug would not show
(none: never; set_epoch: within the first epoch, counted as DistributedSampler pads it).
"""
from __future__ import annotations

import json
import math
import pickle
import re

import pytest

from conftest import readme_run
from harness import ROOT, import_script, time_limit

BUGS = ROOT / "debugging" / "bugs.py"
TIMEOUT = 6  # the --timeout of the README's hanging commands
NONE = "python debugging/bugs.py --bug none"
HANG = f'python debugging/bugs.py --bug only_rank0 --timeout {TIMEOUT} 2>&1 || echo "exit status $?"'
MISMATCH = f'python debugging/bugs.py --bug mismatch --timeout {TIMEOUT} --trace runs/fr 2>&1 || echo "exit status $?"'
DRIFT = 'python debugging/bugs.py --bug drift 2>&1 || echo "exit status $?"'
UNUSED = ('TORCH_DISTRIBUTED_DEBUG=INFO python debugging/bugs.py --bug unused --no-replica-check 2>&1 '
          '|| echo "exit status $?"')
UNUSED_CHECKED = 'python debugging/bugs.py --bug unused 2>&1 || echo "exit status $?"'
FIND_UNUSED = "python debugging/bugs.py --bug unused --find-unused"
REPLACED = ('TORCH_DISTRIBUTED_DEBUG=INFO python debugging/bugs.py --bug replaced --no-replica-check 2>&1 '
            '|| echo "exit status $?"')
TWICE = 'python debugging/bugs.py --bug twice 2>&1 || echo "exit status $?"'
NAN = "python debugging/bugs.py --bug nan 2>&1"
NAN_CHECK = 'python debugging/bugs.py --bug nan --finite-check 2>&1 || echo "exit status $?"'
CRASH_TIMEOUT = 120  # the --timeout of the crash's command: far above its time limit
CRASH = (f'torchrun --standalone --nproc_per_node=2 debugging/bugs.py --bug crash --timeout {CRASH_TIMEOUT} 2>&1 '
         '|| echo "exit status $?"')
DROPOUT = "python debugging/bugs.py --bug dropout"
SEED = 'python debugging/bugs.py --bug seed 2>&1 || echo "exit status $?"'
SENDRECV_SYNC = (f'python debugging/bugs.py --bug sendrecv --sync-sends --timeout {TIMEOUT} 2>&1 '
                 '|| echo "exit status $?"')
SET_EPOCH = ('python debugging/bugs.py --bug set_epoch --steps 72 --against runs/losses.json 2>&1 '
             '|| echo "exit status $?"')
UNFINISHED = "Expected to have finished reduction in the prior iteration before starting a new one"


@pytest.fixture(scope="module")
def bugs():
    return import_script(BUGS, "debugging_bugs")


def line_of(text: str) -> int:
    """The line of bugs.py that holds `text` (exactly one)."""
    found = [i for i, line in enumerate(BUGS.read_text().splitlines(), 1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def waits_at(output: str, rank: int) -> list[int]:
    """The lines of bugs.py in `rank`'s watchdog dumps (innermost first)."""
    frames = re.findall(rf'^\[rank {rank}\]   File "[^"]*debugging/bugs\.py", line (\d+) in (?!worker)', output, re.M)
    return [int(n) for n in frames]


@pytest.mark.readme_run(HANG)
def test_a_collective_only_rank_0_calls_hangs_until_the_timeout_and_the_stacks_name_each_rank_s_line(readme_runs):
    run = readme_run(readme_runs, HANG)
    assert "exit status 1" in run.stdout, run.describe()
    limit = time_limit(programs=3, waits=TIMEOUT)  # the launcher and its 2 ranks
    assert TIMEOUT <= run.seconds <= limit, f"{run.seconds:.1f}s, not in [{TIMEOUT}, {limit:.1f}] ({limit.how})"
    errors = dict(re.findall(r"^\[rank (\d)\] RuntimeError: (.*)$", run.stdout, re.M))
    # The first rank to fail: by gloo's timeout. The other (if the launcher has not stopped it first): the same, or the
    # first one's exit.
    assert "Timed out waiting 6000ms" in "".join(errors.values()), run.describe()
    assert all("Timed out waiting 6000ms" in e or "Connection closed by peer" in e for e in errors.values()), errors
    assert waits_at(run.stdout, 0)[:1] == [line_of("dist.all_reduce(total)  # BUG")], run.stdout
    assert waits_at(run.stdout, 1)[:1] == [line_of("dist.barrier()  # sync point: every rank done")], run.stdout


@pytest.mark.readme_run(MISMATCH)
def test_collectives_in_another_order_are_named_by_the_flight_recorder_at_the_first_sequence_id_they_differ(
        readme_runs):
    run = readme_run(readme_runs, MISMATCH)
    assert "exit status 1" in run.stdout, run.describe()
    dumps = {r: pickle.loads((run.out / "runs" / "fr" / f"rank_{r}").read_bytes())["entries"] for r in (0, 1)}
    calls = {r: [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"]) for e in entries]
             for r, entries in dumps.items()}
    first = next(a for a, b in zip(calls[0], calls[1], strict=False) if a != b)  # from the records themselves
    named = re.search(r"Collective sequence number: (\d+) has errors", run.stdout)
    assert named and int(named.group(1)) == first[0], (first, run.stdout)
    assert ("Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' does not "
            "match found collective type: 'all_gather'") in run.stdout, run.stdout
    expected = line_of("dist.all_reduce(summed)  # sync point")  # rank 0's call, where it waits
    assert f"debugging/bugs.py:{expected}" in run.stdout.split("collective stack trace:")[1], run.stdout
    assert waits_at(run.stdout, 1)[1:2] == [line_of("replica_check(model.module, step)  # BUG")], run.stdout


@pytest.mark.readme_run(DRIFT)
def test_replicas_that_part_are_named_by_parameter_and_step(readme_runs, bugs):
    run = readme_run(readme_runs, DRIFT)
    assert "exit status 1" in run.stdout, run.describe()
    found = re.search(r"replica check: step (\d+): parameter (\S+) differs between ranks \(checksums (\S+), (\S+)\)",
                      run.stdout)
    assert found, run.stdout
    step, name, rank0, rank1 = found.groups()
    assert (int(step), name) == (bugs.BUG_STEP, "head.2.bias"), found.group(0)  # bugs.py zeroes head[2].bias
    assert float(rank0) == 0 and float(rank1) != 0, found.group(0)


@pytest.mark.readme_run(NONE)
def test_without_a_bug_every_check_passes(readme_runs, bugs):
    run = readme_run(readme_runs, NONE)  # exit 0, nothing left running
    steps = bugs.parse_args([]).steps
    assert f"replica check: {steps} steps, every parameter equal on 2 ranks" in run.stdout, run.stdout
    assert "watchdog" not in run.stdout + run.stderr and "differs" not in run.stdout, run.describe()


@pytest.mark.readme_run(NONE, DROPOUT)
def test_a_seed_per_rank_before_ddp_and_a_rank_dependent_dropout_keep_the_replicas_equal(readme_runs, bugs):
    run = readme_run(readme_runs, DROPOUT)  # the block's run: dropout, then seed
    dropout, equal, _ = run.stdout.partition(f"replica check: {bugs.parse_args([]).steps} steps, every parameter "
                                             "equal on 2 ranks\n")
    assert equal and "differs" not in dropout and "watchdog" not in dropout, run.describe()
    loss = re.compile(r"trained \d+ steps \| mean loss (\S+)")
    with_dropout, without = loss.search(dropout), loss.search(readme_run(readme_runs, NONE).stdout)
    assert with_dropout and without and with_dropout.group(1) != without.group(1), run.stdout  # the dropout is on


@pytest.mark.readme_run(SEED)
def test_a_layer_drawn_after_ddp_from_a_seed_per_rank_is_named_by_the_replica_check_at_step_0(readme_runs, bugs):
    run = readme_run(readme_runs, SEED)
    _, _, seed = run.stdout.partition("every parameter equal on 2 ranks\n")  # after the block's dropout run
    assert "exit status 1" in seed, run.describe()
    redrawn = re.search(r"model\.module\.(\w+)\[(\d+)\]\.reset_parameters\(\)  # BUG", BUGS.read_text())
    assert redrawn, "bugs.py draws no layer after DDP(...)"
    found = re.search(r"replica check: step (\d+): parameter (\S+) differs between ranks \(checksums (\S+), (\S+)\)",
                      seed)
    assert found, run.stdout
    step, name, rank0, rank1 = found.groups()
    assert (step, name) == ("0", f"{redrawn.group(1)}.{redrawn.group(2)}.weight"), found.group(0)
    assert float(rank0) != float(rank1), found.group(0)
    # The first parameter that differs: those before it, drawn before DDP(...) from the same seeds, were broadcast.
    assert param_names(bugs.stage.Net()).index(name) > 0, name


def param_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def failed_ranks(output: str, error: str) -> list[int]:
    """The ranks that printed DDP's `error` (at least one: the launcher may stop the other before it prints)."""
    ranks = sorted({int(r) for r in re.findall(rf"^\[rank (\d)\] RuntimeError: {re.escape(error)}", output, re.M)})
    assert ranks, output
    return ranks


def ddp_named(output: str, rank: int, what: str) -> tuple[set[str], set[str]]:
    """The parameters DDP's error on `rank` names: by name (TORCH_DISTRIBUTED_DEBUG=INFO) and by index."""
    names = re.search(rf"^\[rank {rank}\] Parameters which did not receive grad for rank {rank}: (.+)$", output, re.M)
    indices = re.search(rf"^\[rank {rank}\] Parameter indices which did not receive grad for rank {rank}: (.+)$",
                        output, re.M)
    assert names and indices, (what, output)
    return set(names.group(1).split(", ")), {int(i) for i in indices.group(1).split()}


@pytest.mark.readme_run(UNUSED)
def test_a_layer_the_forward_skips_is_named_by_ddp_s_own_error(readme_runs, bugs):
    run = readme_run(readme_runs, UNUSED)
    assert "exit status 1" in run.stdout, run.describe()
    model = bugs.make_model("unused")
    spare = set(param_names(model)) - set(param_names(bugs.stage.Net()))  # the parameters stage 04's Net lacks
    assert spare == {"spare.weight", "spare.bias"}, spare
    for rank in failed_ranks(run.stdout, UNFINISHED):  # the symptom
        names, indices = ddp_named(run.stdout, rank, "unused")
        assert names == spare, names
        assert {param_names(model)[i] for i in indices} == spare, indices


@pytest.mark.readme_run(UNUSED_CHECKED)
def test_a_layer_the_forward_skips_parts_the_replicas_a_step_before_ddp_s_error(readme_runs, bugs):
    run = readme_run(readme_runs, UNUSED_CHECKED)
    assert "exit status 1" in run.stdout, run.describe()
    found = re.search(r"replica check: step (\d+): parameter (\S+) differs between ranks", run.stdout)
    assert found and found.group(1) == "0", run.stdout  # the first step: its all-reduce never ran
    assert found.group(2) in param_names(bugs.stage.Net()) and UNFINISHED not in run.stdout, run.stdout


@pytest.mark.readme_run(FIND_UNUSED)
def test_find_unused_parameters_lets_the_layer_the_forward_skips_train(readme_runs, bugs):
    run = readme_run(readme_runs, FIND_UNUSED)  # exit 0
    steps = bugs.parse_args([]).steps
    assert f"replica check: {steps} steps, every parameter equal on 2 ranks" in run.stdout, run.stdout


@pytest.mark.readme_run(REPLACED)
def test_a_layer_replaced_after_ddp_is_named_by_ddp_s_own_error(readme_runs):
    run = readme_run(readme_runs, REPLACED)
    assert "exit status 1" in run.stdout, run.describe()
    source = BUGS.read_text()
    replaced = re.search(r"model\.module\.(\w+)\[(\d+)\] = .*# BUG", source)  # the layer bugs.py replaces
    assert replaced, "bugs.py replaces no layer"
    layer = f"{replaced.group(1)}.{replaced.group(2)}"
    for rank in failed_ranks(run.stdout, UNFINISHED):
        names, _ = ddp_named(run.stdout, rank, "replaced")
        assert names == {f"{layer}.weight", f"{layer}.bias"}, names  # the old layer's, which DDP still waits for
    # The block's second command, with --find-unused: no error, but the new layer's gradients are never averaged.
    drift = re.search(r"replica check: step (\d+): parameter (\S+) differs between ranks", run.stdout)
    assert drift and drift.group(1) == "0" and drift.group(2).startswith(f"{layer}."), run.stdout


@pytest.mark.readme_run(TWICE)
def test_a_layer_in_two_reentrant_checkpoints_is_named_by_ddp_s_own_error(readme_runs, bugs):
    run = readme_run(readme_runs, TWICE)
    assert "exit status 1" in run.stdout, run.describe()
    shared = {f"head.0.{name}" for name, _ in bugs.make_model("twice").head[0].named_parameters()}  # checkpointed
    for rank in failed_ranks(run.stdout, "Expected to mark a variable ready only once."):
        named = re.search(rf"^\[rank {rank}\] Parameter at index (\d+) with name (\S+) has been marked as ready "
                          "twice", run.stdout, re.M)
        assert named and named.group(2) in shared, run.stdout
        assert param_names(bugs.make_model("twice"))[int(named.group(1))] == named.group(2), named.group(0)


@pytest.mark.readme_run(NAN)
def test_a_nan_on_one_rank_reaches_every_parameter_of_every_rank(readme_runs, bugs):
    run = readme_run(readme_runs, NAN)  # exit 0: nothing stops it
    assert "mean loss nan" in run.stdout, run.stdout
    total = len(param_names(bugs.stage.Net()))
    for rank in (0, 1):  # rank 0's data was clean
        assert f"[rank {rank}] {total} of {total} parameters hold NaN or inf" in run.stdout, run.stdout


@pytest.mark.readme_run(NAN_CHECK)
def test_the_finite_check_names_the_rank_and_the_step_where_the_loss_is_not_finite(readme_runs, bugs):
    run = readme_run(readme_runs, NAN_CHECK)
    assert "exit status 1" in run.stdout, run.describe()
    found = re.search(r"finite check: step (\d+): the loss is nan on rank (\d+) \(losses (\S+), (\S+)\)", run.stdout)
    assert found, run.stdout
    assert (int(found.group(1)), found.group(2)) == (bugs.BUG_STEP, "1"), found.group(0)
    assert float(found.group(3)) > 0 and found.group(4) == "nan", found.group(0)  # rank 0's loss is finite
    assert "hold NaN" not in run.stdout, run.stdout  # stopped before backward spread it


@pytest.mark.readme_run(CRASH)
def test_an_exception_on_one_rank_ends_the_job_before_the_timeout_and_the_first_error_names_the_rank(readme_runs):
    run = readme_run(readme_runs, CRASH)
    assert "exit status 1" in run.stdout, run.describe()
    # Before --timeout: no rank's watchdog fired, so no step waited half of it; the run's own limit bounds the rest.
    assert "watchdog" not in run.stdout and run.seconds < CRASH_TIMEOUT, f"{run.seconds:.1f}s\n{run.stdout}"
    errors = re.findall(r"^\[rank (\d)\] (\w+Error): ", run.stdout, re.M)
    assert errors[:1] == [("1", "OutOfMemoryError")], run.stdout  # the first error line: the rank that started it
    assert any(rank == "0" for rank, _ in errors), run.stdout  # rank 0 fails too, on rank 1's exit
    # torchrun's summary: each failure it saw, stamped to the second when it saw it; the Root Cause the earliest stamp.
    summary = run.stdout.partition("debugging/bugs.py FAILED")[2]
    failures, _, root = summary.partition("Root Cause (first observed failure):")
    entry = r"time\s+: (\S+)\n.*?rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)"
    listed = {int(r): (t, int(code)) for t, r, code in re.findall(entry, failures + root, re.S)}
    (root_time, root_rank, _), = re.findall(entry, root, re.S)
    assert listed.get(1, (None, None))[1] == 1, run.stdout  # the rank that started it: exit code 1
    assert all(root_time <= t for t, _ in listed.values()), listed  # stamps in ISO form: they sort as text
    # It names rank 1 unless rank 0's echo carries the same second: then the lower rank wins the tie.
    assert int(root_rank) == 1 or listed[1][0] == root_time, (root_rank, listed)


@pytest.mark.readme_run(SENDRECV_SYNC)
def test_both_ranks_sending_first_runs_on_gloo_and_hangs_under_nccl_s_rule_the_stacks_naming_the_receives(
        readme_runs):
    run = readme_run(readme_runs, SENDRECV_SYNC)  # the block's run: the same on gloo, then under sync_sends
    gloo, _, synchronous = run.stdout.partition("watchdog")
    assert "replica check: 8 steps, every parameter equal on 2 ranks" in gloo, run.stdout  # gloo trains through it
    assert "exit status 1" in synchronous, run.describe()
    limit = time_limit(programs=6, waits=TIMEOUT)  # two runs of the launcher and its 2 ranks
    assert TIMEOUT <= run.seconds <= limit, f"{run.seconds:.1f}s, not in [{TIMEOUT}, {limit:.1f}] ({limit.how})"
    receive = line_of("dist.recv(theirs, 1 - rank)")
    for rank in (0, 1):  # each waits in its receive, queued behind its own send, which the other never receives
        assert waits_at(run.stdout, rank)[:1] == [receive], run.stdout
    assert re.search(r"sync_sends: rank \d: message 0 to rank \d was never taken", run.stdout), run.stdout


@pytest.mark.readme_run(SET_EPOCH)
def test_a_forgotten_set_epoch_is_named_by_the_loss_comparison_at_the_second_epoch_s_first_step(readme_runs, bugs):
    run = readme_run(readme_runs, SET_EPOCH)  # the block's run: the reference, then the bug against it
    assert "exit status 1" in run.stdout and "differs between ranks" not in run.stdout, run.describe()
    found = re.search(r"loss comparison: step (\d+): mean loss (\S+), the reference run's (\S+)", run.stdout)
    assert found, run.stdout
    per_epoch = bugs.stage.N_TRAIN // (2 * bugs.parse_args([]).batch_size)  # steps in an epoch on 2 ranks
    assert int(found.group(1)) == per_epoch, found.group(0)


# parse_args, in this process: each setting is refused in one line naming its flag, or accepted as it works.
def parsed(bugs, monkeypatch, capsys, *argv: str, torchrun_world: int | None = None):
    """parse_args(argv) as `python debugging/bugs.py` sees it, or as a rank of torchrun's `torchrun_world` ranks:
    the Namespace, or the refusal's line (asserted one line, exit 2)."""
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if torchrun_world is not None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        monkeypatch.setenv("WORLD_SIZE", str(torchrun_world))
    try:
        return bugs.parse_args(list(argv))
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and err.count("\n") == 1 and err.startswith("debugging/bugs.py: error: argument "), err
        return err


def test_against_takes_only_what_losses_writes_with_a_loss_for_every_step(bugs, monkeypatch, capsys, tmp_path):
    written = tmp_path / "losses.json"
    written.write_text(json.dumps([1.25, 1.0, 0.75, 0.5]) + "\n")  # as train() writes --losses: 4 steps
    for shape in ({"a": 1}, [], ["1.0"], [True], 1.0, [[1.0]]):
        other = tmp_path / "other.json"
        other.write_text(json.dumps(shape))
        err = parsed(bugs, monkeypatch, capsys, "--against", str(other))
        assert isinstance(err, str) and "argument --against: " in err and "not a --losses file" in err, (shape, err)
    err = parsed(bugs, monkeypatch, capsys, "--steps", "6", "--against", str(written))  # steps 4 and 5 uncompared
    assert isinstance(err, str) and "argument --against: " in err and "give --steps 4" in err, err
    for steps in ("4", "2"):  # a file as long as the run, or longer
        assert parsed(bugs, monkeypatch, capsys, "--steps", steps, "--against", str(written)).against == written


@pytest.mark.parametrize("flag", [("--bug", "drift"), ("--against", "{file}"), ("--finite-check",),
                                  ("--losses", "{dir}/l.json"), ("--find-unused",), ("--trace", "{dir}/fr")])
def test_time_find_unused_refuses_the_flags_it_would_ignore(bugs, monkeypatch, capsys, tmp_path, flag):
    # It times stage 04's clean step both ways: no bug, no check, no loss written or compared, no watchdog armed.
    (tmp_path / "ref.json").write_text(json.dumps([1.0] * 8))
    given = [a.format(file=tmp_path / "ref.json", dir=tmp_path) for a in flag]
    err = parsed(bugs, monkeypatch, capsys, "--time-find-unused", "2", *given)
    assert isinstance(err, str) and f"argument {flag[0]}: " in err and "--time-find-unused" in err, err


def test_time_find_unused_takes_the_flags_it_uses(bugs, monkeypatch, capsys):
    args = parsed(bugs, monkeypatch, capsys, "--time-find-unused", "2", "--steps", "3", "--batch-size", "16",
                  "--seed", "1", "--world-size", "3", "--timeout", "5", "--sync-sends")
    assert not isinstance(args, str) and (args.steps, args.world_size) == (3, 3), args


def test_under_torchrun_the_world_size_checks_see_its_ranks_and_name_nproc_per_node(bugs, monkeypatch, capsys):
    err = parsed(bugs, monkeypatch, capsys, "--bug", "sendrecv", torchrun_world=3)  # hung to the watchdog
    assert isinstance(err, str) and "argument --nproc_per_node" in err and "give 2" in err, err
    err = parsed(bugs, monkeypatch, capsys, "--bug", "drift", torchrun_world=1)  # "every parameter equal on 1 ranks"
    assert isinstance(err, str) and "argument --nproc_per_node" in err, err
    err = parsed(bugs, monkeypatch, capsys, "--world-size", "2", torchrun_world=3)  # torchrun's 3 would run
    assert isinstance(err, str) and "argument --world-size: " in err and "--nproc_per_node" in err, err
    assert parsed(bugs, monkeypatch, capsys, "--bug", "sendrecv", torchrun_world=2).world_size == 2
    assert parsed(bugs, monkeypatch, capsys, "--world-size", "3", torchrun_world=3).world_size == 3
    assert parsed(bugs, monkeypatch, capsys).world_size == 2  # without torchrun: --world-size's default


def test_steps_are_refused_only_where_the_bug_would_not_show(bugs, monkeypatch, capsys):
    assert parsed(bugs, monkeypatch, capsys, "--steps", "1").steps == 1  # no bug to wait for
    err = parsed(bugs, monkeypatch, capsys, "--bug", "drift", "--steps", str(bugs.BUG_STEP))
    assert isinstance(err, str) and "argument --steps: " in err, err
    # set_epoch shows from the second epoch on: stage 04's data over W ranks of B, as DistributedSampler pads it.
    for world, batch in ((3, 32), (2, 32), (2, 100)):
        epoch = math.ceil(math.ceil(bugs.stage.N_TRAIN / world) / batch)
        given = ("--bug", "set_epoch", "--world-size", str(world), "--batch-size", str(batch))
        err = parsed(bugs, monkeypatch, capsys, *given, "--steps", str(epoch))
        assert isinstance(err, str) and "argument --steps: " in err and f"give {epoch + 1} steps" in err, err
        assert parsed(bugs, monkeypatch, capsys, *given, "--steps", str(epoch + 1)).steps == epoch + 1
