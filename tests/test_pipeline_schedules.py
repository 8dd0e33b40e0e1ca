"""Stage 10's schedules.py: interleaved 1F1B and ZB-H1 by hand (beside GPipe and 1F1B) compute one process's training,
run each rank's order as the schedule's table says, hold the activations the schedule's figure says, and send what a
neighbour waits for before anything else runs.

Two launches, through tests/sync_sends.py (NCCL's rules on gloo: a send done only once received, a process's messages
one after another): p = 2 with all four schedules, and p = 4 with the two new ones, each at m = 4 and 8 (v = 2), every
run from the same weights, 3 steps in float64.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import sync_sends
import torch
import torch.nn.functional as F

from harness import ROOT, Step, check, launch_commands, load_copy, time_limit, tolerance

STAGE = "10_pipeline_parallel"
SCRIPT = ROOT / STAGE / "schedules.py"
TOL = tolerance("float64")
ARGS = ("--microbatches", "4,8", "--stages-per-rank", "2", "--layers", "8", "--width", "64", "--batch-size", "32",
        "--steps", "3", "--lr", "0.05", "--dtype", "float64", "--timeout", "30")
LAUNCHES = {2: "gpipe,1f1b,interleaved,zbh1", 4: "interleaved,zbh1"}  # p -> the schedules that launch runs


def run_schedules(p: int, names: str, out: Path, script: Path = SCRIPT, args: tuple = ARGS) -> list[dict]:
    """One launch of `script` on p processes through sync_sends: every run it made (schedules.json), with its state."""
    step = Step(STAGE, "torchrun", ("--schedules", names, *args), nproc=p)
    cmds = sync_sends.wrapped(step.commands(out, script), script)
    run = check(launch_commands(cmds, out, step.env, timeout=time_limit(programs=1 + p)))
    assert sorted(sync_sends.messages(run.stderr)) == list(range(p)), "sync_sends was not in the way"
    runs = json.loads((out / "schedules.json").read_text())
    states = torch.load(out / "states.pt", weights_only=True)
    return [{**r, "state": states[f"{r['schedule']} m={r['m']}"]} for r in runs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return [r for p, names in LAUNCHES.items() for r in run_schedules(p, names, tmp_path_factory.mktemp(f"p{p}"))]


@pytest.fixture(scope="module")
def one_process() -> tuple[list[float], list[torch.Tensor]]:
    """The same training in one process, written here: the whole model on the whole batch, SGD with momentum. Every
    step's loss, and the weights and momentum after the last, in the model's order."""
    module = load_copy(SCRIPT)
    train_set, _ = module.make_data(0, torch.float64)
    torch.manual_seed(0)
    model = module.Net(8, 64).to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = train_set[step * 32:(step + 1) * 32]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = [t for w in model.parameters() for t in (w.detach(), optimizer.state[w]["momentum_buffer"])]
    return losses, state


def test_every_schedule_computes_one_process_training(runs, one_process):
    """Every step's loss and the whole state (weights and momentum of every stage) equal one process's, in float64,
    for GPipe and 1F1B at p = 2 and interleaved and ZB-H1 at p = 2 and 4, m = 4 and 8."""
    losses, state = one_process
    assert {(r["schedule"], r["p"], r["m"]) for r in runs} == \
        {(s, p, m) for p, names in LAUNCHES.items() for s in names.split(",") for m in (4, 8)}
    for r in runs:
        name = f"{r['schedule']} p={r['p']} m={r['m']}"
        assert max(abs(a - b) for a, b in zip(r["losses"], losses, strict=True)) <= TOL, (name, r["losses"], losses)
        mine = [t for pair in r["state"] for t in pair]
        assert len(mine) == len(state), name
        gap = max((a - b).abs().max().item() for a, b in zip(mine, state, strict=True))
        assert gap <= TOL, f"{name}: the state is {gap:.3g} from one process's"


# Each rank's order, written out for p = 2, m = 4 (v = 2): F3.2 is the forward of micro-batch 3 on stage 2.
# Interleaved: rank r holds stages r and r + 2; its warm-up is (v - 1) p + 2 (p - 1 - r) forwards (4 and 2), the
# micro-batches go in rounds of p = 2 through its stages in turn, backwards through the later stage first.
# ZB-H1: 1F1B's order with each backward split; rank r runs each W r backwards after its B.
TABLES = {
    "interleaved": ["F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0",
                    "F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1"],
    "zbh1": ["F0.0 F1.0 B0.0 W0.0 F2.0 B1.0 W1.0 F3.0 B2.0 W2.0 B3.0 W3.0",
             "F0.1 B0.1 F1.1 B1.1 W0.1 F2.1 B2.1 W1.1 F3.1 B3.1 W2.1 W3.1"],
    "1f1b": ["F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0", "F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1"],
    "gpipe": ["F0.0 F1.0 F2.0 F3.0 B0.0 B1.0 B2.0 B3.0", "F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1"],
}


def orders(run: dict) -> list[list[str]]:
    """Each rank's recorded computations, in the order they ran (start times), as F<micro-batch>.<stage>."""
    mine = [sorted((e for e in run["events"] if e[0] == r), key=lambda e: e[4]) for r in range(run["p"])]
    return [[f"{kind}{mb}.{stage}" for _, stage, mb, kind, *_ in line] for line in mine]


def test_each_rank_runs_the_schedules_table(runs):
    """The recorded events of the last step, rank by rank: the table above at p = 2, m = 4. Elsewhere: each rank
    computes only its round-robin stages (r, r + p), every micro-batch's F, B (and W) once each, in that order on a
    stage, and starts its first backward after the warm-up's forwards: interleaved (v - 1) p + 2 (p - 1 - r) + 1,
    1F1B and ZB-H1 p - r, GPipe m."""
    for r in runs:
        p, m, v, name = r["p"], r["m"], r["v"], f"{r['schedule']} p={r['p']} m={r['m']}"
        got = orders(r)
        if (p, m) == (2, 4):
            assert [" ".join(line) for line in got] == TABLES[r["schedule"]], (name, got)
        kinds = "FBW" if r["schedule"] == "zbh1" else "FB"
        for rank, line in enumerate(got):
            stages = {int(a.split(".")[1]) for a in line}
            assert stages == {rank + c * p for c in range(v)}, f"{name}: rank {rank} ran stages {sorted(stages)}"
            for s in stages:
                for mb in range(m):
                    at = [line.index(f"{k}{mb}.{s}") for k in kinds]  # ValueError if one is missing
                    assert at == sorted(at) and len(line) == len(set(line)), (name, rank, s, mb)
            warmup = {"interleaved": min((v - 1) * p + 2 * (p - 1 - rank) + 1, v * m), "gpipe": m}.get(
                r["schedule"], p - rank)
            assert next(i for i, a in enumerate(line) if a[0] == "B") == warmup, (name, rank, line)


def test_activations_held_are_the_schedules_figure(runs):
    """The most (stage, micro-batch) activations a rank held at once, counted as it ran: GPipe m; 1F1B p - r;
    interleaved (v - 1) p + 2 (p - 1 - r) + 1 (each 1/v of the rank's layers), at most v m; ZB-H1 p on every rank
    (held until W: rank r defers r of them), 1F1B's largest."""
    for r in runs:
        p, m, v = r["p"], r["m"], r["v"]
        figure = {"gpipe": [m] * p, "1f1b": [p - k for k in range(p)], "zbh1": [p] * p,
                  "interleaved": [min((v - 1) * p + 2 * (p - 1 - k) + 1, v * m) for k in range(p)]}[r["schedule"]]
        assert r["peak_held"] == figure, (r["schedule"], p, m, r["peak_held"])


def late_sends(run: dict) -> list[str]:
    """Computations that started on a rank before what the rank had just made (an F's activations, a B's input
    gradient) had left it: the neighbour waits for that, so it goes first."""
    late = []
    for rank in range(run["p"]):
        line = sorted((e for e in run["events"] if e[0] == rank), key=lambda e: e[4])
        for made, after in zip(line, line[1:], strict=False):
            if made[6] is not None and after[4] < made[6]:
                late.append(f"rank {rank}: {after[3]}{after[2]} of stage {after[1]} ran before {made[3]}{made[2]}'s "
                            f"output was sent")
    return late


def test_what_a_neighbour_waits_for_leaves_first(runs):
    """Under ZB-H1 B's input gradient goes to the previous stage before the W that follows it runs (and under every
    schedule each output before the next computation): the sends' stamps against the next start."""
    for r in runs:
        assert not late_sends(r), late_sends(r)[0]


def test_the_bubble_on_the_schedules_own_clock_is_the_formula():
    """schedules.py's slot clock (F 1 slot, a whole backward 2, B and W 1 each, each waiting for its input) plays
    each schedule's table out: the idle fraction is the formula exactly, for p = 2, 3, 4 and m = 4, 8, 12 (v = 2)."""
    module = load_copy(SCRIPT)
    for p in (2, 3, 4):
        for m in (4, 8, 12):
            for name, fn in module.SCHEDULES.items():
                v = 2 if name == "interleaved" else 1
                if name == "interleaved" and m % p:
                    continue
                table = [fn(m, r, p, v) for r in range(p)]
                when = module.slot_clock(table, p * v)
                owner = {s: s % p for s in range(p * v)}
                events = [[owner[s], s, mb, kind, start, end, None] for (kind, s, mb), (start, end) in when.items()]
                expected = module.formula(name, p, m, v)
                assert abs(module.bubble(events, p) - expected) < 1e-12, (name, p, m, module.bubble(events, p))


def test_the_readme_shows_the_recorded_run():
    """10's README table is made from the committed record of the run behind its picture (timeline.readme_table), not
    typed; and the record is a real run of all four schedules at P = 2: its events are each rank's table."""
    module, timeline = load_copy(SCRIPT), load_copy(ROOT / STAGE / "timeline.py")
    record = ROOT / STAGE / "schedules_measured.json"
    assert timeline.readme_table(record) in (ROOT / STAGE / "README.md").read_text()
    for run in json.loads(record.read_text()):
        got = orders(run)
        expected = [[f"{k}{mb}.{s}" for k, s, mb in module.SCHEDULES[run["schedule"]](run["m"], r, run["p"], run["v"])]
                    for r in range(run["p"])]
        assert got == expected, run["schedule"]
