"""Stage 13: the GPT with its blocks over pp pipeline stages computes one process's training, alone and on the layouts
it combines them with (all six schedules, dp under FSDP2, all four of dp x pp x cp x tp at once), resumes a checkpoint
that two stages wrote on another layout, and refuses bad combinations in one line.

Five launches of tests/test_context_parallel.py's tiny model (2 blocks, 2 heads, width 32, context 24: one block a
stage), float64, at that module's seed (drawn for the session, hidden from the code under test; printed with every
failure), each compared with stage 13 as one process:

    one      python, batch 4, 8 steps, a checkpoint every 4 (its trajectory: the state at 0, 4, 8): the reference

    pp2      torchrun 2: pp 2 alone, 1F1B, 4 micro-batches of 1, 8 steps
    dppp     torchrun 4: dp 2 x pp 2, GPipe, 2 micro-batches of 1, 4 steps (--decay-steps 8)
    full     torchrun 16: dp 2 x pp 2 x cp 2 x tp 2, 1F1B, 2 micro-batches of 1, resumed from dppp's checkpoint to 8
    ppclip   pp2's command on a copy whose gradient norm leaves out the other stage's blocks: pp2's control

and six more of a 4-block copy (4 stages at pp 2 x --stages-per-rank 2), 3 steps, on harness.small_corpus:

    one4       python, batch 4, a checkpoint at 2: their reference
    dualpipev  torchrun 4: pp 2 x cp 2 --ac full, DualPipeV (the V), to step 2; then interleavedzb (round-robin, pp 2
               alone: 2 processes) resumed from it to 3
    interleaved1f1b  torchrun 4: pp 2 x tp 2 --sp --ac full;  dpzbv  torchrun 4: dp 2 x pp 2 under ZB-V
    cpsp       torchrun 4: cp 2 x tp 2 --sp --ac selective (no pipeline)

States (weights, both AdamW moments), per-step losses and gradient norms are compared with test_gpt.gaps, within
sqrt(eps) of float64. The pipeline's schedules on stage 10's MLP, against one process and the by-hand pipeline, are
tests/test_pipeline.py's. Each comparison prints its row of 13's README table (`pytest tests/test_pipeline_4d.py -s`
shows them).
"""
from __future__ import annotations

import pytest

from harness import Run, Step, mutate, run_chains, small_corpus, tolerance
from test_context_parallel import ONE, SEED, TINY, compare, equals_one_process
from test_gpt import refusal, refused_in_one_line

STAGE = "13_pipeline_4d"
TOL = tolerance("float64")
# The gradient norm over the pipeline: without its all_reduce, each stage clips by the norm of its own blocks.
PP_NORM = "    if pipe.size > 1:\n        dist.all_reduce(total, group=pipe.group)\n"
FS = ("--pp", "2", "--parallel", "fsdp", "--layers", "4")  # the refusals' pipeline


def step(nproc: int, *args: str) -> Step:
    return Step(STAGE, "python" if nproc == 1 else "torchrun", (*TINY, *args), nproc=nproc)


PP2 = ("--pp", "2", "--parallel", "fsdp", "--batch-size", "1", "--accumulate", "4", "--max-steps", "8")
# The schedules of several stages a rank (--stages-per-rank 2, pp 2: 4 stages) need 4 blocks: the tiny model with 4,
# 3 steps (a checkpoint at 2), on harness.small_corpus (its held-out loss scored by every run), against its own
# one-process reference.
V4 = ("--layers", "4", "--max-steps", "3", "--save-every", "2")
PPV = (*V4, "--pp", "2", "--stages-per-rank", "2", "--parallel", "fsdp", "--batch-size", "1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("pp")
    print(f"seed {SEED}: CONTEXT_PARALLEL_SEED={SEED} reruns it")  # shown with any failure of the tests below
    ppclip = mutate(STAGE, PP_NORM, "", tmp / "ppclip_stage")
    small = ("--data", str(small_corpus(tmp)))
    chains = {  # the 4- then 16-process one first, so that the smaller ones fill in beside it
        "dppp": [step(4, "--pp", "2", "--pp-schedule", "gpipe", "--parallel", "fsdp", "--batch-size", "1",
                      "--accumulate", "2", "--max-steps", "4", "--decay-steps", "8",
                      "--snapshot", str(tmp / "ck_dppp")),
                 step(16, "--pp", "2", "--tp", "2", "--cp", "2", "--parallel", "fsdp", "--batch-size", "1",
                      "--accumulate", "2", "--max-steps", "8", "--snapshot", str(tmp / "ck_dppp"))],
        "one": [step(1, *ONE, "--snapshot", str(tmp / "ck_one"))],
        "pp2": [step(2, *PP2, "--snapshot", str(tmp / "ck_pp2"))],
        "ppclip": [step(2, *PP2, "--snapshot", str(tmp / "ck_ppclip"))],
        "one4": [step(1, *V4, *small, "--batch-size", "4", "--snapshot", str(tmp / "ck_one4"))],
        "dualpipev": [step(4, *PPV, *small, "--pp-schedule", "dualpipev", "--accumulate", "4", "--cp", "2", "--ac",
                           "full", "--max-steps", "2", "--decay-steps", "3", "--snapshot", str(tmp / "ck_v")),
                      step(2, *PPV, *small, "--pp-schedule", "interleavedzb", "--accumulate", "4",
                           "--snapshot", str(tmp / "ck_v"))],
        "interleaved1f1b": [step(4, *PPV, *small, "--pp-schedule", "interleaved1f1b", "--accumulate", "4", "--tp", "2",
                                 "--sp", "--ac", "full")],
        "cpsp": [step(4, *V4, *small, "--parallel", "fsdp", "--batch-size", "4", "--cp", "2", "--tp", "2", "--sp",
                      "--ac", "selective")],
        "dpzbv": [step(4, *PPV, *small, "--pp-schedule", "zbv", "--accumulate", "2")],
    }
    return run_chains(chains, tmp, names={"dppp": ["dppp", "full"], "dualpipev": ["dualpipev", "interleavedzb"]},
                      scripts={"ppclip": ppclip})


def test_two_pipeline_stages_are_one_process(runs):
    """pp 2 alone under 1F1B (4 micro-batches a step, each through stage 0's block and then stage 1's): every state,
    loss and gradient norm, the held-out loss and the sample (both computed through the stages by hand) equal one
    process's."""
    run, one = runs["pp2"], runs["one"]
    s = run.summary
    assert (s["stage"], s["world_size"], s["dp"], s["pp"], s["pp_schedule"], s["accumulate"]) == \
        (STAGE, 2, 1, 2, "1f1b", 4), s
    assert "world size 2 = dp 1 x pp 2 (1f1b, 4 micro-batches) x cp 1 x tp 1" in run.stdout, run.stdout
    equals_one_process(run, one, [0, 4, 8], "pp 2, 1F1B, 4 micro-batches of 1 (FSDP2 over a dp of 1)")


def test_dp_and_pp_then_all_four_resumed_are_one_process(runs):
    """dp 2 x pp 2 under GPipe, to step 4; its checkpoint (written by two stages, each its own blocks) resumed by all
    four of dp 2 x pp 2 x cp 2 x tp 2 at once on 16 processes under 1F1B, to step 8: the reference's states at 0, 4
    and 8."""
    dppp, full, one = runs["dppp"], runs["full"], runs["one"]
    assert (dppp.summary["dp"], dppp.summary["pp"], dppp.summary["pp_schedule"]) == (2, 2, "gpipe")
    worst, shared = compare("dp 2 × pp 2, GPipe, 2 micro-batches of 1", dppp, one)
    assert shared == [0, 4] and worst <= TOL, f"dp 2 x pp 2 vs one process (seed {SEED}): {worst:.2e}"
    s = full.summary
    assert (s["world_size"], s["dp"], s["pp"], s["tp"], s["cp"], s["resumed_at"]) == (16, 2, 2, 2, 2, 4), s
    assert "world size 16 = dp 2 x pp 2 (1f1b, 2 micro-batches) x cp 2 (ring, zigzag) x tp 2" in full.stdout
    assert "(written by 4 ranks) at step 4" in full.stdout, full.stdout
    equals_one_process(full, one, [4, 8], "**dp 2 × pp 2 × cp 2 × tp 2** on 16 processes, 1F1B, 2 micro-batches "
                       "of 1, resumed from the run above's checkpoint")


def test_a_gradient_norm_of_one_stage_is_caught(runs):
    """The control of pp2's check: the same command on a copy whose gradient norm is each stage's own (no all_reduce
    over the pipeline), so each clips by another norm. It trains without an error, and is far from one process."""
    worst, _ = compare("**negative control**: pp 2 with each stage clipping by its own blocks' gradient norm",
                       runs["ppclip"], runs["one"])
    assert worst > 1e3 * TOL, f"the copy is within {worst:.2e} of one process (seed {SEED})"


def test_several_stages_a_rank_are_one_process(runs):
    """Each schedule of two stages a rank (pp 2, 4 stages of one block) is one process (4 blocks, 3 steps): DualPipeV
    (the V: rank 0 holds stages 0 and 3) beside cp 2, every block recomputed in backward (--ac full), to step 2, its
    checkpoint resumed under interleaved zero bubble (round-robin: rank 0 holds 0 and 2) on pp 2 alone to 3;
    interleaved 1F1B beside tp 2 --sp --ac full; ZB-V beside a dp of 2 (4 processes, FSDP2 over dp). The zero-bubble
    ones split each backward in two, input then weight gradients: under cp, FSDP2 shards each stage over the 2 cp
    ranks, so a block's weights must stay gathered from its forward to its weight gradient (parallelize's `keep`;
    planted, resharded after the forward: the V run fails, 1.2e-1 from one process in its gradient norms, 3.0e-2 in
    its state)."""
    one = runs["one4"]
    placed = {"dualpipev": "[0, 3]", "interleavedzb": "[0, 2]", "interleaved1f1b": "[0, 2]", "dpzbv": "[0, 3]"}
    for name, stages in placed.items():
        run = runs[name]
        assert (run.summary["pp"], run.summary["stages_per_rank"]) == (2, 2), run.summary
        assert f"stages 4: this rank's {stages}" in run.stdout, run.stdout  # rank 0's line
    assert "x cp 2 (ring, zigzag) x tp 1" in runs["dualpipev"].stdout and runs["dualpipev"].summary["ac"] == "full"
    assert "(written by 4 ranks) at step 2" in runs["interleavedzb"].stdout
    worst, shared = compare("pp 2 × cp 2 `--ac full`, DualPipeV, 2 stages a rank in a V, 4 micro-batches of 1 "
                            "(4 processes)", runs["dualpipev"], one)
    assert shared == [0, 2] and worst <= TOL, f"dualpipev vs one process (seed {SEED}): {worst:.2e}"
    equals_one_process(runs["interleavedzb"], one, [2, 3], "pp 2, interleaved zero bubble, 2 stages a rank "
                       "round-robin, resumed from DualPipeV's checkpoint (written by 4 ranks)")
    assert runs["interleaved1f1b"].summary["ac"] == "full"
    equals_one_process(runs["interleaved1f1b"], one, [0, 3], "pp 2 × tp 2 `--sp --ac full`, interleaved 1F1B, 2 "
                       "stages a rank round-robin")
    equals_one_process(runs["dpzbv"], one, [0, 3], "dp 2 × pp 2, ZB-V, 2 stages a rank in a V, 2 micro-batches of 1")


def test_sequence_parallel_beside_context_parallel_is_one_process(runs):
    """cp 2 x tp 2 --sp --ac selective on 4 processes (the 4-block copy, 3 steps, batch 4): each cp rank's zigzag
    share (chunks r and 3 - r of 4, 12 tokens) is cut again over its tp pair (6 tokens each) between the blocks; the
    ring runs over cp on the share all-gathered over tp; each block's matmul, attention and reduce-scatter outputs
    kept, the rest recomputed in backward. Every state, loss and gradient norm, the held-out loss and the sample:
    one process's. Planted: norm2 left out of the --sp plan (its weight gradient a sum over one tp rank's 6 tokens
    of each share): 4.6e-2 from one process."""
    run = runs["cpsp"]
    s = run.summary
    assert (s["world_size"], s["dp"], s["pp"], s["cp"], s["tp"], s["sp"], s["ac"]) == (4, 1, 1, 2, 2, True,
                                                                                         "selective"), s
    assert "world size 4 = dp 1 x cp 2 (ring, zigzag) x tp 2" in run.stdout, run.stdout
    equals_one_process(run, runs["one4"], [0, 3], "cp 2 × tp 2 `--sp --ac selective`, batch 4 (4 processes)")


def test_split_backward_with_selective_checkpointing_is_refused_in_one_line():
    """A zero-bubble schedule splits each backward in two passes over a block; torch's selective checkpointing
    allows one (unrefused, every rank died in torch's 'Trying to backward an extra time ... under selective activation
    checkpoint', pp 2 x cp 2 interleavedzb and pp 2 zbv, torch 2.13.0). Refused before training, as --compile with
    these schedules is; --ac full recomputes for each pass (DualPipeV x cp 2 --ac full above equals one process)."""
    refused_in_one_line([([*FS, "--pp-schedule", schedule, "--stages-per-rank", "2", "--accumulate", "4", "--ac",
                           "selective"], {"WORLD_SIZE": "2"}, "--ac") for schedule in ("interleavedzb", "zbv",
                                                                                         "dualpipev")], STAGE)


def test_bad_combinations_are_one_line_and_exit_2():
    """What must divide what (pp x cp x tp the world; pp at most the blocks and, under 1F1B, the micro-batches), pp
    without FSDP2; and the controls accepted. (cp's own refusals, the same code: tests/test_context_parallel.py.)"""
    cases = [
        (["--pp", "2"], {"WORLD_SIZE": "2"}, "--pp: pipelining is combined with FSDP2"),
        (["--pp", "3", "--parallel", "fsdp", "--accumulate", "3"], {"WORLD_SIZE": "4"},
         "--pp: 3 x --cp 1 x --tp 1 does not divide the world size 4"),
        (["--pp", "2", "--cp", "2", "--tp", "2", "--parallel", "fsdp", "--accumulate", "2"], {"WORLD_SIZE": "4"},
         "--pp: 2 x --cp 2 x --tp 2 does not divide the world size 4"),
        (["--pp", "4", "--parallel", "fsdp", "--accumulate", "4", "--layers", "3"], {"WORLD_SIZE": "4"},
         "--pp: 4 stages need at least 4 blocks"),
        (["--pp", "2", "--parallel", "fsdp"], {"WORLD_SIZE": "2"}, "--accumulate: 1F1B needs at least one"),
        # --stages-per-rank: what torch's multi-stage schedules assert, refused before
        (["--stages-per-rank", "2"], {"WORLD_SIZE": "1"}, "--stages-per-rank: 2 stages a rank cut a pipeline"),
        (["--pp-schedule", "zbv"], {"WORLD_SIZE": "1"}, "--pp-schedule: zbv runs several stages a rank of a pipeline"),
        ([*FS, "--stages-per-rank", "2", "--accumulate", "4"], {"WORLD_SIZE": "2"},
         "--stages-per-rank: 1f1b runs one stage a rank"),
        ([*FS, "--pp-schedule", "interleaved1f1b"], {"WORLD_SIZE": "2"}, "--stages-per-rank: interleaved1f1b holds"),
        ([*FS, "--pp-schedule", "zbv", "--stages-per-rank", "3", "--layers", "6"], {"WORLD_SIZE": "2"},
         "--stages-per-rank: zbv places exactly 2 stages a rank"),
        ([*FS, "--pp-schedule", "zbv", "--stages-per-rank", "2", "--layers", "3"], {"WORLD_SIZE": "2"},
         "--stages-per-rank: --pp 2 x 2 = 4 stages need at least 4 blocks"),
        ([*FS, "--pp-schedule", "interleavedzb", "--stages-per-rank", "2", "--accumulate", "5"], {"WORLD_SIZE": "2"},
         "--accumulate: interleavedzb runs the micro-batches in --accumulate // --pp = 2 rounds"),
        ([*FS, "--pp-schedule", "dualpipev", "--stages-per-rank", "2", "--accumulate", "3"], {"WORLD_SIZE": "2"},
         "--accumulate: dualpipev needs a micro-batch per stage, 4, not 3"),
        ([*FS, "--pp-schedule", "zbv", "--stages-per-rank", "2", "--compile"], {"WORLD_SIZE": "2"},
         "--compile: zbv splits each backward in two"),
    ]
    refused_in_one_line(cases, STAGE)
    assert refusal(["--pp", "2", "--parallel", "fsdp", "--pp-schedule", "gpipe"], {"WORLD_SIZE": "2"},
                   STAGE)[0] == "accepted"  # GPipe runs with fewer micro-batches than stages
    assert refusal(["--pp", "2", "--tp", "2", "--cp", "2", "--parallel", "fsdp", "--accumulate", "2"],
                   {"WORLD_SIZE": "8"}, STAGE)[0] == "accepted"
    for accepted in (["--pp-schedule", "interleaved1f1b", "--accumulate", "3"],  # 1 round of 3: torch runs it
                     ["--pp-schedule", "zbv", "--accumulate", "1"],
                     ["--pp-schedule", "dualpipev", "--accumulate", "4"]):
        assert refusal([*FS, "--stages-per-rank", "2", *accepted], {"WORLD_SIZE": "2"}, STAGE)[0] == "accepted"
