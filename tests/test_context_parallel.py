"""Stage 12: the GPT with every sequence split over cp processes computes one process's training on every layout it
combines cp with (DDP and FSDP2 over dp x cp, tp, accumulation, both attentions, both splits), resumes a checkpoint on
another layout, and refuses bad combinations in one line. (The pipeline, and all four dimensions at once, are stage
13's: tests/test_pipeline_4d.py.)

Six launches of a tiny model (2 blocks, 2 heads, width 32, context 24: it splits into 2 cp chunks of 2, 3 or 4
ranks), float64, at a seed drawn for the session (hidden from the code under test; printed with every failure), on
the first 24,000 characters of tiny Shakespeare (harness.small_corpus: every layout scores the held-out tenth whole):

    one      python, batch 4, 8 steps, a checkpoint every 4 (its trajectory: the state at 0, 4, 8): the reference
    cp2      torchrun 2: dp 1 x cp 2, ring attention, zigzag, DDP over the cp ranks, 8 steps
    dpcp     torchrun 4: dp 2 x cp 2, FSDP2 over the 4 ranks, batch 2, 4 steps (--decay-steps 8)
    tpcp     torchrun 4: cp 2 x tp 2, the all-gather attention, contiguous split, resumed from dpcp's checkpoint to 8
    cp3      torchrun 3: cp 3, batch 2 x --accumulate 2, 4 steps (--decay-steps 8)
    broken   cp2's command on a copy of the stage whose ring stops one hop short: the control of cp2's check

States (weights, both AdamW moments), per-step losses and gradient norms are compared with test_gpt.gaps, within
sqrt(eps) of float64. The ring itself, at cp 2, 3 and 4 against full attention, is tests/test_ring_attention.py's.
Each comparison prints its row of 12's README table (`pytest tests/test_context_parallel.py -s` shows them).
"""
from __future__ import annotations

import os
import random

import pytest

from harness import ROOT, Run, Step, mutate, run_chains, small_corpus, tolerance
from test_gpt import gaps, refusal, refused_in_one_line

STAGE = "12_context_parallel"
TOL = tolerance("float64")
DATA = ROOT / "11_gpt" / "data" / "input.txt"
# The same for every run of the session (they must agree with each other; tests/test_pipeline_4d.py's runs use it
# too); every failure names it, and CONTEXT_PARALLEL_SEED=<seed> pytest tests/test_context_parallel.py (or
# tests/test_pipeline_4d.py) reruns it.
SEED = int(os.environ.get("CONTEXT_PARALLEL_SEED") or random.randrange(10_000))
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "24", "--dtype", "float64", "--device", "cpu",
        "--eval-every", "4", "--save-every", "4", "--sample", "30", "--lr", "0.01", "--warmup-steps", "2",
        "--clip", "1.0", "--seed", str(SEED), "--data", str(DATA))
# The ring's loop in the forward: one hop short, the last rank's keys never reach this one.
RING = "        for step in range(cp):\n            origin = (rank - step) % cp  # the rank whose keys"
SHORT = RING.replace("range(cp)", "range(cp - 1)")


def compare(label: str, run: Run, one: Run) -> tuple[float, list[int]]:
    """(the largest gap from one process, the steps both recorded); prints the row of the stage's README table (12's,
    or 13's for tests/test_pipeline_4d.py): the steps, then the largest |difference| of the state, of the per-step
    losses, of the gradient norms."""
    found, shared = gaps(run, one)
    print(f"\n| {label} | {', '.join(map(str, shared))} | {found['state']:.1e} | {found['losses']:.1e} | "
          f"{found['grad_norms']:.1e} |  (seed {SEED})")
    return max(found.values()), shared


def step(nproc: int, *args: str) -> Step:
    return Step(STAGE, "python" if nproc == 1 else "torchrun", (*TINY, *args), nproc=nproc)


CP2 = ("--cp", "2", "--batch-size", "4", "--max-steps", "8")
ONE = ("--batch-size", "4", "--max-steps", "8")  # the reference: the state at 0, 4 and 8 (a checkpoint every 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("cp")
    print(f"seed {SEED}: CONTEXT_PARALLEL_SEED={SEED} reruns it")  # shown with any failure of the tests below
    broken = mutate(STAGE, RING, SHORT, tmp / "broken_stage")
    data = ("--data", str(small_corpus(tmp)))  # every run's, the reference's too
    chains = {  # the 4-process ones first, so that the smaller ones fill in beside them
        "dpcp": [step(4, "--cp", "2", "--parallel", "fsdp", "--batch-size", "2", "--max-steps", "4",
                      "--decay-steps", "8", "--snapshot", str(tmp / "ck_dpcp")),
                 step(4, "--cp", "2", "--tp", "2", "--parallel", "fsdp", "--cp-impl", "allgather", "--no-zigzag",
                      "--batch-size", "4", "--max-steps", "8", "--snapshot", str(tmp / "ck_dpcp"))],
        "one": [step(1, *ONE, "--snapshot", str(tmp / "ck_one"))],
        "cp2": [step(2, *CP2, "--snapshot", str(tmp / "ck_cp2"))],
        "cp3": [step(3, "--cp", "3", "--batch-size", "2", "--accumulate", "2", "--max-steps", "4", "--decay-steps", "8",
                     "--snapshot", str(tmp / "ck_cp3"))],
        "broken": [step(2, *CP2, "--snapshot", str(tmp / "ck_broken"))],
    }
    return run_chains(chains, tmp, names={"dpcp": ["dpcp", "tpcp"]}, scripts={"broken": broken}, args=data)


def equals_one_process(run: Run, one: Run, steps: list[int], layout: str) -> None:
    """The states both runs recorded (at `steps`), every step's loss and gradient norm, the held-out loss (the last,
    shorter window padded) and the sample: one process's. (For a run that trained to one's last step.)"""
    worst, shared = compare(layout, run, one)
    worst = max(worst, abs(run.summary["eval_loss"] - one.summary["eval_loss"]))
    assert shared == steps and worst <= TOL, f"{layout} vs one process (seed {SEED}): {worst:.2e}"
    assert (run.summary["eval_count"], run.summary["sample"]) == (one.summary["eval_count"], one.summary["sample"]), \
        f"{layout} (seed {SEED})"


def test_two_cp_ranks_are_one_process(runs):
    """dp 1 x cp 2: each rank holds half of every window (zigzag), DDP averages over the two; every recorded state,
    loss and gradient norm, the held-out loss (its last, shorter window padded) and the sample equal one process's."""
    run, one = runs["cp2"], runs["one"]
    s = run.summary
    assert (s["world_size"], s["dp"], s["cp"], s["cp_impl"], s["zigzag"]) == (2, 1, 2, "ring", True), s
    assert "world size 2 = dp 1 x cp 2 (ring, zigzag) x tp 1" in run.stdout, run.stdout
    equals_one_process(run, one, [0, 4, 8], "cp 2, ring, zigzag (DDP over the two)")


def test_dp_and_cp_sharded_then_tp_and_cp_resumed_are_one_process(runs):
    """dp 2 x cp 2 under FSDP2 (sharded over all 4), to step 4; its checkpoint resumed by cp 2 x tp 2 with the
    all-gather attention and the contiguous split, to step 8: the reference's states at 0, 4 and 8."""
    dpcp, tpcp, one = runs["dpcp"], runs["tpcp"], runs["one"]
    assert (dpcp.summary["dp"], dpcp.summary["cp"], dpcp.summary["parallel"]) == (2, 2, "fsdp")
    worst, shared = compare("dp 2 × cp 2, FSDP2 over all four, batch 2", dpcp, one)
    assert shared == [0, 4] and worst <= TOL, f"dp 2 x cp 2 vs one process (seed {SEED}): {worst:.2e}"
    s = tpcp.summary
    assert (s["dp"], s["cp"], s["tp"], s["cp_impl"], s["zigzag"], s["resumed_at"]) == (1, 2, 2, "allgather", False, 4)
    assert "(written by 4 ranks) at step 4" in tpcp.stdout, tpcp.stdout
    worst, shared = compare("cp 2 × tp 2, all-gather, contiguous split, resumed from the run above's checkpoint "
                            "(4 ranks, another layout)", tpcp, one)
    assert shared == [4, 8] and worst <= TOL, f"cp 2 x tp 2 vs one process (seed {SEED}): {worst:.2e}"
    assert s["sample"] == one.summary["sample"], SEED


def test_three_cp_ranks_with_accumulation_are_one_process(runs):
    """cp 3 (a world no power of two), 2 micro-batches a step: the states at 0 and 4."""
    worst, shared = compare("cp 3, batch 2 × `--accumulate 2`", runs["cp3"], runs["one"])
    assert shared == [0, 4] and worst <= TOL, f"cp 3 vs one process (seed {SEED}): {worst:.2e}"


def test_a_ring_one_hop_short_is_caught(runs):
    """The control of cp2's check: the same command on a copy whose forward stops the ring one hop early (each rank
    never sees one block of keys). It trains without an error, and is far from one process."""
    worst, _ = compare("**negative control**: cp 2 with the ring one hop short", runs["broken"], runs["one"])
    assert worst > 1e3 * TOL, f"the broken copy is within {worst:.2e} of one process (seed {SEED})"


def test_bad_combinations_are_one_line_and_exit_2():
    """What must divide what (cp x tp the world, 2 cp the context, or cp alone without the zigzag), compile with cp,
    an attention there is not; and the controls accepted. (The pipeline's: tests/test_pipeline_4d.py.)"""
    cases = [
        (["--cp", "3"], {"WORLD_SIZE": "4"}, "--cp: 3 x --tp 1 does not divide the world size 4"),
        (["--cp", "2", "--tp", "2", "--parallel", "fsdp"], {"WORLD_SIZE": "2"},
         "--cp: 2 x --tp 2 does not divide the world size 2"),
        (["--cp", "4", "--context", "20"], {"WORLD_SIZE": "4"}, "--context: 20 is not a multiple of 8 (2 x cp"),
        (["--cp", "4", "--context", "26", "--no-zigzag"], {"WORLD_SIZE": "4"}, "--context: 26 is not a multiple of 4"),
        (["--cp", "2", "--compile"], {"WORLD_SIZE": "2"}, "--compile: the ring's sends"),
        (["--cp-impl", "torch"], {}, "--cp-impl: invalid choice"),
        (["--cp-impl", "allgather"], {}, "--cp-impl: it sets how --cp splits the attention, and --cp 1 splits none"),
        (["--no-zigzag"], {}, "--no-zigzag: it sets how --cp splits the attention"),
    ]
    refused_in_one_line(cases, STAGE)
    assert refusal(["--cp", "4", "--context", "24"], {"WORLD_SIZE": "8"}, STAGE)[0] == "accepted"  # dp 2 x cp 4
    assert refusal(["--cp", "2", "--tp", "2", "--parallel", "fsdp"], {"WORLD_SIZE": "4"}, STAGE)[0] == "accepted"
    assert refusal(["--cp", "4", "--context", "28", "--no-zigzag"], {"WORLD_SIZE": "4"}, STAGE)[0] == "accepted"
