"""HSDP on stage 11 (--parallel fsdp --replicate R: FSDP2 on grid.py's (replicate, shard) mesh, parallelize.py): the
same training as one process and as FSDP2 over all the ranks, with the state and the traffic the formulas say.

Launched, tiny (test_sequence_parallel's TINY: 2 blocks, width 32, context 32, 3 steps), float64, through the stage's
launcher: R 2 x S 2 on 4 processes against one process and against --parallel fsdp on 4 (S 4), within sqrt(eps)
(test_gpt.gaps: the states, every step's loss and gradient norm); the training state each rank reports (its shards of
the weights, gradients and AdamW's moments) against 32 bytes a parameter in float64 / S: S is the shard group's size,
not dp's.

Forked, 4 ranks (harness.forked_ranks): Trainer._run_step itself on the GPT made by parallelize on a Grid of R 2 x S 2,
then of R 1 x S 4; its gradients against one process's, and every collective FSDP2 called (torch.distributed's
all_gather_single, reduce_scatter_single, all_reduce, wrapped), by op, size and group:
- all-gathers inside the shard group only: every unit's weights forward, the blocks' again in backward (the root
  stays gathered), P + P_blocks elements in all, of which a rank receives (S - 1) / S;
- reduce-scatters inside the shard group: every gradient once, P elements;
- all-reduces over the replicate group: the reduce-scattered gradients, P / S elements; none where R is 1.
All within 5% of those formulas (FSDP2 pads each weight's first dimension to a multiple of S).
In this process: R below 1, R > 1 with --parallel ddp, R not dividing dp refused in one line (test_gpt.refusal), on
stages 11, 12 and 13.

Stages 12 and 13, launched, one 4-rank run each beside the runs above, against the same one process (11's: the same
GPT, drawn alike): HSDP beside the dimensions those stages add, on their one grid (grid.py). 12: R 2 x S 1 x cp 2,
the cheapest layout where the shard group is not a dp group: FSDP2 shards over shard x cp (the cp ranks hold the
same weights), so here over the cp pairs, and the replicas all-reduce across them; R 2 x S 2 at cp 1 would only repeat
11's run. 13: R 2 x S 1 x pp 2, 2 micro-batches (1F1B), each stage's ranks replicas of one another. Each: the whole
state and every step's loss and gradient norm equal one process's; each rank's state 32 bytes a parameter of its
pipeline stage / (S x cp).

`python tests/test_hsdp.py` prints the forked counts as 11_gpt/README's table shows them, and a test checks that the
table holds them.
"""
from __future__ import annotations

import inspect
import json
import re
import tempfile
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch._dynamo  # noqa: F401  (once, before forked_ranks forks: else each rank's first step imports it)
from test_sequence_parallel import B, H, T, V, W, one_step, step

from harness import ROOT, Run, forked_ranks, load_stage, run_chains, tolerance
from test_gpt import gaps, refusal, refused_in_one_line

TOL = tolerance("float64")
WORLD = 4
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce")
WHOLE = {"all_gather_single": "output_tensor", "reduce_scatter_single": "input", "all_reduce": "tensor"}


def counted(calls: list[list]) -> ExitStack:
    """torch.distributed's collectives that FSDP2 calls, wrapped: each call appended to `calls` as [op, elements of the
    whole tensor (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor), the group's ranks]."""
    import torch.distributed as dist
    stack = ExitStack()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def call(*args, _name=name, _original=original, **kwargs):
            bound = inspect.signature(_original).bind(*args, **kwargs)
            group = bound.arguments.get("group")
            calls.append([_name, bound.arguments[WHOLE[_name]].numel(), dist.get_process_group_ranks(group)])
            return _original(*args, **kwargs)

        stack.enter_context(mock.patch.object(dist, name, call))
    return stack


def hsdp_worker(rank: int, world: int, store: str, out: str) -> None:
    """One of 4 ranks (gloo over a FileStore, no port): one training step of the GPT made by the stage's parallelize
    on R 2 x S 2, then on R 1 x S 4; the gradients against one process's, the collectives, this rank's groups."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gpt = load_stage("11_gpt")
    tokens = torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(2))
    cfg = gpt.Config(V, T, 2, H, W)
    flags = SimpleNamespace(tp=1, ac="none", compile=False, parallel="fsdp", amp=None, sp=False)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return gpt.GPT(cfg).double()

    reference, _ = one_step(gpt, model(), tokens, sp=False, batch=world * B)
    plain = model()
    blocks = sum(p.numel() for p in plain.blocks.parameters())
    found = {"parameters": sum(p.numel() for p in plain.parameters()), "block_parameters": blocks}
    for replicate in (2, 1):
        grid = gpt.Grid({"replicate": replicate, "dp": world, "tp": 1}, torch.device("cpu"), 60)
        sharded = gpt.parallelize(model(), grid, flags)
        calls: list[list] = []
        with counted(calls):
            grads, _ = one_step(gpt, sharded, tokens, sp=False, dp_rank=grid.coords["dp"], dp=world)
        mine = {name: next(line for line in grid.members[name] if rank in line) for name in ("shard", "replicate")}
        held = sum(p.to_local().numel() for p in sharded.parameters())  # this rank's shards' elements
        found[f"R{replicate}"] = {"gap": {n: (grads[n] - reference[n]).abs().max().item() for n in reference},
                                  "calls": calls, **mine, "S": grid.sizes["shard"], "held": held}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def traffic(found: dict, layout: str) -> dict[str, int]:
    """Elements by kind of collective (whole tensors, summed over the step): 'gather', 'scatter' inside this rank's
    shard group, 'across' all-reduced over its replicate group, 'other' anything else."""
    mine = found[layout]
    kinds = {"gather": 0, "scatter": 0, "across": 0, "other": 0}
    for op, size, ranks in mine["calls"]:
        if op == "all_gather_single" and ranks == mine["shard"]:
            kinds["gather"] += size
        elif op == "reduce_scatter_single" and ranks == mine["shard"]:
            kinds["scatter"] += size
        elif op == "all_reduce" and ranks == mine["replicate"] and len(ranks) > 1:
            kinds["across"] += size
        else:
            kinds["other"] += size
    return kinds


def formulas(found: dict, layout: str) -> dict[str, float]:
    """What the step should move, in elements: P the parameters, S the shard group's size, R the replicas."""
    p, blocks, s = found["parameters"], found["block_parameters"], found[layout]["S"]
    return {"gather": p + blocks, "scatter": p, "across": p / s if WORLD // s > 1 else 0, "other": 0}


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> list[dict]:
    return forked_ranks("test_hsdp", "hsdp_worker", WORLD, tmp_path_factory.mktemp("hsdp_forked"))


@pytest.mark.parametrize("layout", ["R2", "R1"])
def test_a_step_of_hsdp_has_one_process_s_gradients(forked, layout):
    for found in forked:
        gap = found[layout]["gap"]
        worst = max(gap, key=gap.get)
        assert gap[worst] <= TOL, f"{layout}, rank {forked.index(found)}: {worst}'s gradient differs by {gap[worst]}"


@pytest.mark.parametrize("layout", ["R2", "R1"])
def test_hsdp_gathers_inside_the_shard_group_and_all_reduces_a_shard_across(forked, layout):
    for rank, found in enumerate(forked):
        counts, expected = traffic(found, layout), formulas(found, layout)
        assert len(found[layout]["shard"]) == found[layout]["S"], found[layout]
        for kind in ("gather", "scatter", "across"):
            assert counts[kind] == pytest.approx(expected[kind], rel=0.05), \
                f"{layout}, rank {rank}: {kind} moved {counts[kind]} elements, the formula {expected[kind]:.0f}"
        assert counts["other"] == 0, [c for c in found[layout]["calls"] if c[0] != "all_gather_single"]


# Each stage's own dimension beside --replicate, and what dp is then: 11's world / tp, 12's / (cp tp), 13's and 14's
# / (pp tp).
BESIDE = {"11_gpt": (["--tp", "2", "--heads", "2"], 2), "12_context_parallel": (["--cp", "2"], 2),
          "13_pipeline_4d": (["--pp", "2", "--layers", "2", "--accumulate", "2"], 2),
          "14_experts": (["--pp", "2", "--layers", "2", "--accumulate", "2", "--ep", "2"], 2)}


@pytest.mark.parametrize("stage", list(BESIDE))
def test_hsdp_flags_refused_in_one_line(stage):
    four, (beside, dp) = {"WORLD_SIZE": "4"}, BESIDE[stage]
    refused_in_one_line([
        (["--replicate", "0"], {}, "argument --replicate: must be a positive int, got 0"),
        (["--replicate", "2"], four, "argument --replicate: HSDP keeps replicas of FSDP2's shards"),
        (["--parallel", "fsdp", "--replicate", "3"], four, "argument --replicate: 3 does not divide dp 4"),
        (["--parallel", "fsdp", *beside, "--replicate", "4"], four,
         f"argument --replicate: 4 does not divide dp {dp}")], stage)
    for args in (["--parallel", "fsdp", "--replicate", "2"], ["--parallel", "fsdp", *beside, "--replicate", "2"]):
        assert refusal(args, four, stage)[0] == "accepted", (stage, args)  # the controls


# ─── Launched: the stage's real launcher, against one process and against FSDP2 on 4 ───────────────────────────────

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    chains = {
        "hsdp": [step(WORLD, "--batch-size", "1", "--parallel", "fsdp", "--replicate", "2")],
        "fsdp": [step(WORLD, "--batch-size", "1", "--parallel", "fsdp", "--sample", "0")],
        "one": [step(1, "--batch-size", "4", "--sample", "0")],
        # beside cp (12) and pp (13): the global batch one process's 4 windows (13: 2 micro-batches of 1 a dp rank)
        "hsdp12": [step(WORLD, "--batch-size", "2", "--parallel", "fsdp", "--replicate", "2", "--cp", "2",
                        "--sample", "0", stage="12_context_parallel")],
        "hsdp13": [step(WORLD, "--batch-size", "1", "--accumulate", "2", "--parallel", "fsdp", "--replicate", "2",
                        "--pp", "2", "--sample", "0", stage="13_pipeline_4d")],
        # 14: R 2 x S 2 with the experts over ep 2 (FSDP2 leaves them alone: averaged over their replicas by hand)
        "one14": [step(1, "--batch-size", "4", "--sample", "0", stage="14_experts")],
        "hsdp14": [step(WORLD, "--batch-size", "1", "--parallel", "fsdp", "--replicate", "2", "--ep", "2",
                        "--sample", "0", stage="14_experts")],
    }
    return run_chains(chains, tmp_path_factory.mktemp("hsdp"))


@pytest.mark.parametrize("reference", ["one", "fsdp"])
def test_hsdp_trains_as_one_process_and_as_fsdp_on_every_rank(runs, reference):
    run = runs["hsdp"]
    assert (run.summary["parallel"], run.summary["dp"], run.summary["world_size"]) == ("fsdp", WORLD, WORLD)
    assert "world size 4 = dp 4 (replicate 2 x shard 2) x tp 1 | fsdp" in run.stdout, run.stdout
    assert "  replicate   HSDP: the shards' replicas, gradients all-reduced: [0, 2] [1, 3]" in run.stdout
    found, shared = gaps(run, runs[reference])
    assert shared == [0, 3] and max(found.values()) <= TOL, f"--replicate 2 vs {reference}: {found}"


@pytest.mark.parametrize("name, layout", [
    ("hsdp12", {"cp": 2, "dp": 2, "world_size": WORLD}),
    ("hsdp13", {"pp": 2, "dp": 2, "world_size": WORLD, "accumulate": 2}),
    ("hsdp14", {"dp": WORLD, "world_size": WORLD})])
def test_hsdp_beside_cp_pp_and_ep_trains_as_one_process(runs, name, layout):
    run = runs[name]
    assert {k: run.summary[k] for k in (*layout, "parallel")} == {**layout, "parallel": "fsdp"}
    assert name != "hsdp14" or run.summary["experts"]["ep"] == 2, run.summary["experts"]
    split = "dp 4 (replicate 2 x shard 2)" if name == "hsdp14" else "dp 2 (replicate 2 x shard 1)"
    assert f"= {split} x " in run.stdout, run.stdout
    replicas = "[0, 1] [2, 3]" if name == "hsdp13" else "[0, 2] [1, 3]"  # 13: pp outermost, a stage's ranks 0-1
    assert f"  replicate   HSDP: the shards' replicas, gradients all-reduced: {replicas}" in run.stdout, run.stdout
    found, shared = gaps(run, runs["one14" if name == "hsdp14" else "one"])
    print(f"\n| {name} | {found['state']:.1e} | {found['losses']:.1e} | {found['grad_norms']:.1e} | "
          f"{run.summary['memory']['state']} |")  # (-s: the README's figures)
    assert shared == [0, 3] and max(found.values()) <= TOL, f"{name} (--replicate 2) vs one process: {found}"


def stage_parameters(run: Run) -> list[int]:
    """Each rank's parameters, whole: the model's, or under --pp 2 (2 blocks) its pipeline stage's, the first holding
    the embeddings and block 0, the second block 1, the final norm and the head (pp the grid's outermost dimension)."""
    whole, pp = run.model, run.summary["pp"] if "pp" in run.summary else 1
    if pp == 1:
        return [sum(t.numel() for t in whole.values())] * WORLD
    stages = [("tokens.", "positions.", "blocks.0."), ("blocks.1.", "norm.", "head.")]
    held = [sum(t.numel() for k, t in whole.items() if k.startswith(stages[i])) for i in range(pp)]
    assert sum(held) == run.summary["parameters"], (held, run.summary["parameters"])
    return [held[rank // (WORLD // pp)] for rank in range(WORLD)]


@pytest.mark.parametrize("name, shard", [("hsdp", 2), ("fsdp", 4), ("hsdp12", 2), ("hsdp13", 1), ("hsdp14", 2)])
def test_each_rank_holds_a_shard_group_s_share_of_the_state(runs, name, shard):
    """shard: the shard group's size, S x cp (12: S 1 x cp 2; 14: S 2, and the experts, which FSDP2 leaves alone,
    split over ep 2: half of them too)."""
    state, parameters = runs[name].summary["memory"]["state"], stage_parameters(runs[name])
    expected = [4 * 8 * p / shard for p in parameters]  # weights, gradients, AdamW's two moments: 8 bytes each
    assert len(state) == WORLD and all(b == pytest.approx(e, rel=0.05) for b, e in zip(state, expected, strict=True)), \
        f"{name}: state per rank {state} bytes, the formula 32 x {parameters} / {shard} = {expected}"


def table(found: dict) -> dict[str, list[int]]:
    """11_gpt/README's HSDP table from rank 0's counts: bytes held (the state, 4 x 8 a shard's element), or received
    (a gather's or scatter's elements x (S - 1)/S x 8, a ring all-reduce's x 2 (R - 1)/R x 8), HSDP's then FSDP2's."""
    rows: dict[str, list[int]] = {"state": [], "gathers": [], "scatters": [], "across": []}
    for layout in ("R2", "R1"):
        s, counts = found[layout]["S"], traffic(found, layout)
        r = WORLD // s
        rows["state"].append(32 * found[layout]["held"])
        rows["gathers"].append(8 * counts["gather"] * (s - 1) // s)
        rows["scatters"].append(8 * counts["scatter"] * (s - 1) // s)
        rows["across"].append(8 * counts["across"] * 2 * (r - 1) // r)
    return rows


def test_the_readme_table_is_these_counts(forked):
    text = (ROOT / "11_gpt" / "README.md").read_text()
    shown = {key: re.search(rf"^\| {re.escape(start)} \| ([\d,]+) \| ([\d,]+|none) \|", text, re.M)
             for key, start in (("state", "state: weights, gradients, AdamW's moments"),
                                ("gathers", "all-gathers in the shard group"),
                                ("scatters", "reduce-scatters in the shard group"),
                                ("across", "all-reduce across the replicas"))}
    assert all(shown.values()), shown
    found = {key: [0 if n == "none" else int(n.replace(",", "")) for n in m.groups()] for key, m in shown.items()}
    assert found == table(forked[0]), (found, table(forked[0]))


if __name__ == "__main__":  # the README's table: the forked counts, in bytes rank 0 holds or receives
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(hsdp_worker, args=(WORLD, str(Path(tmp) / "store"), tmp), nprocs=WORLD,
                           start_method="fork")
        found = json.loads((Path(tmp) / "rank0.json").read_text())
    print(f"one step, 4 ranks, {found['parameters']:,} parameters (float64); rank 0, bytes it holds or receives:")
    for i, name in enumerate(("HSDP, R 2 x S 2", "FSDP2, S 4")):
        print(f"{name}: " + " | ".join(f"{key} {values[i]:,}" for key, values in table(found).items()))
