"""Stage 09: tensor parallelism on a dp x tp mesh still computes stage 01's training, each rank holds its slice of
every layer, the tp ranks of a row share their samples, and checkpoints move between meshes.

The dp 1 x tp 2 run is the suite's (conftest, checked with every stage in test_equivalence.py); here dp 2 x tp 1
trains 2 epochs and leaves a checkpoint, which dp 2 x tp 2 (4 processes) resumes to epoch 4.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace
from unittest import mock

import pytest

from conftest import CONFIGS, DTYPE, B, W
from harness import (
    Run,
    check,
    launch,
    load_stage,
    max_gap,
    mutate,
    replay_error,
    time_limit,
    tolerance,
    with_args,
    with_batch,
)

STAGE = "09_tensor_parallel"
TOL = tolerance(DTYPE)
# The split dimension of each parameter over tp: 0 for a column-wise layer's rows, 1 for a row-wise layer's
# columns; None for the row-wise layer's bias, added after the all-reduce and so kept whole on every tp rank.
SPLIT = {"body.0.weight": 0, "body.0.bias": 0, "head.0.weight": 1, "head.0.bias": None,
         "head.2.weight": 0, "head.2.bias": 0}
TP_TALK = {"allreduce": 2, "allgather": 1}  # forward: head.0's all-reduce, head.2's all-gather; backward: 1 all-reduce
FSDP_TALK = {"allgather": 4, "reduce_scatter": 2}  # stage 08's: two units, resharded after forward


@pytest.fixture(scope="module")
def meshes(runs, tmp_path_factory) -> dict[tuple[int, int], Run]:
    """{(dp, tp): run}: the suite's 1 x 2 (the tour's 5 epochs), 2 x 1 (2 epochs), and 2 x 2 resumed from 2 x 1's
    checkpoint."""
    tmp = tmp_path_factory.mktemp("meshes")
    rows = with_args(with_batch(CONFIGS["09"], B), "--snapshot", str(tmp / "ck"))  # dp ranks of batch B: global W*B
    dp2 = check(launch(with_args(rows, "--tp", "1", "--epochs", "2"), out=tmp / "2x1"))
    grid = check(launch(replace(with_args(rows, "--tp", "2", "--epochs", "4"), nproc=2 * W), out=tmp / "2x2",
                        timeout=time_limit(programs=2 * W)))
    return {(1, W): runs["09"], (W, 1): dp2, (W, W): grid}


def test_every_mesh_computes_stage_01s_training(runs, meshes):
    for (dp, tp), run in meshes.items():
        s = run.summary
        assert (s["dp"], s["tp"], s["world_size"], s["global_batch"]) == (dp, tp, dp * tp, W * B), s
        assert replay_error(s, run.trajectory) <= TOL, (dp, tp)
        assert max_gap(run.trajectory[-1]["params"], runs["01"].trajectory[s["epochs"]]["params"]) <= TOL, (dp, tp)
    resumed = meshes[(W, W)]
    assert resumed.summary["resumed_from_epoch"] == 2 and "(written by 2 ranks) after epoch 2" in resumed.stdout
    assert resumed.summary["losses"] == pytest.approx(runs["01"].summary["losses"][:4], rel=1e-9)


def test_ranks_sit_in_rows_of_tp(meshes):
    """Rank r is at dp r // tp, tp r % tp: consecutive ranks (one node's) form a row."""
    for (dp, tp), run in meshes.items():
        layout = run.summary["layout"]
        assert [(p["dp"], p["tp"]) for p in layout] == [divmod(r, tp) for r in range(dp * tp)], layout
        assert f"world size {dp * tp} = dp {dp} x tp {tp}" in run.stdout


def test_each_rank_holds_its_slice_of_every_layer(meshes):
    """1/tp of each split weight along its split dimension, then 1/dp of that along dimension 0 (FSDP2)."""
    full = {k: list(v.shape) for k, v in load_stage("01_single_gpu").Net().state_dict().items()}
    for (dp, tp), run in meshes.items():
        s = run.summary
        expected = {}
        for name, shape in full.items():
            shape = list(shape)
            if SPLIT[name] is not None:
                shape[SPLIT[name]] //= tp
            shape[0] //= dp
            expected[name] = shape
        assert s["shard_shapes"] == [expected] * (dp * tp), (dp, tp)
        held = sum(map(math.prod, expected.values())) * 8  # float64 bytes of this rank's parameters
        assert [b["params"] for b in s["bytes_per_rank"]] == [held] * (dp * tp)
        whole_bias = full["head.0.bias"][0] * 8 // dp  # the one piece not split over tp
        assert held == s["full_bytes"]["params"] // (dp * tp) + whole_bias - whole_bias // tp


def test_collectives_of_one_step(meshes):
    """tp talks inside the layers (two all-reduces, one all-gather), FSDP2 over dp as in stage 08; a dimension of
    size 1 says nothing."""
    for (dp, tp), run in meshes.items():
        assert run.summary["collectives_per_step"] == {"dp": FSDP_TALK if dp > 1 else {},
                                                       "tp": TP_TALK if tp > 1 else {}}, (dp, tp)
    assert "tp: 1 allgather, 2 allreduce" in meshes[(W, W)].stdout


def test_tp_ranks_given_different_samples_fail(runs, tmp_path):
    """Negative control: a sampler by global rank gives the two tp ranks different samples; the run still
    finishes, and the replay catches it in one epoch."""
    path = mutate(STAGE, "prepare_dataloader(train_set, args.batch_size, dp_rank, dp_size, args.seed)",
                  "prepare_dataloader(train_set, args.batch_size, rank, world_size, args.seed)", tmp_path / "src")
    run = check(launch(with_args(CONFIGS["09"], "--epochs", "1"), out=tmp_path / "out", script=path))
    assert replay_error(run.summary, run.trajectory) > 1e-3 > TOL
    assert max_gap(run.trajectory[1]["params"], runs["01"].trajectory[1]["params"]) > 1e-3


@pytest.mark.parametrize("env,args,tp,refused", [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, [], 4, None),  # default: the processes of this node
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, [], 2, None),  # two nodes of two: a row per node
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, [], 1, None),  # one process per node: data parallel only
    # The commonest GPU node: 8 does not divide the 4 classes, so the default is the most that does: dp 2 x tp 4.
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, [], 4, None),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, [], 4, None),  # two such nodes: dp 4 x tp 4, rows inside nodes
    ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "6"}, [], 2, None),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, ["--hidden", "6"], 2, None),  # 6 hidden units: tp 2 at most
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, ["--tp", "3"], None, "3 does not divide the world size 4"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, ["--tp", "4", "--hidden", "6"], None,
     "4 does not divide --hidden 6 and the 4 classes"),
])
def test_tp_follows_the_node_and_must_divide(env, args, tp, refused, capsys):
    with mock.patch.dict(os.environ, env):
        if refused is None:
            assert load_stage(STAGE).parse_args(args).tp == tp
            return
        with pytest.raises(SystemExit) as exit_:
            load_stage(STAGE).parse_args(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{STAGE}/train.py: error: argument --tp: ") and refused in err and "\n" not in err
