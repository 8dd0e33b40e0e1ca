"""ddp_by_hand/: data parallelism written by hand computes stage 01's training, and overlaps as DDP does.

Claims, each with the control that shows it can fail:
- naive.py and bucketed.py (2 ranks, float64) replay every epoch with stage 01's code and end bit for bit at stage
  04's weights (at W = 2 any correct mean does: a + b = b + a, and halving is exact); vs_ddp.py's table shows the
  layout: at W = 4 HandDDP (DDP's rebuilt buckets) is DDP to the bit from step 2, and says why W = 3 differs;
- the two send the same bytes per step, in one all-reduce per parameter against one per bucket: the scripts'
  counters, and a count from outside (a wrapper around torch.distributed.all_reduce, at W = 2) that agrees;
- a wrong divisor (the sum, not the mean) and a gradient left out of the averaging fail the replay;
- the buckets are DDP's (the same parameters, in the same order, for several caps);
- the first all-reduce is launched while backward still runs, and in the negative control (the same code,
  launched after backward) only when every gradient is there; the quick profiling run measures overlap > 0 for
  the hand-built version and exactly 0 for the control;
- no_sync() accumulates without communicating, and the next backward all-reduces the sum: at W = 2, where the
  result (the mean over the ranks) differs from a rank's own sum;
- the quick profiling run's step waits for every all-reduce: the all-reduce time after backward, on gloo's threads,
  is at most the main thread's wait between backward and the step, and without that wait it is not;
- the README's two diffs are today's files, and the machinery below the lesson is stage 04's.

The training runs are the README's commands (conftest.readme_run: run once, in the background); the controls and
the in-process checks cost ~20 CPU-s, and the W = 2 job (two forked processes of one fresh interpreter) ~4 CPU-s.
"""
from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from conftest import readme_run
from harness import (
    ROOT,
    TORCHRUN,
    check,
    edited,
    forked_ranks,
    gradient_bytes,
    group_of_one,
    launch_commands,
    replay_error,
    time_limit,
    tolerance,
)
from lesson_diffs import BOUNDARY, FILE_DIFFS, file_diff, file_diff_block
from tools.cli import read_csv

HERE = ROOT / "ddp_by_hand"
COMMON = "--batch-size 32 --dtype float64 --epochs 5"
NAIVE = f"torchrun --standalone --nproc_per_node=2 ddp_by_hand/naive.py {COMMON} --out runs/hand_naive"
BUCKETED = f"torchrun --standalone --nproc_per_node=2 ddp_by_hand/bucketed.py {COMMON} --out runs/hand_bucketed"
DDP_RUN = f"torchrun --standalone --nproc_per_node=2 04_ddp_torchrun/train.py {COMMON} --out runs/04_2x32"
VS_DDP = "python ddp_by_hand/vs_ddp.py"
OVERLAP_QUICK = ("python ddp_by_hand/overlap.py --hidden 512 --layers 4 --bucket-mb 0.001,1000 --rounds 1 "
                 "--out runs/overlap_quick")
TRAINING = (NAIVE, BUCKETED, DDP_RUN)
PARAMS = ["body.0.weight", "body.0.bias", "head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias"]


def load(path: Path, name: str) -> ModuleType:
    """Import a script as a module, leaving sys.path and sys.modules as they were (overlap.py extends both)."""
    path_before, modules_before = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = path_before
        for added in set(sys.modules) - modules_before - {name}:
            del sys.modules[added]


@pytest.fixture(scope="module")
def bucketed() -> ModuleType:
    return load(HERE / "bucketed.py", "ddp_by_hand_bucketed")


@pytest.fixture(scope="module")
def trained(readme_runs) -> dict:
    return {name: readme_run(readme_runs, command) for name, command in zip(("naive", "bucketed", "ddp"), TRAINING,
                                                                             strict=True)}


# --- the README's runs ----------------------------------------------------------------------------------------------

@pytest.mark.readme_run(*TRAINING)
def test_hand_built_data_parallelism_computes_stage_01s_training(trained):
    for name in ("naive", "bucketed"):
        s = trained[name].summary
        assert s["stage"] == f"ddp_by_hand/{name}" and s["world_size"] == 2 and s["dtype"] == "float64"
        assert s["global_batch"] == 64 and s["replica_max_abs_diff"] == 0.0
        assert s["losses"][-1] < s["losses"][0] / 3, s["losses"]
        replay = replay_error(s, trained[name].trajectory)
        assert replay <= tolerance("float64"), f"{name}: epoch replay {replay:.2e}"
    assert "every run computed stage 01's training" in trained["naive"].stdout + trained["bucketed"].stdout


@pytest.mark.readme_run(*TRAINING)
def test_naive_and_bucketed_send_the_same_bytes_in_different_numbers_of_calls(trained, two_ranks):
    """The README's runs report what their HandDDP counted; the W = 2 job (below) counts the same from outside, at
    torch.distributed.all_reduce, on each rank: the calls and bytes really handed to gloo in a step are the
    counters'."""
    naive, bucketed = trained["naive"].summary, trained["bucketed"].summary
    assert naive["allreduce_bytes_per_step"] == bucketed["allreduce_bytes_per_step"] == gradient_bytes("float64")
    assert naive["allreduce_calls_per_step"] == len(naive["buckets"]) == len(PARAMS)  # one per parameter
    assert naive["buckets"] == [[p] for p in PARAMS]
    # 40 KB of gradients fit the first bucket (1 MiB): one all-reduce, the parameters in the order backward makes them
    assert bucketed["allreduce_calls_per_step"] == len(bucketed["buckets"]) == 1
    assert bucketed["buckets"] == [PARAMS[::-1]]
    for rank, found in enumerate(two_ranks):
        for name, calls in (("naive", len(PARAMS)), ("bucketed", 1)):
            seen = found[name]
            assert (seen["calls"], seen["bytes"]) == (calls, gradient_bytes("float64")), (rank, name, seen)
            assert (seen["own_calls"], seen["own_bytes"]) == (seen["calls"], seen["bytes"]), (rank, name, seen)


@pytest.mark.readme_run(*TRAINING)
def test_at_two_ranks_any_correct_mean_ends_at_ddps_weights_bit_for_bit(trained):
    """At W = 2 the sum of two numbers does not depend on the order, and halving is exact: any correct mean is DDP's
    to the bit, whatever the layout (naive's one tensor per parameter as well as bucketed's DDP layout). So this
    catches a wrong mean (a divisor, a gradient left out), not the layout; the layout shows from W = 3 on, where the
    order of additions matters: test_ddps_two_habits_explain_every_difference_at_three_and_four_ranks."""
    ddp = trained["ddp"].trajectory
    for name in ("naive", "bucketed"):
        mine = trained[name].trajectory
        assert len(mine) == len(ddp) == 6
        for a, b in zip(mine, ddp, strict=True):  # weights and momentum (None before the first step)
            pairs = zip(a["params"] + a["momentum"], b["params"] + b["momentum"], strict=True)
            assert all(x is y is None or torch.equal(x, y) for x, y in pairs), f"{name} differs at epoch {a['epoch']}"
        assert all(torch.equal(trained[name].model[k], v) for k, v in trained["ddp"].model.items())


@pytest.mark.readme_run(VS_DDP)
def test_ddps_two_habits_explain_every_difference_at_three_and_four_ranks(readme_runs):
    out = readme_run(readme_runs, VS_DDP).stdout
    rows = {int(m.group(1)): m.group(2).split() for m in re.finditer(r"^(\d) +(.+)$", out, re.M)}
    assert set(rows) == {2, 3, 4}, out
    # The layout claim: HandDDP's buckets are DDP's rebuilt ones, so at W = 4 (1/W exact), from step 2 on, HandDDP is
    # DDP to the bit; in step 1 DDP's first-step layout (parameters() order) adds in another order, and it differs.
    exact = {w: [cell == "0" for cell in cells] for w, cells in rows.items()}
    assert all(exact[2]), f"W = 2 is bit for bit in every way\n{out}"
    assert all(e[4] and e[5] for e in exact.values()), f"with both habits every W is bit for bit\n{out}"
    assert exact[3][:4] == [False, False, False, True], f"W = 3: 1/W matters from step 2, the order at step 1\n{out}"
    assert exact[4][:4] == [False, True, False, True], f"W = 4: only the first step's order matters\n{out}"


# --- negative controls: the replay catches what a wrong hand-built version does --------------------------------------

def mutated(script: str, old: str, new: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / script).write_text(edited(HERE / script, [(old, new)]))
    return dest / script


def launch_two(script: Path, out: Path):
    return launch_commands([[*TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), "--batch-size", "32",
                             "--dtype", "float64", "--epochs", "2", "--out", str(out)]], out,
                           timeout=time_limit(programs=3))  # torchrun's agent and 2 ranks


# --- at W = 2, in a job of its own: what the in-process checks below cannot see with one rank ----------------------

def batch_of(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch i of `rank` in the W = 2 job: 16 samples of the stages' task shape, each rank its own."""
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (16,), generator=g)


def two_ranks_worker(rank: int, world: int, store: str, out: str) -> None:
    """One rank of the W = 2 job (harness.forked_ranks: forked, gloo over a FileStore, no port). Writes rankR.json:
    - for naive's and bucketed's HandDDP, one step: the all-reduces and bytes handed to torch.distributed.all_reduce,
      counted by a wrapper around it (outside the scripts), beside the scripts' own counters;
    - bucketed's no_sync(): the calls after each of three backwards (two inside it), and whether the gradients
      after sync_gradients() are the mean over both ranks of each rank's three micro-batches, bit for bit (at W = 2,
      a + b and halving are exact), and not this rank's own sum (what W = 1 cannot tell apart)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    scripts = {name: load(HERE / f"{name}.py", f"ddp_by_hand_{name}") for name in ("naive", "bucketed")}
    handed: list[int] = []
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        handed.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)
    dist.all_reduce = counted  # this forked process only
    found: dict = {}
    for name, script in scripts.items():
        torch.manual_seed(0)
        model = script.HandDDP(script.Net().double())
        handed.clear()
        x, y = batch_of(rank, 0)
        F.cross_entropy(model(x), y).backward()
        model.sync_gradients()
        found[name] = {"calls": len(handed), "bytes": sum(handed), "own_calls": model.calls, "own_bytes": model.bytes}
    bucketed = scripts["bucketed"]
    torch.manual_seed(0)
    net = bucketed.Net().double()
    model = bucketed.HandDDP(net, 0.01, 0.01)  # two buckets
    handed.clear()
    calls = []
    for i in range(3):
        with model.no_sync() if i < 2 else contextlib.nullcontext():
            x, y = batch_of(rank, i)
            F.cross_entropy(model(x), y).backward()
        calls.append(len(handed))
    model.sync_gradients()
    sums = []  # each rank's three micro-batches, accumulated as backward accumulates them, computed here
    for r in range(world):
        torch.manual_seed(0)
        plain = bucketed.Net().double()
        for i in range(3):
            F.cross_entropy(plain(batch_of(r, i)[0]), batch_of(r, i)[1]).backward()
        sums.append([p.grad for p in plain.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*sums, strict=True)]
    grads = [p.grad for p in net.parameters()]
    found["no_sync"] = {"calls": calls, "buckets": len(model.buckets),
                        "mean": all(torch.equal(g, m) for g, m in zip(grads, mean, strict=True)),
                        "own_sum": all(torch.equal(g, s) for g, s in zip(grads, sums[rank], strict=True)),
                        "largest_gap_from_own_sum": max((g - s).abs().max().item()
                                                        for g, s in zip(grads, sums[rank], strict=True))}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """What each rank of the W = 2 job found (two_ranks_worker)."""
    return forked_ranks("test_ddp_by_hand", "two_ranks_worker", 2, tmp_path_factory.mktemp("two_ranks"))


def test_a_wrong_divisor_is_caught_by_the_replay_and_not_by_the_replica_check(tmp_path):
    """The sum over the ranks instead of the mean: every rank applies the same (doubled) gradient, so the replicas
    stay equal and the job succeeds; only the comparison with stage 01 sees it."""
    script = mutated("bucketed.py", "            flat /= world_size\n", "", tmp_path)
    run = check(launch_two(script, tmp_path / "out"))
    assert run.summary["replica_max_abs_diff"] == 0.0
    assert replay_error(run.summary, run.trajectory) > 1e-3


def test_a_gradient_left_out_of_the_average_is_caught_by_the_replay(tmp_path):
    """The last parameter's gradient is never all-reduced: each rank trains it on its own half of the batch."""
    script = mutated("naive.py", "for p in self.module.parameters():\n            dist.all_reduce",
                     "for p in list(self.module.parameters())[:-1]:\n            dist.all_reduce", tmp_path)
    run = launch_two(script, tmp_path / "out")
    assert run.returncode == 1 and "replicas diverged" in run.stderr, run.describe()
    assert replay_error(run.summary, run.trajectory) > 1e-3  # rank 0 wrote its files before the replica check


# --- in this process: buckets, the order of events, no_sync ---------------------------------------------------------

def ddp_buckets(model: torch.nn.Module, **kwargs) -> list[list[str]]:
    """DDP's buckets after it has rebuilt them (after the first step), as lists of parameter names."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    names = [n for n, _ in model.named_parameters()]
    ddp = DDP(model, **kwargs)
    for _ in range(3):  # DDP rebuilds its buckets after step 1; its logging data has them after step 3
        F.cross_entropy(ddp(torch.randn(8, 8, dtype=torch.float64)), torch.zeros(8, dtype=torch.long)).backward()
    indices = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    return [[names[int(i)] for i in bucket.split()] for bucket in indices.split(",")]


@pytest.mark.parametrize("cap,first", [(25.0, 1.0), (0.01, 0.01), (0.005, 0.005), (1e-4, 1e-4)])
def test_buckets_are_ddps(bucketed, cap, first):
    with group_of_one():
        torch.manual_seed(0)
        hand = bucketed.HandDDP(bucketed.Net().double(), cap, first).buckets
        kwargs = {} if (cap, first) == (25.0, 1.0) else {"bucket_cap_mb": cap}  # an explicit cap: the first one too
        assert hand == ddp_buckets(bucketed.Net().double(), **kwargs)
    assert sorted(sum(hand, [])) == sorted(PARAMS)
    if cap == 0.01:
        assert len(hand) == 2, "0.01 MiB splits the stages' 40 KB model"


def launches_seen(model: torch.nn.Module, params: list, monkeypatch) -> list[tuple[int, bool]]:
    """One training step; for each all-reduce launched: (gradients already computed, launched during backward?)."""
    seen, in_backward = [], [False]
    real = torch.distributed.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append((sum(p.grad is not None for p in params), in_backward[0]))
        return real(tensor, *args, **kwargs)
    monkeypatch.setattr(torch.distributed, "all_reduce", spy)
    in_backward[0] = True
    F.cross_entropy(model(torch.randn(16, 8, dtype=torch.float64)), torch.zeros(16, dtype=torch.long)).backward()
    in_backward[0] = False
    model.sync_gradients()
    monkeypatch.undo()
    return seen


def test_the_first_all_reduce_starts_during_backward_and_the_control_only_after(bucketed, monkeypatch):
    """The overlap, as an order of events (no clock): deterministic, unlike a timing on a shared machine."""
    control_class = load(HERE / "overlap.py", "ddp_by_hand_overlap").LaunchAfterBackward
    with group_of_one():
        for kind in ("overlapped", "control"):
            torch.manual_seed(0)
            net = bucketed.Net().double()
            model = (bucketed.HandDDP if kind == "overlapped" else control_class)(net, 0.01, 0.01)
            params = list(net.parameters())
            seen = launches_seen(model, params, monkeypatch)
            assert len(seen) == len(model.buckets) == 2
            if kind == "overlapped":  # bucket 0 (the last 4 parameters) goes out while backward still runs
                assert seen == [(4, True), (6, True)], seen
            else:  # the same launches, once backward has returned with every gradient
                assert seen == [(6, False), (6, False)], seen


def test_no_sync_accumulates_locally_and_all_reduces_the_sum_once(two_ranks):
    """At W = 2: two backwards inside no_sync() hand nothing to the all-reduce, the third one call per bucket, and the
    gradients are then the mean over the ranks of each rank's three micro-batches, bit for bit; not the rank's own
    sum, which is all a group of one could show (there the all-reduce and / W change nothing)."""
    for rank, found in enumerate(two_ranks):
        seen = found["no_sync"]
        assert seen["buckets"] == 2 and seen["calls"] == [0, 0, 2], (rank, seen)
        assert seen["mean"] and not seen["own_sum"] and seen["largest_gap_from_own_sum"] > 1e-3, (rank, seen)


def test_a_bad_bucket_size_is_one_line_and_exit_2(bucketed, capsys):
    for flag in ("--bucket-mb", "--first-bucket-mb"):
        with pytest.raises(SystemExit) as exit:
            bucketed.parse_args([flag, "0"])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err and "positive" in err, err


# --- the profiling run ----------------------------------------------------------------------------------------------

LAG_MS = 5.0  # how much later gloo's thread may stamp an all-reduce's end than the main thread wakes from it (below)


def waits_for_every_all_reduce(rows: dict[str, dict]) -> None:
    """What backward left exposed, measured from two threads: on gloo's, the all-reduce time after backward's last
    operator (comm_after_backward_ms); on the main thread, the time from that operator to the optimizer step
    (waited_ms). The step waits for every bucket, so the first is at most the second, in every configuration (means
    over the profiled steps). Up to LAG_MS: gloo's thread stamps a span's end after it has marked the work done,
    and on a loaded machine it may be descheduled in between (one step of DDP ended its span 13 ms into the
    optimizer step at a load average of 30; the means of 6 steps stayed within 1 ms). Without the wait in
    sync_gradients() the all-reduces run on past the step by 25 ms or more here: 68 against 18 ms waited at DDP's
    default buckets, 398 against 10 with one bucket. The control sends everything after backward (all its
    all-reduce time is after it); HandDDP at DDP's defaults sends some before."""
    for name, row in rows.items():
        after, waited = float(row["comm_after_backward_ms"]), float(row["waited_ms"])
        assert after <= waited + LAG_MS, f"{name}: {after} ms of all-reduce after backward, the step waited {waited}"
    control, hand = rows["hand, after backward 25/1 MiB"], rows["hand 25/1 MiB"]
    assert float(control["hidden_ms"]) == 0.0
    assert float(control["comm_after_backward_ms"]) == pytest.approx(float(control["comm_ms"]), rel=1e-3), control
    assert float(hand["comm_after_backward_ms"]) < float(hand["comm_ms"]), hand


@pytest.mark.readme_run(OVERLAP_QUICK)
def test_the_quick_profiling_run_measures_overlap_and_its_control(readme_runs):
    run = readme_run(readme_runs, OVERLAP_QUICK)
    rows = {r["name"]: r for r in read_csv(run.out / "overlap.csv")}
    assert set(rows) == {"hand 25/1 MiB", "hand, after backward 25/1 MiB", "ddp 25/1 MiB", "hand 25/25 MiB",
                         "ddp 25/25 MiB", "hand 0.001/0.001 MiB", "ddp 0.001/0.001 MiB", "hand 1000/1000 MiB",
                         "ddp 1000/1000 MiB"}
    layers = 4
    # One bucket per parameter, but the output layer's bias (64 bytes) shares its weight's bucket
    assert int(rows["hand 0.001/0.001 MiB"]["buckets"]) == 2 * layers + 1
    assert int(rows["hand 1000/1000 MiB"]["buckets"]) == 1
    assert int(rows["hand 25/1 MiB"]["buckets"]) == 2, "the small first bucket, then the rest"
    for name, row in rows.items():  # DDP packed the same buckets as HandDDP
        if row["impl"] == "ddp":
            assert row["ddp_bucket_bytes"] == rows[name.replace("ddp", "hand")]["bucket_bytes"], name
    assert float(rows["hand, after backward 25/1 MiB"]["overlap"]) == 0.0
    assert float(rows["hand 25/1 MiB"]["overlap"]) > 0.0
    waits_for_every_all_reduce(rows)
    for png in ("timeline.png", "sweep.png"):
        assert (run.out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for impl in ("hand", "after_backward", "ddp"):
        with gzip.open(run.out / f"trace_{impl}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert {"rank 0", "rank 1"} <= names, names
        assert any(e.get("name") == "gloo:all_reduce" for e in events)
        assert any(e.get("name") == "launch all-reduce of bucket 0" for e in events) == (impl != "ddp")


# --- the files themselves -------------------------------------------------------------------------------------------

def test_the_readme_shows_todays_diffs():
    for old, new in FILE_DIFFS["ddp_by_hand/README.md"]:
        shown = file_diff_block("ddp_by_hand/README.md", old, new)
        assert shown, f"ddp_by_hand/README.md lost its diff of {old} and {new}"
        assert shown.group(1) == file_diff(old, new), "an old diff: run python tests/lesson_diffs.py"


@pytest.mark.parametrize("script", ["naive.py", "bucketed.py"])
def test_the_machinery_below_the_lesson_is_stage_04s(script):
    def machinery(path: Path) -> str:
        below = path.read_text().split(BOUNDARY)[1]
        return "\n".join(line for line in below.splitlines() if not line.startswith(("import ", "from ")))
    assert machinery(HERE / script) == machinery(ROOT / "04_ddp_torchrun" / "train.py")

