"""Stage 14: the GPT with a mixture of experts computes one process's training with its experts over ep processes
(ep 2, ep 4, dp 2 x ep 2, with accumulation, DDP and FSDP2), resumes a checkpoint on all five dimensions at once, and
a planted bug in each part of expert parallelism is caught.

tests/test_context_parallel.py's tiny model (2 blocks, 2 heads, width 32, context 24) with 4 experts a block, each
token to 2, float64, at that module's seed (drawn for the session; printed with every failure). Two references, as one
process: `one` (batch 4) and `one_acc` (batch 4 in 2 micro-batches: the balancing loss counts its load per
micro-batch, so a layout equals the reference with the same micro-batches: its ranks' micro-batch i together is the
reference's micro-batch i):

    ep4      torchrun 4: ep 4 (an expert a rank), DDP, batch 1: `one`
    ep2      torchrun 2: ep 2, DDP, batch 2 x 2 micro-batches: `one_acc`
    dpep     torchrun 4: dp 2 x ep 2 (each expert on 2 ranks), FSDP2, batch 1 x 2, to step 4: `one_acc`
    five     torchrun 16: dp 2 x pp 2 x cp 2 x tp 2, ep 2 of the dp x cp, 1F1B, resumed from dpep's checkpoint to 8
    cap      ep2's command with --capacity-factor 2 (no expert can overflow: nothing dropped): `one_acc`

Every state (weights, both AdamW moments), loss, gradient norm and the tokens each expert took are compared, within
sqrt(eps) of float64 (the tokens exactly). The planted bugs, each on ep2's or dpep's command (4 steps), must leave
one process's training far behind: a row sent to another expert's slot, the combine without the gates, the
backward's all-to-all with the forward's splits, the balancing loss counted per rank (--balance rank, which most
trainers use: the run says so before it starts), and the experts' gradients averaged over their replicas only.
"""
from __future__ import annotations

import pytest

from conftest import readme_run
from harness import ROOT, Run, Step, launch, load_copy, mutate, run_chains, time_limit, tolerance
from test_context_parallel import SEED, TINY, compare, equals_one_process
from test_gpt import refusal, refused_in_one_line
from tools.cli import read_csv

STAGE = "14_experts"
TOL = tolerance("float64")
ONE = ("--batch-size", "4", "--max-steps", "8")
ONE_ACC = ("--batch-size", "4", "--accumulate", "2", "--max-steps", "8")
EP2 = ("--ep", "2", "--batch-size", "2", "--accumulate", "2")
DPEP = ("--ep", "2", "--batch-size", "1", "--accumulate", "2")
SHORT = ("--max-steps", "4", "--decay-steps", "8")  # the planted bugs: the reference's first 4 steps
# The planted bugs: (the file's text, the broken text, the command).
BUGS = {
    # The rows arrive by sender, each sender's by expert: regrouped as if by expert first, a row meets another expert.
    "slot": ("mine = torch.arange(sent.shape[1], device=rows.device).repeat(self.size)",
             "mine = torch.arange(sent.shape[1], device=rows.device).repeat_interleave(self.size)", EP2),
    "gates": ("index_add_(0, token, (out * gates.flatten()[order, None])", "index_add_(0, token, (out)", EP2),
    "splits": ("dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)",
               "dist.all_to_all_single(back, grad.contiguous(), ctx.recv_splits, ctx.send_splits, group=ctx.group)",
               EP2),
    "replicas": ("            grad.div_(world)", "            grad.div_(dist.get_world_size(self.replicas))", DPEP),
}


def step(nproc: int, *args: str) -> Step:
    return Step(STAGE, "python" if nproc == 1 else "torchrun", (*TINY, *args), nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("experts")
    print(f"seed {SEED}: CONTEXT_PARALLEL_SEED={SEED} reruns it")  # shown with any failure of the tests below
    ck = str(tmp / "ck_dpep")
    chains = {  # the 4- then 16-process one first, so that the smaller ones fill in beside it
        "dpep": [step(4, *DPEP, "--parallel", "fsdp", *SHORT, "--snapshot", ck),
                 step(16, "--pp", "2", "--tp", "2", "--cp", "2", "--ep", "2", "--parallel", "fsdp", "--batch-size",
                      "2", "--accumulate", "2", "--max-steps", "8", "--snapshot", ck)],
        "ep4": [step(4, "--ep", "4", "--batch-size", "1", "--max-steps", "8")],
        "one": [step(1, *ONE)],
        "one_acc": [step(1, *ONE_ACC, "--snapshot", str(tmp / "ck_one"))],
        "ep2": [step(2, *EP2, "--max-steps", "8")],
        "cap": [step(2, *EP2, *SHORT, "--capacity-factor", "2")],
        "rank": [step(2, *EP2, *SHORT, "--balance", "rank")],
        **{bug: [step(4 if command is DPEP else 2, *command, *SHORT)] for bug, (_, _, command) in BUGS.items()
           if bug != "splits"},
    }
    scripts = {bug: mutate(STAGE, old, new, tmp / f"{bug}_stage") for bug, (old, new, _) in BUGS.items()}
    found = run_chains(chains, tmp, names={"dpep": ["dpep", "five"]},
                       scripts={k: v for k, v in scripts.items() if k in chains})
    # The split bug may end the job (the sizes disagree) or train on: it is launched unchecked.
    found["splits"] = launch(step(2, *EP2, *SHORT), out=tmp / "splits", script=scripts["splits"],
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


@pytest.mark.parametrize("bug", ["slot", "gates", "replicas", "rank"])
def test_a_planted_bug_is_caught(runs, bug):
    """Each bug trains without an error and is far from one process."""
    run = runs[bug]
    worst, _ = compare(f"**negative control**: {bug}", run, runs["one_acc"])
    assert worst > 1e3 * TOL, f"the {bug} copy is within {worst:.2e} of one process (seed {SEED})"
    if bug == "rank":  # said before training
        assert "this run trains differently from one process: each rank counts the experts' load over its own " \
               "tokens (--balance rank)" in run.stdout, run.stdout


def test_the_backward_with_the_forwards_splits_is_caught(runs):
    """The backward's all-to-all with the forward's splits: the job fails, or trains far from one process."""
    run = runs["splits"]
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
    ]
    refused_in_one_line(cases, STAGE)
    assert refusal(["--ep", "2", "--cp", "2", "--tp", "2", "--parallel", "fsdp"], {"WORLD_SIZE": "8"},
                   STAGE)[0] == "accepted"
    assert refusal(["--ep", "4", "--experts", "8"], {"WORLD_SIZE": "4"}, STAGE)[0] == "accepted"


TRAFFIC = "python benchmarks/moe_traffic.py --quick --out runs/moe_traffic_quick"  # the README's quick run


@pytest.mark.readme_run(TRAFFIC)
def test_the_all_to_all_carries_the_formulas_bytes(readme_runs):
    """Counted from outside (benchmarks/moe_traffic.py, a tiny model at ep 2): where every token goes to every expert
    (k = E) each expert has its even share, and every rank's bytes per step are the formula's to the byte; the counts
    are, whatever the routing. (A redundant exchange in the backward, planted once, made them 1.5 times it.) And the
    README's table is the committed CSV's, the default run's."""
    run = readme_run(readme_runs, TRAFFIC)
    rows = [{k: float(v) for k, v in r.items()} for r in read_csv(run.out / "moe_traffic.csv")]
    assert [(r["ep"], r["experts"], r["top_k"]) for r in rows] == [(2, 4, 2), (2, 4, 4)], rows
    for r in rows:  # --quick: 2 blocks of width 32, 16 windows of 24 a step over 2 ranks, float32
        tokens, k = 16 // 2 * 24, r["top_k"]
        assert r["tokens_per_rank"] == tokens and r["formula_bytes"] == 4 * tokens * k * 2 * (1 / 2) * 32 * 4, r
        assert r["counts_sent_bytes"] == r["counts_formula_bytes"] == 2 * 4 / 2 * 8, r
        # At ep 2 a rank sends at most all its n k rows and all it received (as many), both ways: 2 x the formula.
        assert 0 < r["sent_mean_bytes"] <= r["sent_max_bytes"] <= 2 * r["formula_bytes"], r
    every = rows[1]
    assert every["sent_mean_bytes"] == every["sent_max_bytes"] == every["received_max_bytes"] == \
        every["formula_bytes"], every
    assert "wrote " in run.stdout
    bench = load_copy(ROOT / "benchmarks" / "moe_traffic.py")
    assert bench.readme_table(ROOT / "benchmarks" / "moe_traffic.csv") in (ROOT / STAGE / "README.md").read_text()
