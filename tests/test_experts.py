"""Stage 14: the GPT with a mixture of experts computes one process's training with its experts over ep processes
(ep 2, ep 4, dp 2 x ep 2, with accumulation, DDP and FSDP2), resumes a checkpoint on all five dimensions at once, and
a planted bug in each part of expert parallelism is caught.

tests/test_context_parallel.py's tiny model (2 blocks, 2 heads, width 32, context 24) with 4 experts a block, each
token to 2, float64, at that module's seed (drawn for the session; printed with every failure), on the first
24,000 characters of tiny Shakespeare (harness.small_corpus: a held-out tenth every layout scores whole). Two
references, as one process: `one` (batch 4) and `one_acc` (batch 4 in 2 micro-batches: the balancing loss counts its
load per micro-batch, so a layout equals the reference with the same micro-batches: its ranks' micro-batch i together
is the reference's micro-batch i):

    ep4      torchrun 4: ep 4 (an expert a rank), DDP, batch 1: `one`
    ep2      torchrun 2: ep 2, DDP, batch 2 x 2 micro-batches: `one_acc`
    dpep     torchrun 4: dp 2 x ep 2 (each expert on 2 ranks), FSDP2, batch 1 x 2, to step 4: `one_acc`
    dpep_ddp dpep's layout under DDP, to step 4 (the replicas bug's command, unbroken): `one_acc`
    five     torchrun 16: dp 2 x pp 2 x cp 2 x tp 2, ep 2 of the dp x cp, 1F1B, resumed from dpep's checkpoint to 8
    cap      ep2's command with --capacity-factor 2 (no expert can overflow: nothing dropped): `one_acc`
    drop     torchrun 2: ep 2, batch 1 x 2, --capacity-factor 0.5 (experts overflow), --balance rank, to step 4:
             `drop_one`, one process of batch 1 x 4 with the same capacity (a capacity is per rank and micro-batch,
             here one window, as the reference's)

And with stage 13's schedules of 2 stages a rank (4 blocks, 3 steps, against `one_v`: one process of 2 windows x 4
micro-batches), each block's experts and balancing loss carried through torch's schedule:

    interleaved  torchrun 4: pp 2 x tp 2 --sp, interleaved 1F1B (rank 0 holds stages 0 and 2), 4 micro-batches of 2
    zbv_ep       torchrun 4: dp 2 x pp 2, ZB-V (the split backward; rank 0 holds 0 and 3), ep 2 of the dp
    inter_cp     torchrun 4: pp 2 x cp 2, interleaved 1F1B, 4 micro-batches of 2 (the ring in each stage)
    zbv_cp_ac    torchrun 4: pp 2 x cp 2, ZB-V, --ac full (each block recomputed in B and again in W)
    aux_stage    interleaved's command without --tp, the second stage's balancing loss left out
    resharded    zbv_ep's command, the blocks resharded after their forward (the weight gradients then lost)

Every state (weights, both AdamW moments), loss, gradient norm and the tokens each expert took are compared, within
sqrt(eps) of float64 (the tokens exactly). The planted bugs, each on ep2's or dpep_ddp's command (4 steps), must leave
one process's training far behind: a row sent to another expert's slot, the combine without the gates, the
backward's all-to-all with the forward's splits, the balancing loss counted per rank (--balance rank, which most
trainers use: the run says so before it starts), and the experts' gradients averaged over their replicas only; each
beside a run of the same command, unbroken, that passes.

In one process, without a launch: `MoE` (routing, gates, capacity, the balancing loss and its gradient) against a
mixture written here token by token, DDP's way of leaving the experts out (a private torch API) still doing so, and
a checkpointed block's backward split in two as the zero-bubble schedules split it (its experts tally once).
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import set_checkpoint_early_stop

from conftest import readme_run
from harness import (
    ROOT,
    Run,
    Step,
    group_of_one,
    launch,
    load_copy,
    load_stage,
    mutate,
    run_chains,
    small_corpus,
    time_limit,
    tolerance,
)
from test_context_parallel import SEED, TINY, compare, equals_one_process
from test_gpt import compare as quiet_compare
from test_gpt import refusal, refused_in_one_line
from tools.cli import read_csv

STAGE = "14_experts"
TOL = tolerance("float64")
ONE = ("--batch-size", "4", "--max-steps", "8")
ONE_ACC = ("--batch-size", "4", "--accumulate", "2", "--max-steps", "8")
EP2 = ("--ep", "2", "--batch-size", "2", "--accumulate", "2")
DPEP = ("--ep", "2", "--batch-size", "1", "--accumulate", "2")
DPEP_DDP = (*DPEP, "--parallel", "ddp")
# Experts that overflow: capacity 0.5 x the even share of a rank's micro-batch (one window: ceil(0.5 x 24 x 2 / 4) = 6
# rows an expert of the 12 it would get evenly), the load counted per rank; ep 2, and one process of the same windows.
DROP = ("--batch-size", "1", "--max-steps", "4", "--decay-steps", "8", "--capacity-factor", "0.5")
SHORT = ("--max-steps", "4", "--decay-steps", "8")  # the planted bugs: the reference's first 4 steps
# The planted bugs: (the file's text, the broken text, the command).
BUGS = {
    # The rows arrive by sender, each sender's by expert: regrouped as if by expert first, a row meets another expert.
    "slot": ("torch.arange(sent.shape[1], device=rows.device).repeat(self.size)",
             "torch.arange(sent.shape[1], device=rows.device).repeat_interleave(self.size)", EP2),
    "gates": ("index_add_(0, token, (out * gates.flatten()[order, None])", "index_add_(0, token, (out)", EP2),
    "splits": ("dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)",
               "dist.all_to_all_single(back, grad.contiguous(), ctx.recv_splits, ctx.send_splits, group=ctx.group)",
               EP2),
    "replicas": ("            grad.div_(world)", "            grad.div_(dist.get_world_size(self.replicas))",
                 DPEP_DDP),
}
# Each bug's command, unbroken: a run that passes in the same configuration (ep2 trained further, to 8 steps).
TWINS = {"slot": "ep2", "gates": "ep2", "splits": "ep2", "rank": "ep2", "replicas": "dpep_ddp"}


def step(nproc: int, *args: str) -> Step:
    return Step(STAGE, "python" if nproc == 1 else "torchrun", (*TINY, *args), nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("experts")
    print(f"seed {SEED}: CONTEXT_PARALLEL_SEED={SEED} reruns it")  # shown with any failure of the tests below
    data = ("--data", str(small_corpus(tmp)))  # every run's, the references' too
    ck = str(tmp / "ck_dpep")
    chains = {  # the 4- then 16-process one first, so that the smaller ones fill in beside it
        "dpep": [step(4, *DPEP, "--parallel", "fsdp", *SHORT, "--snapshot", ck),
                 step(16, "--pp", "2", "--tp", "2", "--cp", "2", "--ep", "2", "--parallel", "fsdp", "--batch-size",
                      "2", "--accumulate", "2", "--max-steps", "8", "--snapshot", ck)],
        "ep4": [step(4, "--ep", "4", "--batch-size", "1", "--max-steps", "8"), step(4, *DPEP_DDP, *SHORT)],
        "one": [step(1, *ONE), step(1, *DROP, "--accumulate", "4")],
        "one_acc": [step(1, *ONE_ACC, "--snapshot", str(tmp / "ck_one"))],
        "ep2": [step(2, *EP2, "--max-steps", "8")],
        "cap": [step(2, *EP2, *SHORT, "--capacity-factor", "2"),
                step(2, "--ep", "2", *DROP, "--accumulate", "2", "--balance", "rank")],
        "rank": [step(2, *EP2, *SHORT, "--balance", "rank")],
        **{bug: [step(4 if command is DPEP_DDP else 2, *command, *SHORT)] for bug, (_, _, command) in BUGS.items()
           if bug != "splits"},
    }
    scripts = {bug: mutate(STAGE, old, new, tmp / f"{bug}_stage") for bug, (old, new, _) in BUGS.items()}
    found = run_chains(chains, tmp, names={"dpep": ["dpep", "five"], "ep4": ["ep4", "dpep_ddp"],
                                           "one": ["one", "drop_one"], "cap": ["cap", "drop"]},
                       scripts={k: v for k, v in scripts.items() if k in chains}, args=data)
    # The split bug may end the job (the sizes disagree) or train on: it is launched unchecked.
    found["splits"] = launch(step(2, *EP2, *SHORT, *data), out=tmp / "splits", script=scripts["splits"],
                             timeout=time_limit(programs=2))
    return found


def same_experts(run: Run, one: Run) -> None:
    """The tokens each expert of each block took, step by step from the first, are one process's: the same routing
    (a resumed run's first steps are its checkpoint's: progress.json keeps them)."""
    mine, theirs = run.summary["experts"]["load"], one.summary["experts"]["load"]
    assert mine == theirs[:len(mine)] and len(mine) == run.summary["steps"], f"(seed {SEED}) {mine[:1]} vs {theirs[:1]}"
    assert run.summary["experts"]["aux_losses"] == pytest.approx(
        one.summary["experts"]["aux_losses"][:run.summary["steps"]], abs=TOL)


def test_ep_4_and_ep_2_are_one_process(runs):
    """ep 4 (one expert a rank, the tokens of 4 ranks sent to it) and ep 2 with 2 micro-batches a step, both under
    DDP: every state, loss, gradient norm, the experts' loads, the held-out loss and the sample are one process's."""
    for name, one, steps, layout in [("ep4", "one", [0, 8], "ep 4, DDP, batch 1"),
                                     ("ep2", "one_acc", [0, 8], "ep 2, DDP, batch 2 × 2 micro-batches")]:
        run = runs[name]
        s = run.summary
        assert (s["stage"], s["experts"]["ep"], s["experts"]["experts"], s["experts"]["top_k"]) == \
            (STAGE, int(name[-1]), 4, 2), s["experts"]
        assert f", ep {name[-1]} of the dp x cp | ddp |" in run.stdout, run.stdout
        assert "dropless: every token reaches its experts" in run.stdout and "trains differently" not in run.stdout
        equals_one_process(run, runs[one], steps, layout)
        same_experts(run, runs[one])


def test_dp_and_ep_sharded_then_all_five_resumed_are_one_process(runs):
    """dp 2 x ep 2 under FSDP2 (each expert on two ranks, averaged over them by hand), to step 4; its checkpoint
    resumed by dp 2 x pp 2 x cp 2 x tp 2 with ep 2 of the dp x cp, on 16 processes, to step 8."""
    dpep, five, one = runs["dpep"], runs["five"], runs["one_acc"]
    worst, shared = compare("dp 2 × ep 2, FSDP2, batch 1 × 2 micro-batches", dpep, one)
    assert shared == [0, 4] and worst <= TOL, f"dp 2 x ep 2 vs one process (seed {SEED}): {worst:.2e}"
    same_experts(dpep, one)
    s = five.summary
    assert (s["world_size"], s["dp"], s["pp"], s["tp"], s["cp"], s["experts"]["ep"], s["resumed_at"]) == \
        (16, 2, 2, 2, 2, 2, 4), s
    assert "world size 16 = dp 2 x pp 2 (1f1b, 2 micro-batches) x cp 2 (ring, zigzag) x tp 2, ep 2 of the dp x cp" \
        in five.stdout, five.stdout
    assert "(written by 4 ranks) at step 4" in five.stdout, five.stdout
    equals_one_process(five, one, [4, 8], "**dp 2 × pp 2 × cp 2 × tp 2 × ep 2** on 16 processes, resumed from the "
                       "run above's checkpoint")
    same_experts(five, one)


def test_a_capacity_no_expert_can_reach_drops_nothing_and_changes_nothing(runs):
    """--capacity-factor 2 with 4 experts and k = 2: an expert may take every token of a rank, so none is dropped;
    the run says before it starts that a capacity may make it differ, and computes one process's training."""
    run = runs["cap"]
    assert "this run trains differently from one process: a rank's experts drop the tokens past its capacity" \
        in run.stdout, run.stdout
    assert run.summary["experts"]["dropped"] == [0.0] * 4 and "| dropped 0.0% |" in run.stdout
    worst, shared = compare("ep 2 with a capacity of 2 × the even share (nothing dropped)", run, runs["one_acc"])
    assert shared == [0, 4] and worst <= TOL, f"(seed {SEED}) {worst:.2e}"


def test_dp_and_ep_under_ddp_is_one_process(runs):
    """dp 2 x ep 2 under DDP, the replicas bug's command unbroken: DDP leaves the experts out (parallelize.py), and
    average_gradients sums each expert's over its replicas and divides by the world, as DDP does the rest."""
    run = runs["dpep_ddp"]
    assert ", ep 2 of the dp x cp | ddp |" in run.stdout and (run.summary["dp"], run.summary["experts"]["ep"]) == \
        (4, 2), run.stdout
    worst, shared = compare("dp 2 × ep 2, DDP, batch 1 × 2 micro-batches", run, runs["one_acc"])
    assert shared == [0, 4] and worst <= TOL, f"dp 2 x ep 2 under DDP vs one process (seed {SEED}): {worst:.2e}"
    same_experts(run, runs["one_acc"])


def test_experts_that_overflow_drop_per_rank_as_one_process_of_the_same_micro_batches(runs):
    """--capacity-factor 0.5: every expert takes at most 6 rows of a rank's micro-batch (one window, 48 pairs), so at
    least half of the (token, expert) pairs are dropped; and ep 2 (the capacity per rank, the load counted per rank)
    computes the training of one process whose micro-batches are the ranks' windows, each with the same capacity: the
    same states, losses, gradient norms, loads and dropped pairs. (Not the held-out loss: its batches differ, so do
    the drops.)"""
    run, one = runs["drop"], runs["drop_one"]
    assert "this run trains differently from one process: each rank counts the experts' load over its own tokens " \
           "(--balance rank); a rank's experts drop the tokens past its capacity" in run.stdout, run.stdout
    dropped = run.summary["experts"]["dropped"]
    assert len(dropped) == 4 and 0.5 <= min(dropped) <= max(dropped) < 1 and dropped == pytest.approx(
        one.summary["experts"]["dropped"], abs=1e-12), (dropped, one.summary["experts"]["dropped"])
    worst, shared = compare("ep 2, capacity 0.5 × the even share (experts overflow), against one process of the same "
                            "micro-batches", run, one)
    assert shared == [0, 4] and worst <= TOL, f"(seed {SEED}) {worst:.2e}"
    same_experts(run, one)


@pytest.mark.parametrize("bug", ["slot", "gates", "replicas", "rank"])
def test_a_planted_bug_is_caught(runs, bug):
    """Each bug trains without an error and is far from one process, where its command unbroken (TWINS) is within
    the tolerance of it."""
    run, twin = runs[bug], runs[TWINS[bug]]
    worst, _ = compare(f"**negative control**: {bug}", run, runs["one_acc"])
    assert worst > 1e3 * TOL, f"the {bug} copy is within {worst:.2e} of one process (seed {SEED})"
    assert quiet_compare(twin, runs["one_acc"])[0] <= TOL, f"{TWINS[bug]}, unbroken, fails too (seed {SEED})"
    if bug == "rank":  # said before training
        assert "this run trains differently from one process: each rank counts the experts' load over its own " \
               "tokens (--balance rank)" in run.stdout, run.stdout


def test_the_backward_with_the_forwards_splits_is_caught(runs):
    """The backward's all-to-all with the forward's splits: the job fails, or trains far from one process."""
    run = runs["splits"]
    assert quiet_compare(runs[TWINS["splits"]], runs["one_acc"])[0] <= TOL, f"ep2, unbroken, fails too (seed {SEED})"
    if run.returncode == 0:
        worst, _ = compare("**negative control**: splits", run, runs["one_acc"])
        assert worst > 1e3 * TOL, f"the splits copy is within {worst:.2e} of one process (seed {SEED})"
    else:  # gloo: "RuntimeError: Split sizes doesn't match total dim 0 size", on every rank
        assert "Split sizes doesn't match" in run.stdout + run.stderr, run.describe()


def test_bad_expert_flags_are_one_line_and_exit_2():
    """What must divide what (ep the experts, ep the dp x cp processes), k at most E, the weights' signs; and the
    controls accepted."""
    cases = [
        (["--ep", "3"], {"WORLD_SIZE": "3"}, "--ep: 3 does not divide --experts 4"),
        (["--ep", "4"], {"WORLD_SIZE": "2"}, "--ep: 4 does not divide the 2 dp x cp processes"),
        (["--ep", "2", "--tp", "2", "--parallel", "fsdp"], {"WORLD_SIZE": "2"},
         "--ep: 2 does not divide the 1 dp x cp processes"),
        (["--top-k", "5"], {}, "--top-k: 5 is more than --experts 4"),
        (["--aux-weight", "-1"], {}, "--aux-weight: must be 0 (no balancing loss) or positive"),
        (["--capacity-factor", "0"], {}, "--capacity-factor: must be a positive float"),
        (["--experts", "0"], {}, "--experts: must be a positive int"),
        (["--pp-schedule", "dualpipev"], {}, "--pp-schedule: dualpipev runs several stages a rank of a pipeline"),
        (["--ep", "2", "--parallel", "fsdp", "--compile", "--ac", "selective"], {"WORLD_SIZE": "2"},
         "--compile: under --ep, --ac checkpoints the attention alone"),
    ]
    # stage 13's refusals of several stages a rank, and the split backward that --ac selective cannot take
    pp = ["--pp", "2", "--parallel", "fsdp", "--layers", "4", "--accumulate", "4"]
    cases += [([*pp, "--stages-per-rank", "2"], {"WORLD_SIZE": "2"}, "--stages-per-rank: 1f1b runs one stage a rank"),
              ([*pp, "--pp-schedule", "zbv", "--stages-per-rank", "3"], {"WORLD_SIZE": "2"},
               "--stages-per-rank: zbv places exactly 2 stages a rank"),
              ([*pp, "--pp-schedule", "dualpipev", "--stages-per-rank", "2", "--ac", "selective"],
               {"WORLD_SIZE": "2"}, "--ac: dualpipev runs two backwards over each block (input, then weight "
               "gradients), and a selective checkpoint's saved outputs serve one")]
    refused_in_one_line(cases, STAGE)
    assert refusal(["--ep", "2", "--cp", "2", "--tp", "2", "--parallel", "fsdp"], {"WORLD_SIZE": "8"},
                   STAGE)[0] == "accepted"
    for schedule in ("interleaved1f1b", "dualpipev"):  # (full: the experts told of each recomputation, however many)
        assert refusal([*pp, "--pp-schedule", schedule, "--stages-per-rank", "2", "--ac", "full"],
                       {"WORLD_SIZE": "2"}, STAGE)[0] == "accepted", schedule
    assert refusal(["--ep", "4", "--experts", "8"], {"WORLD_SIZE": "4"}, STAGE)[0] == "accepted"
    assert refusal(["--compile", "--ac", "full"], {}, STAGE)[0] == "accepted"  # (ep 1: the whole block compiles)


# ─── Several pipeline stages a rank, with experts ───────────────────────────────────────────────────────────────────
# Stage 13's --stages-per-rank 2 at pp 2 (4 stages): the tiny model with 4 blocks, one a stage, 3 steps, each block's
# experts and balancing loss carried through torch's schedule. The reference: one process of the same micro-batches,
# 4 of 2 windows (the balancing loss counts its load per micro-batch). Interleaved 1F1B on pp 2 x tp 2 --sp (4
# processes; each tp rank routes its own tokens), 2 windows a micro-batch; ZB-V (the split backward: input gradients,
# then the weights') on dp 2 x pp 2 with the experts over ep 2 of the dp ranks, 1 window a micro-batch a rank. Two
# planted bugs, each on one of their commands.
PPV = ("--layers", "4", "--max-steps", "3", "--pp", "2", "--stages-per-rank", "2", "--parallel", "fsdp",
       "--accumulate", "4")
INTERLEAVED = (*PPV, "--pp-schedule", "interleaved1f1b", "--batch-size", "2")
ZBV_EP = (*PPV, "--pp-schedule", "zbv", "--ep", "2", "--batch-size", "1")
# Beside cp 2 (each window's positions split over 2 ranks, the ring in every stage's attention): interleaved 1F1B, and
# ZB-V with --ac full (no --ep: each block checkpointed whole, its experts recomputed, in B and again in W)
ZBV_CP_AC = (*PPV, "--pp-schedule", "zbv", "--batch-size", "2", "--cp", "2", "--ac", "full")
PARTS = "        parts.append(parallelize(part, grid, cp, ep, args))\n"
STAGE_BUGS = {
    # The second stage's blocks (rank 1's first) without their balancing loss's gradient.
    "aux_stage": (PARTS, PARTS + "        for moe in [m for m in part.modules() if index == 1 and hasattr(m, "
                  "'aux_weight')]:\n            moe.aux_weight = 0.0\n", INTERLEAVED),
    # The blocks resharded after their forward under the split backward: the weight gradients (W) are then taken of
    # the shards, not of the gathered weights the forward used, and the blocks' (the routers' among them) are lost.
    "resharded": ("reshard_after_forward=not keep", "reshard_after_forward=True", ZBV_EP),
}


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("experts_stages")
    print(f"seed {SEED}: CONTEXT_PARALLEL_SEED={SEED} reruns it")
    chains = {"zbv_ep": [step(4, *ZBV_EP)], "resharded": [step(4, *ZBV_EP)],  # the 4-process ones first
              "interleaved": [step(4, *INTERLEAVED, "--tp", "2", "--sp")],
              "inter_cp": [step(4, *INTERLEAVED, "--cp", "2")], "zbv_cp_ac": [step(4, *ZBV_CP_AC)],
              "aux_stage": [step(2, *INTERLEAVED)],
              "one_v": [step(1, "--layers", "4", "--max-steps", "3", "--batch-size", "2", "--accumulate", "4")]}
    scripts = {bug: mutate(STAGE, old, new, tmp / f"{bug}_stage") for bug, (old, new, _) in STAGE_BUGS.items()}
    return run_chains(chains, tmp, scripts=scripts, args=("--data", str(small_corpus(tmp))))


def test_several_stages_a_rank_with_experts_are_one_process(stage_runs):
    """Interleaved 1F1B beside tp 2 --sp (rank 0 holds stages 0 and 2) and ZB-V beside dp 2 and ep 2 (rank 0 holds 0
    and 3, the V); each beside cp 2, ZB-V with --ac full: every state, loss, gradient norm, the held-out loss, the
    sample, the tokens each expert took and the balancing loss of every step are one process's of the same
    micro-batches."""
    one = stage_runs["one_v"]
    for name, placed, layout in [
            ("interleaved", "[0, 2]", "pp 2 × tp 2 `--sp`, interleaved 1F1B, 2 stages a rank, 4 micro-batches of 2"),
            ("zbv_ep", "[0, 3]", "dp 2 × pp 2, ZB-V (2 stages a rank in a V), ep 2 of the dp, 4 micro-batches of 1 "
                                 "a rank"),
            ("inter_cp", "[0, 2]", "pp 2 × cp 2, interleaved 1F1B, 2 stages a rank, 4 micro-batches of 2"),
            ("zbv_cp_ac", "[0, 3]", "pp 2 × cp 2, ZB-V (2 stages a rank in a V) `--ac full`, 4 micro-batches of 2")]:
        run = stage_runs[name]
        assert f"stages 4: this rank's {placed}) x" in run.stdout and run.summary["stages_per_rank"] == 2, run.stdout
        equals_one_process(run, one, [0, 3], layout)
        same_experts(run, one)
    assert ", ep 2 of the dp x cp | fsdp |" in stage_runs["zbv_ep"].stdout
    for name in ("inter_cp", "zbv_cp_ac"):
        assert "x cp 2 (ring, zigzag) x tp 1 | fsdp |" in stage_runs[name].stdout, stage_runs[name].stdout
    assert "| --accumulate 4, --ac full" in stage_runs["zbv_cp_ac"].stdout


@pytest.mark.parametrize("bug", STAGE_BUGS)
def test_a_planted_bug_in_several_stages_a_rank_is_caught(stage_runs, bug):
    """The second stage's balancing loss left out (interleaved 1F1B), the blocks resharded between the input and the
    weight gradients (ZB-V): each trains without an error, far from one process, beside its command unbroken (the
    test above). Resharded, some blocks' weights (a router among them) never get a gradient, so AdamW holds no moments
    for them: the gap is then of the weights, the losses and the gradient norms."""
    run, one = stage_runs[bug], stage_runs["one_v"]
    if bug == "aux_stage":
        worst, _ = compare(f"**negative control**: {bug}", run, one)
    else:
        mine, theirs = run.trajectory[-1], one.trajectory[-1]  # (each a file read)
        lost = theirs["exp_avg"].keys() - mine["exp_avg"].keys()
        assert any(".moe.router." in name for name in lost), f"(seed {SEED}) no router lost its gradient: {lost}"
        found = [max((a - theirs["params"][n]).abs().max().item() for n, a in mine["params"].items())]
        found += [max(abs(a - b) for a, b in zip(run.summary[k], one.summary[k], strict=True))
                  for k in ("losses", "grad_norms")]
        print(f"\n| **negative control**: {bug} (no gradient, so no AdamW moments, for {len(lost)} weights) | 3 | "
              + " | ".join(f"{x:.1e}" for x in found) + f" |  (seed {SEED})")
        worst = max(found)
    assert worst > 1e3 * TOL, f"the {bug} copy is within {worst:.2e} of one process (seed {SEED})"


# ─── The mixture in one process, against one written token by token ────────────────────────────────────────────────
# A mixture of width 8 and E = 4 experts on 40 tokens, float64, its weights drawn at the session's seed. MoE.forward
# sorts the (token, choice) pairs by expert and runs each expert on its rows at once; the reference below loops over
# the tokens and their choices, and computes the balancing loss from its own counts, so they share no code.
WIDTH, E, TOKENS = 8, 4, 40
# Bugs planted in MoE's arithmetic, each caught by the reference (test_a_planted_bug_in_the_mixture_is_caught): the
# file's text, the broken text, and the case (top-k, capacity factor) that shows it.
MIXTURE_BUGS = {
    "gates not renormalised at k = 2": ("        if self.top_k > 1:  # its output", "        if False:  # its output",
                                        (2, None)),
    "gates renormalised at k = 1": ("        if self.top_k > 1:  # its output", "        if True:  # its output",
                                    (1, None)),
    "the balancing gradient lost": ("torch.full((), ctx.weight, dtype", "torch.full((), 0.0, dtype", (2, None)),
    "the capacity keeps the last rows": ("order = order[place < capacity]",
                                         "order = order[place >= counts.repeat_interleave(counts) - capacity]",
                                         (2, 0.5)),
}


def mixture(moe_class: type, top_k: int, capacity_factor: float | None, aux_weight: float):
    """A MoE of the stage (or of a copy: `moe_class`) with every weight drawn, in training, float64; its input."""
    torch.manual_seed(SEED)
    moe = moe_class(WIDTH, E, top_k).double()
    with torch.no_grad():
        for p in moe.parameters():  # (the experts' weights are drawn by the GPT's initialisation; here, directly)
            p.copy_(torch.randn_like(p) * 0.5)
    moe.capacity_factor, moe.aux_weight = capacity_factor, aux_weight
    return moe.train(), torch.randn(2, TOKENS // 2, WIDTH, dtype=torch.float64, requires_grad=True)


def by_token(moe, x: torch.Tensor, capacity: int | None) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """The mixture, token by token: each token's router probabilities (softmax), its k most probable experts, their
    gates (renormalised over the k when k > 1, the probability itself at k = 1), and its output the sum of gate x
    expert(token) over its choices, where an expert takes the first `capacity` tokens that choose it (in the tokens'
    order) and gives the others nothing. Returns (outputs, the balancing loss E x sum_i f_i P_i, the pairs each expert
    was routed, the pairs dropped)."""
    k = moe.top_k
    w1, b1, w2, b2 = moe.experts.fc_weight, moe.experts.fc_bias, moe.experts.proj_weight, moe.experts.proj_bias
    routed, dropped, outs, probs = [0] * E, 0, [], []
    for token in x.reshape(-1, WIDTH):
        p = torch.softmax(moe.router.weight @ token, dim=0)
        best = sorted(range(E), key=lambda e: -p[e].item())[:k]
        total = sum(p[e] for e in best)
        out = torch.zeros(WIDTH, dtype=x.dtype)
        for e in best:
            routed[e] += 1
            if capacity is not None and routed[e] > capacity:
                dropped += 1
                continue
            gate = p[e] / total if k > 1 else p[e]
            out = out + gate * (w2[e] @ F.gelu(w1[e] @ token + b1[e]) + b2[e])
        outs.append(out)
        probs.append(p)
    f = torch.tensor(routed, dtype=x.dtype) / sum(routed)  # the share of the pairs each expert was routed
    aux = E * (f * torch.stack(probs).mean(0)).sum()
    return torch.stack(outs).view_as(x), aux, routed, dropped


def mixture_gaps(moe_class: type, top_k: int, capacity_factor: float | None) -> tuple[dict[str, float], int]:
    """The largest |difference| between moe_class's MoE and by_token: of the outputs, of the balancing loss and the
    load (MoE's tally), of the gradients of every weight and of the input, for the loss (out * target).sum() plus
    aux_weight x the balancing loss (MoE adds its gradient in backward; the reference's is autograd's); and the pairs
    dropped."""
    aux_weight = 0.5  # large, so that the balancing loss's gradient weighs in the router's (asserted below)
    moe, x = mixture(moe_class, top_k, capacity_factor, aux_weight)
    target = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(SEED))
    capacity = None if capacity_factor is None else math.ceil(capacity_factor * TOKENS * top_k / E)
    inputs = [x, *moe.parameters()]
    out = moe(x)
    grads = torch.autograd.grad((out * target).sum(), inputs)
    ref, aux, routed, dropped = by_token(moe, x, capacity)
    ref_grads = torch.autograd.grad((ref * target).sum() + aux_weight * aux, inputs, retain_graph=True)
    if top_k < E:  # (at k = E every expert takes every token: the balancing loss is 1 whatever the router says)
        router_from_aux = torch.autograd.grad(aux_weight * aux, moe.router.weight)[0]
        assert router_from_aux.abs().max() > 1e3 * TOL, "the balancing loss hardly moves the router: the check is blind"
    tally = moe.tallies[-1]  # the tokens each expert was routed, the balancing loss, the pairs dropped
    gaps = {"outputs": (out - ref).abs().max().item(), "balancing loss": abs(tally[E].item() - aux.item()),
            "load": (tally[:E] - torch.tensor(routed, dtype=tally.dtype)).abs().max().item() +
            abs(tally[E + 1].item() - dropped),
            "gradients": max((a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True))}
    return gaps, dropped


@pytest.mark.parametrize("top_k, capacity_factor", [(1, None), (2, None), (4, None), (2, 0.5), (1, 0.75)])
def test_the_mixture_is_the_one_written_token_by_token(top_k, capacity_factor):
    """MoE's outputs, balancing loss, load and gradients (the balancing loss's included) are those of the mixture
    computed token by token, at k = 1 (the gate the router's probability), 2, and E (every expert), dropless and with
    experts that overflow (a capacity under the load: some pairs dropped, some kept)."""
    gaps, dropped = mixture_gaps(load_stage(STAGE).MoE, top_k, capacity_factor)
    assert max(gaps.values()) <= TOL, f"k {top_k}, capacity {capacity_factor} (seed {SEED}): {gaps}"
    if capacity_factor is not None:  # the case drops pairs, and keeps some: at most capacity x E of the routed
        assert 0 < dropped <= TOKENS * top_k - math.ceil(capacity_factor * TOKENS * top_k / E), (dropped, SEED)


@pytest.mark.parametrize("bug", MIXTURE_BUGS)
def test_a_planted_bug_in_the_mixture_is_caught(bug, tmp_path):
    """Each bug, planted in a copy of the stage, is far from the mixture written token by token."""
    old, new, (top_k, capacity_factor) = MIXTURE_BUGS[bug]
    copy = load_copy(mutate(STAGE, old, new, tmp_path / "stage").parent / "experts.py")
    gaps, _ = mixture_gaps(copy.MoE, top_k, capacity_factor)
    assert max(gaps.values()) > 1e3 * TOL, f"{bug}: within {gaps} of the reference (seed {SEED})"


def tiny_block(aux_weight: float) -> torch.nn.Module:
    """A block of the stage: 4 experts, 2 a token, width 16, float64, the balancing loss's weight `aux_weight`."""
    stage = load_stage(STAGE)
    torch.manual_seed(SEED)
    block = stage.GPT(stage.Config(vocab=10, context=8, layers=1, heads=2, width=16, experts=4, top_k=2)).double() \
        .blocks["0"]
    block.moe.aux_weight = aux_weight
    return block


def split_backward(ac: str) -> tuple[int, list[torch.Tensor]]:
    """A block of the stage (4 experts, 2 a token, float64) checkpointed by parallelize.checkpointed (or not: "none"),
    its backward split as the zero-bubble schedules split it: the input's gradient (B), then the weights' (W), two
    autograd calls on one graph, so that torch's checkpoint recomputes the block for each. Without torch's early stop,
    which else ends a recomputation at the last tensor backward needs, before the experts' tally: each recomputation
    then runs the whole forward. Returns (the tallies the block's experts made, the gradients)."""
    block = tiny_block(0.5)
    if ac != "none":
        load_stage(STAGE).checkpointed(block, ac)
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    with set_checkpoint_early_stop(False):
        loss = block(x).square().sum()
    weights = list(block.parameters())
    grads = [*torch.autograd.grad(loss, x, retain_graph=True), *torch.autograd.grad(loss, weights)]
    return len(block.moe.tallies), grads


def test_a_split_backward_recomputes_a_checkpointed_block_twice_and_its_experts_tally_once():
    """--ac full under interleavedzb, zbv and dualpipev: the recomputation's context is entered once for B and once
    for W, the experts told each time (a context entered once, as a @contextmanager is, raised an AttributeError in
    W), so they tally the forward's tokens once; and B's and W's gradients are those of the block not checkpointed,
    bit for bit. --ac selective cannot take a second backward (torch marks each output it kept as used: "Trying to
    backward an extra time"): train.py refuses it there, in one line."""
    tallies, grads = split_backward("none")
    full_tallies, full_grads = split_backward("full")
    assert (tallies, full_tallies) == (1, 1), f"tallied {full_tallies} times under --ac full"
    assert all(torch.equal(a, b) for a, b in zip(full_grads, grads, strict=True))
    with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
        split_backward("selective")


def block_gradients(compiled: bool, aux_weight: float) -> list[torch.Tensor]:
    """tiny_block's weight gradients, compiled as --compile compiles each block (or not)."""
    block = tiny_block(aux_weight)
    if compiled:
        block.compile()
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED))
    return torch.autograd.grad(block(x).square().sum(), list(block.parameters()))


def test_a_compiled_block_keeps_the_balancing_loss_gradient():
    """--compile: the block's gradients are eager's, the balancing loss's among them (the data-dependent routing
    breaks the graph, and where WithBalanceLoss returned a view of a graph's input, torch rebuilt it outside the
    graph and dropped its backward: a compiled run trained as --aux-weight 0, seen)."""
    eager, compiled, without = block_gradients(False, 0.5), block_gradients(True, 0.5), block_gradients(False, 0.0)
    assert max((a - b).abs().max().item() for a, b in zip(eager, without, strict=True)) > 1e3 * TOL  # (not blind)
    gaps = [(a - b).abs().max().item() for a, b in zip(compiled, eager, strict=True)]
    assert max(gaps) <= TOL, gaps


def test_at_k_1_the_router_learns_from_the_loss():
    """k = 1 with no balancing loss (--aux-weight 0): the gate is the router's probability, so the loss alone gives
    the router a gradient (renormalised over one expert the gate is 1, and the router's would be 0); the start-up
    line says how the gate is made at k = 1, and not at k = 2 (the README's line)."""
    moe, x = mixture(load_stage(STAGE).MoE, 1, None, 0.0)
    (moe(x) * torch.randn(x.shape, dtype=x.dtype)).sum().backward()
    assert moe.router.weight.grad.abs().max() > 1e3 * TOL, moe.router.weight.grad
    args = SimpleNamespace(balance="batch", capacity_factor=None, aux_weight=0.0)
    line = {k: load_stage(STAGE).describe_experts(args, SimpleNamespace(experts=4, top_k=k), SimpleNamespace(size=1),
                                                  split=False) for k in (1, 2)}
    assert "each token to 1, weighted by the router's probability (k = 1: not renormalised, as Switch) |" in line[1]
    assert "each token to 2 |" in line[2], line


def test_ddp_still_leaves_the_named_parameters_out():
    """parallelize.py leaves the expert weights out of DDP with DDP._set_params_and_buffers_to_ignore_for_model, a
    private torch API: if torch drops or changes it, this fails. On a group of one, the stage's GPT with its experts
    named as parallelize names them (expert_params): the DDP built after the call ignores them, and its reducer's
    buckets (what it all-reduces, seen by a communication hook) hold every other parameter and none of them."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    stage = load_stage(STAGE)
    torch.manual_seed(SEED)
    model = stage.GPT(stage.Config(vocab=10, context=8, layers=2, heads=2, width=8, experts=4, top_k=2))
    names = list(stage.expert_params(model))
    assert len(names) == 2 * 4, names  # 2 blocks x the experts' 4 stacked weights
    with group_of_one():
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)  # as parallelize.py calls it
        ddp = DDP(model)
        reduced: list[torch.nn.Parameter] = []

        def hook(state, bucket):  # DDP's default (an all-reduce of the bucket), recording what it holds
            reduced.extend(bucket.parameters())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        ddp(torch.randint(10, (2, 8))).sum().backward()
    ignored = {id(p) for name, p in model.named_parameters() if name in names}
    assert {id(p) for p in reduced} == {id(p) for p in model.parameters()} - ignored, \
        f"DDP reduces {len(reduced)} parameters, of which {sum(id(p) in ignored for p in reduced)} are experts'"
    assert ddp.parameters_to_ignore == set(names), ddp.parameters_to_ignore


TRAFFIC = "python benchmarks/moe_traffic.py --quick --out runs/moe_traffic_quick"  # the README's quick run


def traffic_rows(path: Path) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in r.items()} for r in read_csv(path)]


def traffic_agrees_with_the_formula(rows: list[dict[str, float]]) -> None:
    """moe_traffic's rows (float32, its default --dtype): the formula, 4 n k L (ep - 1)/ep width bytes; the measured
    bytes within 10% of it where the router decides (k < E: the formula assumes every expert its even share), and
    equal to it where every token goes to every expert (k = E); at ep 2 every rank's bytes the same, in and out (each
    sends the rows for the other's experts and the outputs of the other's rows, forward and backward: as many as it
    receives); the ratio columns the quotients; the counts the formula's, whatever the routing."""
    for r in rows:
        ep, k = r["ep"], r["top_k"]
        formula = 4 * r["tokens_per_rank"] * k * r["layers"] * (ep - 1) / ep * r["width"] * 4
        assert r["formula_bytes"] == formula, r
        assert r["sent_mean_ratio"] == pytest.approx(r["sent_mean_bytes"] / formula, rel=1e-9) and \
            r["received_max_ratio"] == pytest.approx(r["received_max_bytes"] / formula, rel=1e-9), r
        if ep == 2:  # (the mean over the ranks is their max only if every rank's is the same)
            assert r["sent_mean_bytes"] == r["sent_max_bytes"] == r["received_max_bytes"], r
        if k == r["experts"]:
            assert r["sent_mean_bytes"] == r["sent_max_bytes"] == r["received_max_bytes"] == formula, r
        else:
            assert abs(r["sent_mean_bytes"] / formula - 1) <= 0.1, r
        assert r["counts_sent_bytes"] == r["counts_formula_bytes"] == r["layers"] * r["experts"] * (ep - 1) / ep * 8, r


@pytest.mark.readme_run(TRAFFIC)
def test_the_all_to_all_carries_the_formulas_bytes(readme_runs):
    """Counted from outside (benchmarks/moe_traffic.py: a tiny model at ep 2, run here; the default model at ep 2
    and 4, the committed CSV, which the README's table is): the bytes agree with the formula, as
    traffic_agrees_with_the_formula says. (A redundant exchange in the backward, planted once, made them 1.5 times
    it; one rank's rows counted twice, or the formula without its (ep - 1)/ep, fail it too.)"""
    run = readme_run(readme_runs, TRAFFIC)
    rows = traffic_rows(run.out / "moe_traffic.csv")
    assert [(r["ep"], r["experts"], r["top_k"]) for r in rows] == [(2, 4, 2), (2, 4, 4)], rows
    for r in rows:  # --quick: 2 blocks of width 32, 16 windows of 24 a step over 2 ranks
        assert (r["tokens_per_rank"], r["layers"], r["width"]) == (16 // 2 * 24, 2, 32), r
    traffic_agrees_with_the_formula(rows)
    assert "wrote " in run.stdout
    committed = ROOT / "benchmarks" / "moe_traffic.csv"
    rows = traffic_rows(committed)
    assert [(r["ep"], r["experts"], r["top_k"]) for r in rows] == [(2, 4, 2), (4, 4, 2), (2, 8, 2), (2, 4, 4),
                                                                      (4, 4, 4)], rows
    traffic_agrees_with_the_formula(rows)
    bench = load_copy(ROOT / "benchmarks" / "moe_traffic.py")
    assert bench.readme_table(committed) in (ROOT / STAGE / "README.md").read_text()


QUALITY = "python benchmarks/moe_quality.py --quick --out runs/moe_quality_quick"  # the README's quick run


@pytest.mark.readme_run(QUALITY)
def test_the_mixtures_training_is_measured_as_the_readme_shows(readme_runs):
    """benchmarks/moe_quality.py (the README's quick run, a tiny model; and the committed CSVs of the full one, which
    the README's two tables are): the balancing loss's runs and the mixture beside the dense GPT, each row what its
    summary.json says. Its load ratios lie between even (1) and the most k = 2 of E = 4 allows (2); the last block's
    shares add up to 1; a token's active parameters are the dense model's plus the router's at k = 1, more at k = 2."""
    bench = load_copy(ROOT / "benchmarks" / "moe_quality.py")
    run = readme_run(readme_runs, QUALITY)
    committed = ROOT / "benchmarks" / "moe_balance.csv", ROOT / "benchmarks" / "moe_dense.csv"
    for balance_csv, dense_csv, length in ((run.out / "moe_balance.csv", run.out / "moe_dense.csv", 20),
                                           (*committed, 200)):
        balance, dense = read_csv(balance_csv), read_csv(dense_csv)
        assert [(float(r["aux_weight"]), int(r["steps"])) for r in balance] == [(0.01, length), (0.0, length)], balance
        for r in balance:
            assert all(1 <= float(r[k]) <= 2 for k in ("busiest_first", "busiest_last", "busiest_last_worst")), r
            assert float(r["busiest_last"]) <= float(r["busiest_last_worst"]), r
            assert sum(map(float, r["last_block_shares"].split())) == pytest.approx(1, abs=1e-3), r
        by_model = {(r["model"], int(r["top_k"])): r for r in dense}
        dense_active = int(by_model[("dense", 0)]["active"])
        assert int(by_model[("dense", 0)]["parameters"]) == dense_active
        k1, k2 = int(by_model[("moe", 1)]["active"]), int(by_model[("moe", 2)]["active"])
        layers, width = (2, 32) if length == 20 else (4, 128)
        assert k1 == dense_active + layers * 4 * width, (k1, dense_active)  # the router's width x E a block
        assert k1 < k2 < int(by_model[("moe", 2)]["parameters"]), by_model
    tables = bench.readme_tables(*committed)
    readme = (ROOT / STAGE / "README.md").read_text()
    assert all(table in readme for table in tables), "14's README: paste benchmarks/moe_quality.py's readme_tables()"
