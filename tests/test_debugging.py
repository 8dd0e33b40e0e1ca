"""debugging/bugs.py: each planted bug shows its symptom, and the tool that finds it names its cause.

The runs are debugging/README.md's commands (conftest.readme_run: run once, in the background); the tests read
their output and the flight recorder's files, launching nothing. Each claim is checked against bugs.py's own source
(the line of a collective is found by its text) or the dumps' own records, not against numbers written here:
- only_rank0: the job fails no sooner than --timeout and within --timeout plus a measured margin; each rank's
  watchdog names the line of the collective it waits in, and the two are different collectives;
- mismatch: fr_trace names the sequence number where the ranks' recorded collectives first differ, the culprit
  rank and both kinds; the watchdog names rank 1's misplaced call;
- drift: the replica check names the parameter bugs.py changes and the step it changes it at;
- none: the same script without a bug passes every check (no false alarm).
Nothing is left running (readme_run's check).
"""
from __future__ import annotations

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
    limit = time_limit(programs=3, waits=TIMEOUT)  # mp.spawn's parent and 2 ranks
    assert TIMEOUT <= run.seconds <= limit, f"{run.seconds:.1f}s, not in [{TIMEOUT}, {limit:.1f}] ({limit.how})"
    assert run.stdout.count("Timed out waiting 6000ms") == 2, run.describe()  # both ranks, by gloo's timeout
    assert waits_at(run.stdout, 0)[:1] == [line_of("dist.all_reduce(total)  # BUG")], run.stdout
    assert waits_at(run.stdout, 1)[:1] == [line_of("dist.barrier()")], run.stdout


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
