"""What every stage promises on its own: it learns, reports honestly, and its replicas agree."""
from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS, DTYPE, B, W
from harness import Step, load_stage


def expected_world_and_backend(step: Step) -> tuple[int, str | None]:
    if step.launcher == "torchrun":
        world = step.nproc * step.nnodes
    else:
        world = int(step.args[step.args.index("--world-size") + 1]) if "--world-size" in step.args else 1
    return world, (None if step.stage < "03" else "gloo")  # 01 and 02 have no process group


@pytest.mark.parametrize("name", CONFIGS)
def test_stage_learns_and_reports(runs, name):
    run = runs[name]
    s = run.summary
    assert s["stage"] == CONFIGS[name].stage
    assert (s["world_size"], s["backend"]) == expected_world_and_backend(CONFIGS[name])
    assert s["device"] == "cpu" and s["dtype"] == DTYPE
    assert s["global_batch"] == W * B
    assert s["steps"] == s["epochs"] * 4096 // (W * B)
    assert len(s["losses"]) == s["epochs"]
    # The task has a known answer: the loss must really fall (in the tour's 5 epochs, 0.60 to 0.086) and the held-out
    # set be learnt.
    assert s["losses"][-1] < s["losses"][0] / 5, s["losses"]
    assert s["eval_accuracy"] > 0.95 and s["eval_count"] == 1001
    assert s["seconds"] > 0 and s["samples_per_s"] > 0
    # No replicas where each rank holds other pieces of the one model (08, 09): nothing to compare, nothing gathered.
    assert s["replica_max_abs_diff"] == (None if name in ("08", "09") else 0.0)


@pytest.mark.parametrize("name", ["03", "04"])
def test_only_rank_zero_logs(runs, name):
    out = runs[name].stdout
    assert out.count("held-out:") == 1 and out.count("epoch 1/") == 1, out
    assert f"world size {W} | backend gloo" in out


@pytest.mark.parametrize("name", CONFIGS)
def test_saved_model_is_unwrapped_and_loads_into_stage_01(runs, name):
    state = runs[name].model
    assert not any(k.startswith("module.") for k in state)
    model = load_stage("01_single_gpu").Net()
    model.load_state_dict(state)  # strict: same keys, same shapes
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cpu_fallback_is_announced(runs):
    # The tour ran with --device auto and no GPU visible: every stage says it falls back, once.
    for name in CONFIGS:
        assert runs[name].stdout.count("no GPU visible: using the CPU") == 1, (name, runs[name].stdout)
    assert "DataParallel has no devices to split over" in runs["02"].stdout


def test_multinode_layout_is_node_major(runs):
    """global rank = node * nproc_per_node + local rank; one rank 0 in the whole job."""
    step, s = CONFIGS["05"], runs["05"].summary
    assert s["nodes"] == step.nnodes == len({p["node"] for p in s["layout"]})
    for p in s["layout"]:
        assert p["rank"] == p["node"] * step.nproc + p["local_rank"]
    assert sorted(p["rank"] for p in s["layout"]) == list(range(s["world_size"]))
    out = runs["05"].stdout
    assert out.count("held-out:") == 1 and out.count("| global rank ") == s["world_size"], out
